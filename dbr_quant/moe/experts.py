"""Mixture-of-experts modules with 3-D expert weights: FP8 storage, per-expert scales, one FP8 MoE op.

Transformers 5 keeps an MoE layer's experts in one module with 3-D parameters (``MixtralExperts``:
``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], decorated ``@use_experts_implementation``) whose
forward ``config._experts_implementation`` picks: a Python loop over the experts hit (``eager``),
``batched_mm`` or ``grouped_mm``. Their torch ops say little (an ``F.linear`` per expert hit, a ``bmm`` of
gathered weights, a ``grouped_mm``), so dbr_quant recognises the module by what it holds and intercepts
its *call*, whole, in every phase — the three implementations take the same path:

* trace: the module runs as written, nothing inside is recorded; it gets a :class:`MoeState` with two
  ops, ``<fqn>.gate_up_proj`` and ``<fqn>.down_proj`` (kind ``experts``: the report's rows);
* calibrate: the experts are computed in high precision expert by expert from the top-k ids the module
  receives; the hidden states feed the gate_up input's observer, each expert's ``act(gate)·up`` rows
  that expert's down-input observer;
* convert: both parameters become FP8 (``FP8Weight`` [E, N, K], one scale per expert and output channel,
  reporting the original dtype and shape), and a call runs ``kernels.fp8_moe_block``: quantize,
  gate_up grouped GEMM with SwiGLU and FP8 out, down grouped GEMM with the weighted scatter-add. The
  routing comes from the call's arguments, so any routing runs in FP8 and nothing is matched by call order.

Activation scales: one for the gate_up input (the same hidden states go to every expert: quantized once
per token), one per expert for the down input (produced by each expert's own weights). An expert that
received no calibration rows takes the largest down-input scale of the experts that did (reported) —
never an uncalibrated scale (benchmarks/moe_calibration.py measures the choice). The router, the linear
whose logits reach the top-k ids, stays high precision. An experts module this path cannot run (custom
gating such as GPT-OSS's clamp, gate/up rows interleaved, an activation without an FP8 epilogue) runs as
written in high precision, and the report says why. FP8 storage of the weights: moe_weights.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dbr_quant import kernels
from dbr_quant.ops.straight_through import run_straight_through, substitute, wants_gradient
from dbr_quant.ops.tags import TAG, ModuleTag
from dbr_quant.quantize.weights import FP8Weight
from dbr_quant.runtime.interception import has_hooks, original_call, suspended
from dbr_quant.runtime.state import AutoQuantizationState, SeenOp, TensorInfo, observer_key

EXPERTS = "experts"  # the op kind of one 3-D expert tensor (a report row; not matched by the runtime)

# the activation function of a module, identified by its values (class names vary between models)
_PROBE = torch.linspace(-8.0, 8.0, 257)
_ACTIVATIONS = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
}
_GATED_EPILOGUE = {"silu": "swiglu", "gelu": "geglu"}  # act(gate)·up epilogues of the grouped GEMM


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """How a recognised experts module computes: which parameters, which activation epilogue."""

    num_experts: int
    first: str  # "gate_up_proj" (gated) or "up_proj"
    gated: bool
    transposed: bool  # parameters stored [E, in, out]
    has_bias: bool
    activation: str | None  # the kernels' epilogue name: "swiglu", "geglu", "relu", …
    reason: str = ""  # why it runs as written in high precision ("" when it runs in FP8)

    @property
    def names(self) -> tuple[str, str]:
        return self.first, "down_proj"


def experts_spec(module: nn.Module) -> ExpertsSpec | None:
    """An ``ExpertsSpec`` when ``module`` is a Hugging Face experts module with 3-D weights, else None."""
    if not all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated", "act_fn")):
        return None
    gated = bool(module.has_gate)
    first = "gate_up_proj" if gated else "up_proj"
    w1, w2 = module._parameters.get(first), module._parameters.get("down_proj")
    if w1 is None or w2 is None or w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != w2.shape[0]:
        return None
    transposed, has_bias = bool(module.is_transposed), bool(getattr(module, "has_bias", False))
    act = _activation_name(module.act_fn)
    reason = ""
    if gated and not module.is_concatenated:
        reason = "gate and up rows are interleaved (is_concatenated=False); the FP8 MoE kernel takes [gate; up]"
    elif gated and _qualname(getattr(type(module), "_apply_gate", None)) != "transformers.integrations.moe." \
            "_default_apply_gate":
        reason = f"{type(module).__name__} has its own gate function (_apply_gate), which has no FP8 epilogue"
    elif act is None or (gated and act not in _GATED_EPILOGUE):
        reason = f"activation {type(module.act_fn).__name__} has no FP8 grouped-GEMM epilogue"
    elif getattr(module, "_is_expert_parallel", False):
        reason = "expert parallel (sentinel expert ids) is not supported"
    elif not all(w.dtype in (torch.float32, torch.bfloat16, torch.float16) for w in (w1, w2)):
        reason = f"expert weights have dtype {w1.dtype}"
    epilogue = (_GATED_EPILOGUE.get(act) if gated else act) if not reason else None
    return ExpertsSpec(int(w1.shape[0]), first, gated, transposed, has_bias, epilogue, reason)


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"


def _activation_name(act: Any) -> str | None:
    if not callable(act):
        return None
    try:
        with torch.no_grad():
            y = act(_PROBE.clone())
    except Exception:  # noqa: BLE001 - an activation that does not take a plain tensor: not ours to run
        return None
    for name, ref in _ACTIVATIONS.items():
        if isinstance(y, torch.Tensor) and y.shape == _PROBE.shape and torch.allclose(y, ref(_PROBE), atol=1e-6):
            return name
    return None


def mark_experts(model: nn.Module) -> None:
    """Mark every recognised experts module (``prepare``, before the trace): its calls come here."""
    for mod in model.modules():
        spec = experts_spec(mod)
        if spec is not None:
            mod.__dict__[TAG].experts = spec


# ------------------------------------------------------------------------------------------- state
class MoeState(AutoQuantizationState):
    """An experts module's record: two ops (gate_up, down) with their activation observers.

    The gate_up input (the block's hidden states, the same tensor for every expert) has one observer and
    one scale: quantized once per token. The down input (``act(gate)·up``, computed by each expert's own
    weights) has one observer and one scale per expert. ``rows`` counts the calibration rows (token, slot
    pairs) each expert received. benchmarks/moe_calibration.py measures these choices against the others.
    """

    def __init__(self, fqn: str, spec: ExpertsSpec, ops: list[SeenOp]) -> None:
        super().__init__(fqn)
        self.spec = spec
        self.seen_ops = ops
        self.register_buffer("rows", torch.zeros(spec.num_experts, dtype=torch.int64))
        if self.static:
            for op in ops:
                cfg = op.qconfig.activation
                keys = [observer_key(0, "input")] if op.index == 0 else [_expert_key(1, e)
                                                                         for e in range(spec.num_experts)]
                for key in keys:
                    self.observers[key] = cfg.observer.create(cfg.format, None)

    @property
    def quantized(self) -> bool:
        return all(op.quantize for op in self.seen_ops)

    @property
    def static(self) -> bool:
        return self.quantized and not self.seen_ops[0].qconfig.dynamic

    @property
    def fallback(self) -> list[int]:
        """Experts without calibration rows: their down-input scale is the max over the others'."""
        return (self.rows == 0).nonzero().flatten().tolist()

    def observe(self, x: torch.Tensor) -> None:  # the gate_up input, all tokens
        self.observers[observer_key(0, "input")](x)

    def observe_expert(self, expert: int, h: torch.Tensor) -> None:  # the down input of one expert's rows
        self.observers[_expert_key(1, expert)](h)

    def uncalibrated(self) -> list[str]:
        """Only when no expert saw calibration data: one expert's data is enough to fall back on."""
        if not self.static or bool((self.rows > 0).any()):
            return []
        return [f"{self.fqn}: {op.fqn} input (no expert received a calibration token)" for op in self.seen_ops]

    def freeze_scales(self) -> None:
        """The gate_up input scale, and one down-input scale per expert: experts without calibration rows
        take the largest of the others'."""
        if self.static:
            self.register_buffer(f"scale_{observer_key(0, 'input')}",
                                 self.observers[observer_key(0, "input")].scale().detach().clone())
            obs = [self.observers[_expert_key(1, e)] for e in range(self.spec.num_experts)]
            scale, _ = expert_scales(obs, self.rows > 0)
            self.register_buffer(f"scale_{observer_key(1, 'input')}", scale)
        self.converted = True


def _expert_key(op_index: int, expert: int) -> str:
    return f"{op_index}_input_e{expert}"


def has_data(obs: nn.Module) -> bool:
    """An observer that saw a non-zero finite value (an expert called with empty inputs has not)."""
    return bool(obs.calibrated) and bool(torch.isfinite(obs.amax).all() and (obs.amax > 0).any())


def expert_scales(observers: list[nn.Module], seen: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """Per-expert scales from per-expert observers ([E]); an expert without data (``seen`` False, or an
    observer that saw nothing) gets the largest scale among the experts with data: its inputs are
    unknown, the widest range measured on its siblings clips least. Returns (scales, fallback experts)."""
    ok = [has_data(o) and (seen is None or bool(seen[e])) for e, o in enumerate(observers)]
    if not any(ok):
        raise RuntimeError("dbr_quant: no expert of this group saw calibration data")
    measured = {e: o.scale().detach().float().reshape(()) for e, o in enumerate(observers) if ok[e]}
    fallback = torch.stack(list(measured.values())).amax()
    missing = [e for e in range(len(observers)) if not ok[e]]
    return torch.stack([measured.get(e, fallback) for e in range(len(observers))]).clone(), missing


def fallback_note(missing: list[int], total: int) -> str:
    if not missing:
        return ""
    shown = ", ".join(map(str, missing[:8])) + (", …" if len(missing) > 8 else "")
    return (f"{len(missing)}/{total} experts got no calibration tokens ({shown}): their input scale is the "
            f"max over the calibrated experts'")


# ------------------------------------------------------------------------------------------- calls
def experts_call(run: Any, module: nn.Module, args: tuple, kwargs: dict, phase: str) -> Any:
    """A call of a marked experts module, from a run's ``module_call``. ``phase``: "trace", "calibrate",
    "convert" (FP8 when converted) or "hp" (as written)."""
    if phase == "trace":
        return _trace_call(run, module, args, kwargs)
    with suspended(run):
        if getattr(run, "placeholders", None) or getattr(run, "resolved", None):  # ConvertRun: a pending
            args, kwargs = run._resolve_all(*run._scan(args, kwargs))  # subgraph's output feeds it: finish that
        st = module._modules.get("_auto_quant_state")
        bound = _bind(args, kwargs)
        if not isinstance(st, MoeState) or bound is None or not st.quantized:
            return original_call(module, *args, **kwargs)
        inspector = getattr(run, "inspector", None)  # a dbr_quant.inspect session: expert tensors are layers
        if inspector is not None and hasattr(inspector, "experts") and (st.converted or phase == "hp"):
            body = lambda a, k: inspector.experts(module, st, *_bind(a, k))  # noqa: E731
        elif phase == "calibrate" and st.static:
            body = lambda a, k: _hp_experts(module, st, *_bind(a, k), observe=True)  # noqa: E731
        elif phase == "convert" and st.converted:
            body = lambda a, k: _converted_experts(module, st, a, k)  # noqa: E731
        else:
            return original_call(module, *args, **kwargs)
        return _with_hooks(module, body, args, kwargs) if has_hooks(module) else body(args, kwargs)


def _converted_experts(module: nn.Module, st: MoeState, args: tuple, kwargs: dict) -> Any:
    """The FP8 experts; with straight-through gradients (straight_through.py: the module as written, its FP8
    weights dequantized, is the reference) when grad mode is on and an input or bias requires grad."""
    fp8 = lambda: _fp8_experts(module, st, *_bind(args, kwargs))  # noqa: E731
    tensors = wants_gradient((), (*args, *kwargs.values(), *(p for p in module._parameters.values()
                                                              if p is not None and p.requires_grad)))
    if tensors is None:
        return fp8()
    # the class's forward, not the module call: in backward no run is active, and calling the module would
    # enter the converted model again (its FP8 path)
    reference = lambda sub: type(module).forward(module, *(substitute(a, sub) for a in args),  # noqa: E731
                                                 **{k: substitute(v, sub) for k, v in kwargs.items()})
    return run_straight_through(fp8, reference, tensors, lambda: f"experts {st.fqn}")


def _bind(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(hidden_states, top_k_index, top_k_weights) of an experts call, or None for another signature."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    if len(args) > 3 or set(kwargs) - set(names[len(args):]):
        return None
    vals = list(args) + [kwargs.get(n) for n in names[len(args):]]
    x, ids, w = vals
    if not all(isinstance(t, torch.Tensor) for t in vals) or not x.is_floating_point() or ids.is_floating_point():
        return None
    # math.prod, not Size.numel(): keeps token counts symbolic while fx_rewriter exports (numel() specialises)
    if ids.dim() < 1 or ids.shape != w.shape or math.prod(ids.shape[:-1]) * x.shape[-1] != x.numel():
        return None
    return x, ids, w


def _with_hooks(module: nn.Module, body, args: tuple, kwargs: dict) -> Any:
    """``nn.Module.__call__``'s forward pre-hooks and hooks around ``body``: the module's forward is
    replaced, its users' hooks still see its real inputs and output."""
    for hid, hook in list(module._forward_pre_hooks.items()):
        if hid in module._forward_pre_hooks_with_kwargs:
            res = hook(module, args, kwargs)
            if res is not None:
                args, kwargs = res
        else:
            res = hook(module, args)
            if res is not None:
                args = res if isinstance(res, tuple) else (res,)
    out = body(args, kwargs)
    for hid, hook in list(module._forward_hooks.items()):
        res = hook(module, args, kwargs, out) if hid in module._forward_hooks_with_kwargs else hook(module, args, out)
        if res is not None:
            out = res
    return out


def _trace_call(run: Any, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Run the module as written (nothing inside recorded), log its dataflow, give it a MoeState."""
    with suspended(run):
        run.stack.append(module)  # so an error inside names this module
        try:
            out = original_call(module, *args, **kwargs)
        except BaseException:
            run.failed_stack = run.failed_stack or list(run.stack)
            raise
        finally:
            run.stack.pop()
        run._record(None, module, args, kwargs, out)  # an opaque op: its inputs have a consumer
        if has_hooks(module):
            run._escape((args, kwargs, out))
        bound = _bind(args, kwargs)
        if module not in run.states:
            run.states[module] = _new_state(run, module, bound)
        if bound is not None:
            keep_router_high_precision(run, bound[1:])
    return out


# Measured on the test suite's small Mixtral (3 seeds, logits vs fp32): router in FP8 0.078 relative error,
# min cosine 0.9953; router in high precision 0.068, 0.9972. It is 0.1 % of the weights, and as a functional
# F.linear its weight would be quantized on every call (two extra launches per layer).
ROUTER_REASON = ("MoE router: its logits pick the experts, so it stays high precision (as vLLM and llm-compressor "
                 "keep it)")


def keep_router_high_precision(run: Any, routing: tuple[torch.Tensor, ...], max_steps: int = 16) -> None:
    """Walk the trace's dataflow back from the top-k ids and weights an experts module receives (topk ←
    softmax ← …) to the linear ops that computed the router logits, and keep those in high precision."""
    todo = [run.tids[id(t)] for t in routing if id(t) in run.tids]
    seen: set[int] = set()
    for _ in range(max_steps):
        if not todo:
            return
        tid = todo.pop()
        ev_index = run.producers.get(tid)
        if ev_index is None or ev_index in seen:
            continue
        seen.add(ev_index)
        ev = run.events[ev_index]
        if ev.op is not None and ev.op.kind == "linear":
            _keep_high_precision(run, ev.op)
            continue  # the router's input is the block's input: stop there
        todo.extend(i for i in (*ev.arg_ids, *ev.kwarg_ids) if i is not None)


def _keep_high_precision(run: Any, op: SeenOp) -> None:
    if not op.quantize:
        return
    for st in run.states.values():
        if any(o is op for o in st.seen_ops):
            for key in (observer_key(op.index, slot) for slot in op.slots):
                if key in st.observers:
                    del st.observers[key]
    op.quantize, op.reason, op.slots = False, ROUTER_REASON, ()


def _new_state(run: Any, module: nn.Module, bound: tuple | None) -> MoeState:
    tag: ModuleTag = module.__dict__[TAG]
    spec, fqn = tag.experts, tag.fqn or ""
    assert spec is not None, "only a marked experts module (mark_experts) is called as one op"
    types = tuple(type(m) for m in run.stack) + (type(module),)
    qconfig = run.record.qconfig
    reason = spec.reason
    if not reason and bound is None:
        reason = "called with other arguments than (hidden_states, top_k_index, top_k_weights)"
    if not reason and bound[0].dtype == torch.float64:
        reason = "hidden_states have dtype torch.float64"
    qcs = [qconfig.for_op(f"{fqn}.{name}", types) for name in spec.names]
    if not reason and any(qc.skip for qc in qcs):
        reason = "skipped by a QConfig override (both expert projections run as one block)"
    if not reason and (qcs[0].dynamic != qcs[1].dynamic or qcs[0].activation.format != qcs[1].activation.format):
        reason = "the two expert projections resolve to different activation settings; the MoE block takes one"
    if not reason:
        reason = _block_reason(module, spec, qcs)
    ops = []
    for i, (name, qc) in enumerate(zip(spec.names, qcs)):
        w = module._parameters[name]
        io = _routed_rows(bound, w, spec.transposed)
        ops.append(SeenOp(index=i, kind=EXPERTS, fqn=f"{fqn}.{name}", target=type(module).__name__, inputs=io[:1],
                          outputs=io[1:], qconfig=qc, quantize=not reason, reason=reason,
                          slots=("input",) if not reason else (), weight_owner=fqn,
                          fusion=f"moe_block[{w.shape[0]} experts]" if not reason else None))
    return MoeState(fqn, dataclasses.replace(spec, reason=reason), ops)


def _block_reason(module: nn.Module, spec: ExpertsSpec, qcs: list) -> str:
    """Why block-scaled weights cannot run this experts module ("" when they can, or are not asked for)."""
    blocks = [qc.weight.block if qc.weight.granularity == "block" else None for qc in qcs]
    if blocks[0] is None and blocks[1] is None:
        return ""
    if blocks[0] != blocks[1]:
        return (f"the two expert projections resolve to different weight granularities ({blocks[0] or 'not block'} "
                f"vs {blocks[1] or 'not block'}); the MoE block takes one: give both the same block")
    w1 = module._parameters[spec.first]
    inter = (w1.shape[2] if spec.transposed else w1.shape[1]) // (2 if spec.gated else 1)
    if spec.gated and inter % blocks[0][0]:
        return (f"block-scaled experts need the intermediate size ({inter}) to be a multiple of the block's rows "
                f"({blocks[0][0]}): gate and up are blocked on their own in [gate; up]; pick a block that divides it")
    return ""


def _routed_rows(bound: tuple | None, w: torch.Tensor, transposed: bool) -> tuple[TensorInfo, ...]:
    """(input [rows, K], output [rows, N]) of one expert tensor at the trace: one row per (token, top-k slot)
    routed, all experts together (what ``dq.inspect`` counts FLOPs on). The rows exist only inside the call,
    so they have no trace id (-1)."""
    if bound is None:
        return ()
    x, ids, _ = bound
    rows = int(math.prod(ids.shape))
    n, k = (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])
    return TensorInfo(-1, x.dtype, (rows, int(k))), TensorInfo(-1, x.dtype, (rows, int(n)))


# ------------------------------------------------------------------------------------------- compute
def _flat(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    return x.reshape(-1, x.shape[-1]), ids.reshape(-1, ids.shape[-1]), w.reshape(-1, w.shape[-1])


def _expert_weight(p: torch.Tensor, e: int, transposed: bool) -> torch.Tensor:
    return p[e].t() if transposed else p[e]


def _hp_experts(module: nn.Module, st: MoeState, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                observe: bool) -> torch.Tensor:
    """The experts in high precision, expert by expert (what every experts implementation computes), each
    expert's gate_up and down inputs fed to its observers."""
    spec = st.spec
    x2, ids2, w2 = _flat(x, ids, weights)
    routing = kernels.moe_route(ids2, spec.num_experts)
    p1, p2 = (module._parameters[n] for n in spec.names)
    b1, b2 = (module._parameters.get(f"{n}_bias") if spec.has_bias else None for n in spec.names)
    tokens, offsets = routing.tokens, routing.expert_offsets.tolist()
    row_w = routing.row_weights(w2)
    out = torch.zeros(x2.shape[0], p2.shape[1] if not spec.transposed else p2.shape[2], dtype=torch.float32,
                      device=x.device)
    if observe:
        st.rows += routing.counts.to(st.rows.device)
        st.observe(x2)
    for e in range(spec.num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        tok = tokens[lo:hi]
        xe = x2[tok]
        y = F.linear(xe, _expert_weight(p1, e, spec.transposed), None if b1 is None else b1[e])
        h = module._apply_gate(y) if spec.gated else module.act_fn(y)
        y = F.linear(h, _expert_weight(p2, e, spec.transposed), None if b2 is None else b2[e])
        if observe:
            st.observe_expert(e, h)
        out.index_add_(0, tok, y.float() * row_w[lo:hi, None])
    return out.to(x.dtype).reshape(x.shape)


def _fp8_experts(module: nn.Module, st: MoeState, x: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """The converted experts: :func:`fp8_experts_compute`, or while ``fx_rewriter`` captures a graph one
    ``dbr_quant::fp8_moe_experts`` node (the routing, whose row counts depend on the data, stays inside)."""
    spec = st.spec
    x2, ids2, w2 = _flat(x, ids, weights)
    p1, p2 = (module._parameters[n] for n in spec.names)
    if type(p1) is not FP8Weight or type(p2) is not FP8Weight:
        raise RuntimeError(f"dbr_quant: experts module '{st.fqn}' is converted but its weights are not FP8; "
                           "convert the prepared model with dbr_quant.convert()")
    b1, b2 = (module._parameters.get(f"{n}_bias") if spec.has_bias else None for n in spec.names)
    gate_up, _ = st.seen_ops
    xs = hs = None
    if st.static:
        xs, hs = (st.frozen_scale(op, "input") for op in st.seen_ops)
        if xs.device != x.device:
            xs, hs = xs.to(x.device), hs.to(x.device)
    kw = dict(activation=spec.activation, fmt=gate_up.qconfig.activation.format,
              per_token=gate_up.qconfig.activation.granularity == "token", out_dtype=x.dtype)
    if p1.block is not None:  # block-scaled weights (both: checked when the state was made)
        kw.update(block=p1.block, group=gate_up.qconfig.activation.granularity == "group")
    args = (x2, ids2, w2, p1.qdata, p1.scale, p2.qdata, p2.scale, xs, hs, b1, b2)
    ops = kernels.graph_ops()
    if ops is not None:
        op = getattr(ops, "fp8_moe_experts", None)
        if op is None:
            raise NotImplementedError(f"dbr_quant: the graph op table {type(ops).__name__} has no fp8_moe_experts "
                                      f"op for the MoE experts module '{st.fqn}'; run the converted model eagerly")
        return op(*args, **kw).reshape(x.shape)
    return fp8_experts_compute(*args, **kw).reshape(x.shape)


def fp8_experts_compute(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13_q: torch.Tensor,
                        w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
                        x_scale: torch.Tensor | None, h_scale: torch.Tensor | None, bias13: torch.Tensor | None,
                        bias2: torch.Tensor | None, *, activation: str | None, fmt: Any, per_token: bool,
                        out_dtype: torch.dtype, block: tuple[int, int] | None = None,
                        group: bool = False) -> torch.Tensor:
    """An experts call on flat inputs (x [T, H], ids / weights [T, k]) → [T, H_out]: routing plan, then
    static scales (``x_scale``, ``h_scale`` given) → ``kernels.fp8_moe_block`` (3 launches after routing);
    dynamic → quantize, gate_up (high-precision out), quantize, down + scatter-add (4 launches). The eager
    model and the graph op ``dbr_quant::fp8_moe_experts`` both run this. ``block``: block-scaled weights
    (scales [E, ⌈N/bn⌉, ⌈K/bk⌉]), see :func:`_block_experts`."""
    routing = kernels.moe_route(ids, w13_q.shape[0])
    if block is not None:
        return _block_experts(x, routing, weights, w13_q, w13_scale, w2_q, w2_scale, x_scale, h_scale, bias13, bias2,
                              activation=activation, fmt=fmt, per_token=per_token, group=group, block=block,
                              out_dtype=out_dtype)
    if h_scale is not None:
        return kernels.fp8_moe_block(x, routing, weights, w13_q, w13_scale, w2_q, w2_scale, h_scale,
                                     x_scale=x_scale, activation=activation, fmt=fmt, bias13=bias13, bias2=bias2,
                                     out_dtype=out_dtype)
    x_q, xs = kernels.dynamic_quantize(x, fmt, per_token)
    h = kernels.fp8_grouped_linear(x_q, xs, w13_q, w13_scale, routing, bias=bias13, activation=activation,
                                   out_dtype=out_dtype)
    h_q, hs = kernels.dynamic_quantize(h, fmt, per_token)
    return kernels.fp8_grouped_linear(h_q, hs, w2_q, w2_scale, routing, x_sorted=True, bias=bias2,
                                      topk_weights=weights, out_dtype=out_dtype)


def _block_experts(x: torch.Tensor, routing: Any, weights: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor,
                   w2_q: torch.Tensor, w2_scale: torch.Tensor, x_scale: torch.Tensor | None,
                   h_scale: torch.Tensor | None, bias13: torch.Tensor | None, bias2: torch.Tensor | None, *,
                   activation: str | None, fmt: Any, per_token: bool, group: bool, block: tuple[int, int],
                   out_dtype: torch.dtype) -> torch.Tensor:
    """Block-scaled experts (the DeepSeek-V3 layout): quantize x (per-token groups of ``block[1]`` channels,
    or per-token / static scales repeated per group, as the dense block linear takes them), gate_up block GEMM
    per expert (high-precision out), quantize h the same way (static: each row with its expert's scale), down
    block GEMM per expert with the routing-weighted scatter-add (kernels.fp8_grouped_block_linear: reference
    path only)."""
    bk = block[1]
    x_q, xs = _group_layout(x, x_scale, fmt, per_token, group, bk)
    h = kernels.fp8_grouped_block_linear(x_q, xs, w13_q, w13_scale, routing, block=block, bias=bias13,
                                         activation=activation, out_dtype=out_dtype)
    row_scale = None if h_scale is None else h_scale if h_scale.numel() == 1 else h_scale[routing.row_experts]
    h_q, hs = _group_layout(h, row_scale, fmt, per_token, group, bk)
    return kernels.fp8_grouped_block_linear(h_q, hs, w2_q, w2_scale, routing, block=block, x_sorted=True,
                                            bias=bias2, topk_weights=weights, out_dtype=out_dtype)


def _group_layout(x: torch.Tensor, scale: torch.Tensor | None, fmt: Any, per_token: bool, group: bool,
                  bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x [rows, K], scale [rows, ⌈K/bk⌉]): dynamic per-token-group, or any coarser scale (dynamic per
    tensor / per token, static one value / one per row) repeated over the groups."""
    if scale is None and group:
        return kernels.group_quantize(x, bk, fmt)
    if scale is None:
        x_q, s = kernels.dynamic_quantize(x, fmt, per_token)
    else:
        s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
        x_q = kernels.quantize(x, s, fmt)
    return x_q, s.reshape(-1, 1).expand(x.shape[0], -(-x.shape[-1] // bk))


# ------------------------------------------------------------------------------------------- report
def report_rows(st: MoeState) -> list[dict[str, Any]]:
    """``dbr_quant.report`` rows of an experts module: one per 3-D expert tensor, FP8 or not and why (or
    which experts fell back to the max-over-experts down-input scale)."""
    rows = []
    for op in st.seen_ops:
        note = op.reason
        if op.quantize and op.qconfig.dynamic:
            note = "dynamic activation scales"
            if op.qconfig.weight.granularity == "block":
                bn, bk = op.qconfig.weight.block
                groups = f"per token per {bk} channels" if op.qconfig.activation.granularity == "group" else \
                    f"per {op.qconfig.activation.granularity}"
                note = f"dynamic activation scales ({groups}), {bn}×{bk} weight blocks"
        elif op.quantize and op.index == 1 and st.converted:
            note = fallback_note(st.fallback, st.spec.num_experts)
        rows.append({"fqn": op.fqn, "kind": EXPERTS, "module": st.fqn, "fp8": op.quantize, "fusion": op.fusion,
                     "reason": note, "weight": op.fqn})
    return rows

