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
whose logits reach the top-k ids, stays high precision. A module with a gate function of its own (GPT-OSS:
a clamped SwiGLU on interleaved gate/up columns, with biases) runs the gate_up grouped GEMM without an
epilogue, its own ``_apply_gate`` in high precision, then the quantized down GEMM. An experts module this
path cannot run (the default gate on interleaved rows, an activation without an FP8 epilogue) runs as
written in high precision, and the report says why.

Dense experts (Llama 4's ``Llama4TextExperts``: every expert runs on every token by ``torch.bmm``, its block
of the rows pre-scaled by the router's score) are recognised by their forward and run the same FP8 block:
:func:`bind_call` gives them the routing row r → expert r // T, weight 1, and each expert its own gate_up
input scale (the router scales each expert's rows differently); its router is found from the rows through
the top-k (trace.py).

Files: this one recognises the module (:class:`ExpertsSpec`), keeps its record (:class:`MoeState`: the
per-expert scales and their fallback rule) and reports it; trace.py makes the record, call.py runs a call in
each later phase, compute.py is the FP8 computation, weights.py the FP8 weights, siblings.py experts kept as
a ``ModuleList`` of MLPs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from dbr_quant.observers import AmaxObserver
from dbr_quant.ops.state import AutoQuantizationState, SeenOp, observer_key
from dbr_quant.ops.tags import TAG

EXPERTS = "experts"  # the op kind of one 3-D expert tensor (a report row; not matched by the runtime)

# the activation function of a module, identified by its values (class names vary between models)
_PROBE = torch.linspace(-8.0, 8.0, 257)
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
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
    activation: str | None  # the kernels' epilogue name: "swiglu", "geglu", "relu", … (None: own_gate)
    reason: str = ""  # why it runs as written in high precision ("" when it runs in FP8)
    # a gate function of its own (GptOssExperts._apply_gate: a clamped SwiGLU) runs in high precision between
    # the two FP8 grouped GEMMs (no epilogue); interleaved: gate / up are the even / odd rows of gate_up
    # (``is_concatenated=False``), not its two halves — the checkpoint's gate_proj / up_proj split follows it
    own_gate: bool = False
    interleaved: bool = False
    # every expert takes its own block of the input rows, every token (Llama4TextExperts: hidden_states [E·T, H]
    # viewed [E, T, H], each block pre-scaled by the router's scores, torch.bmm): no routing arguments, and one
    # gate_up input scale per expert (bind_call makes the routing: row r to expert r // T, weight 1)
    dense: bool = False

    @property
    def names(self) -> tuple[str, str]:
        return self.first, "down_proj"

    def weights(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's two 3-D expert weights (:attr:`names`; FP8Weight once converted)."""
        w1, w2 = (module._parameters[n] for n in self.names)
        if w1 is None or w2 is None:
            raise RuntimeError(f"dbr_quant: the MoE experts module {type(module).__name__} has no {self.names} "
                               "parameters any more; do not delete them from a prepared or converted model")
        return w1, w2

    def biases(self, module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The two weights' biases (``<name>_bias``), or None."""
        if not self.has_bias:
            return None, None
        b1, b2 = (module._parameters.get(f"{n}_bias") for n in self.names)
        return b1, b2

    def activate(self, module: nn.Module, y: torch.Tensor) -> torch.Tensor:
        """The module's own ``act(gate)·up`` (gated) or ``act(y)`` on the first projection's output ``y``."""
        m = cast(ExpertsModule, module)
        if self.dense:  # Llama4TextExperts.forward: gate, up = gate_up.chunk(2); up * act_fn(gate)
            gate, up = y.chunk(2, dim=-1)
            return up * m.act_fn(gate)
        return m._apply_gate(y) if self.gated else m.act_fn(y)


class ExpertsModule(Protocol):
    """What dbr_quant calls on a recognised experts module besides its parameters (:func:`experts_spec`)."""

    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def experts_spec(module: nn.Module) -> ExpertsSpec | None:
    """An ``ExpertsSpec`` when ``module`` is a Hugging Face experts module with 3-D weights, else None."""
    if _qualname(getattr(type(module), "forward", None)) == _LLAMA4_FORWARD:
        return _dense_spec(module)
    if not all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated")):
        return None
    gated = bool(module.has_gate)
    # a gate function of its own needs no act_fn (GptOssExperts: clamped SwiGLU on interleaved rows): it runs in
    # high precision between the FP8 GEMMs (compute.py), so alpha / limit / a subclass's gate stay the model's
    own_gate = gated and _qualname(getattr(type(module), "_apply_gate", None)) != _DEFAULT_GATE
    if not own_gate and not hasattr(module, "act_fn"):
        return None
    first = "gate_up_proj" if gated else "up_proj"
    w1, w2 = module._parameters.get(first), module._parameters.get("down_proj")
    if w1 is None or w2 is None or w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != w2.shape[0]:
        return None
    transposed, has_bias = bool(module.is_transposed), bool(getattr(module, "has_bias", False))
    act = _activation_name(getattr(module, "act_fn", None))
    reason = ""
    if gated and not own_gate and not module.is_concatenated:
        reason = "gate and up rows are interleaved (is_concatenated=False); the FP8 MoE kernel takes [gate; up]"
    elif not own_gate and (act is None or (gated and act not in _GATED_EPILOGUE)):
        reason = f"activation {type(module.act_fn).__name__} has no FP8 grouped-GEMM epilogue"
    elif getattr(module, "_is_expert_parallel", False):
        reason = "expert parallel (sentinel expert ids) is not supported"
    elif not all(w.dtype in (torch.float32, torch.bfloat16, torch.float16) for w in (w1, w2)):
        reason = f"expert weights have dtype {w1.dtype}"
    epilogue = None if reason or own_gate or act is None else _GATED_EPILOGUE[act] if gated else act
    return ExpertsSpec(int(w1.shape[0]), first, gated, transposed, has_bias, epilogue, reason, own_gate=own_gate,
                       interleaved=gated and not module.is_concatenated)


_DEFAULT_GATE = "transformers.integrations.moe._default_apply_gate"
# transformers/models/llama4/modeling_llama4.py: ``gate_up = bmm(x.view(E, -1, H), gate_up_proj)`` ([E, H, 2I]),
# ``gate, up = gate_up.chunk(2)``, ``bmm(up * act_fn(gate), down_proj)`` ([E, I, H]); recognised by this forward
# (a subclass that keeps it computes the same), whose layout is the transposed, [gate; up] one
_LLAMA4_FORWARD = "transformers.models.llama4.modeling_llama4.Llama4TextExperts.forward"


def _dense_spec(module: nn.Module) -> ExpertsSpec | None:
    w1, w2 = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    if w1 is None or w2 is None or w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != w2.shape[0]:
        return None
    act = _activation_name(getattr(module, "act_fn", None))
    reason = ""
    if act not in _GATED_EPILOGUE:
        reason = f"activation {type(getattr(module, 'act_fn', None)).__name__} has no FP8 grouped-GEMM epilogue"
    elif not all(w.dtype in (torch.float32, torch.bfloat16, torch.float16) for w in (w1, w2)):
        reason = f"expert weights have dtype {w1.dtype}"
    epilogue = None if reason or act is None else _GATED_EPILOGUE[act]
    return ExpertsSpec(int(w1.shape[0]), "gate_up_proj", True, True, False, epilogue, reason, dense=True)


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


def bind_call(args: tuple, kwargs: dict, spec: ExpertsSpec | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(hidden_states, top_k_index, top_k_weights) of an experts call, or None for another signature. Dense
    experts (``spec.dense``: one argument, the rows of every expert in turn) get the routing that says so: row
    ``r`` of ``E·T`` to expert ``r // T`` with weight 1."""
    if spec is not None and spec.dense:
        return _bind_dense(args, kwargs, spec.num_experts)
    names = ("hidden_states", "top_k_index", "top_k_weights")
    if len(args) > 3 or set(kwargs) - set(names[len(args):]):
        return None
    x, ids, w = vals = list(args) + [kwargs.get(n) for n in names[len(args):]]
    if not all(isinstance(t, torch.Tensor) for t in vals) or not x.is_floating_point() or ids.is_floating_point():
        return None
    # math.prod, not Size.numel(): keeps token counts symbolic while fx_rewriter exports (numel() specialises)
    if ids.dim() < 1 or ids.shape != w.shape or math.prod(ids.shape[:-1]) * x.shape[-1] != x.numel():
        return None
    return x, ids, w


def _bind_dense(args: tuple, kwargs: dict, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    vals = list(args) + list(kwargs.values())
    if len(vals) != 1 or set(kwargs) - {"hidden_states"}:
        return None
    x = vals[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        return None
    rows = math.prod(x.shape[:-1])
    if rows % num_experts:
        return None
    ids = torch.arange(num_experts, device=x.device).repeat_interleave(rows // num_experts)[:, None]
    return x, ids, torch.ones(rows, 1, dtype=x.dtype, device=x.device)


# ------------------------------------------------------------------------------------------- state

class MoeState(AutoQuantizationState):
    """An experts module's record: two ops (gate_up, down) with their activation observers.

    The gate_up input (the block's hidden states, the same tensor for every expert) has one observer and
    one scale: quantized once per token — dense experts (``spec.dense``, each expert's rows scaled by its
    router score) one per expert. The down input (``act(gate)·up``, computed by each expert's own
    weights) has one observer and one scale per expert. ``rows`` counts the calibration rows (token, slot
    pairs; dense: the non-zero rows) each expert received. benchmarks/moe_calibration.py measures these
    choices against the others.
    """

    rows: torch.Tensor

    def __init__(self, fqn: str, spec: ExpertsSpec, ops: list[SeenOp]) -> None:
        super().__init__(fqn)
        self.spec = spec
        self.seen_ops = ops
        self.register_buffer("rows", torch.zeros(spec.num_experts, dtype=torch.int64))
        if self.static:
            for op in ops:
                cfg = op.qconfig.activation
                per_expert = op.index == 1 or spec.dense
                keys = [expert_key(op.index, e) for e in range(spec.num_experts)] if per_expert else \
                    [observer_key(0, "input")]
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

    def observe_tokens(self, x: torch.Tensor) -> None:  # the gate_up input, all tokens (not dense)
        self.observers[observer_key(0, "input")](x)

    def observe_expert(self, expert: int, h: torch.Tensor, op_index: int = 1) -> None:
        """One expert's rows of the down input (dense experts: of the gate_up input too, ``op_index`` 0)."""
        self.observers[expert_key(op_index, expert)](h)

    def uncalibrated(self) -> list[str]:
        """Only when no expert saw calibration data: one expert's data is enough to fall back on."""
        if not self.static or bool((self.rows > 0).any()):
            return []
        return [f"{self.fqn}: {op.fqn} input (no expert received a calibration token)" for op in self.seen_ops]

    def freeze_scales(self) -> None:
        """The gate_up input scale, and one down-input scale per expert: experts without calibration rows
        take the largest of the others'."""
        if self.static:
            self.register_buffer(f"scale_{observer_key(0, 'input')}", self.expert_input_scales(0)[0]
                                 if self.spec.dense else
                                 observer_of(self, observer_key(0, "input")).scale().detach().clone())
            self.register_buffer(f"scale_{observer_key(1, 'input')}", self.down_scales()[0])
        self.converted = True

    def down_scales(self) -> tuple[torch.Tensor, list[int]]:
        """The down input's per-expert scales ([E]) from the observers now, as :meth:`freeze_scales` stores
        them, and the experts that took the fallback."""
        return self.expert_input_scales(1)

    def expert_input_scales(self, op_index: int) -> tuple[torch.Tensor, list[int]]:
        """Per-expert input scales of op ``op_index`` ([E]) and the experts that took the fallback."""
        obs = [observer_of(self, expert_key(op_index, e)) for e in range(self.spec.num_experts)]
        return expert_scales(obs, self.rows > 0)


def expert_key(op_index: int, expert: int) -> str:
    """The observer of one expert's input to op ``op_index`` (the down projection's, one per expert)."""
    return f"{op_index}_input_e{expert}"


def observer_of(st: AutoQuantizationState, key: str) -> AmaxObserver:
    """A record's activation observer (QConfig's observer configs make ``AmaxObserver``s)."""
    return cast(AmaxObserver, st.observers[key])


def has_data(obs: AmaxObserver) -> bool:
    """An observer that saw a non-zero finite value (an expert called with empty inputs has not)."""
    return bool(obs.calibrated) and bool(torch.isfinite(obs.amax).all() and (obs.amax > 0).any())


def expert_scales(observers: list[AmaxObserver], seen: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """Per-expert scales from per-expert observers ([E]); an expert without data (``seen`` False, or an
    observer that saw nothing) gets the largest scale among the experts with data: its inputs are
    unknown, the widest range measured on its siblings clips least. Returns (scales, fallback experts)."""
    ok = [has_data(o) and (seen is None or bool(seen[e])) for e, o in enumerate(observers)]
    if not any(ok):
        raise RuntimeError("dbr_quant: no expert of this group saw calibration data")
    measured = {e: _scalar_scale(o) for e, o in enumerate(observers) if ok[e]}
    fallback = widest_scale([o for e, o in enumerate(observers) if ok[e]])
    missing = [e for e in range(len(observers)) if not ok[e]]
    return torch.stack([measured.get(e, fallback) for e in range(len(observers))]).clone(), missing


def widest_scale(donors: list[AmaxObserver]) -> torch.Tensor:
    """The input scale of an expert that received no calibration data: the largest among ``donors``, its
    sibling experts' observers that did. Its inputs are unknown; the widest range measured clips least."""
    return torch.stack([_scalar_scale(o) for o in donors]).amax()


def _scalar_scale(obs: AmaxObserver) -> torch.Tensor:
    return obs.scale().detach().float().reshape(())


def fallback_note(missing: list[int], total: int) -> str:
    if not missing:
        return ""
    shown = ", ".join(map(str, missing[:8])) + (", …" if len(missing) > 8 else "")
    return (f"{len(missing)}/{total} experts got no calibration tokens ({shown}): their input scale is the "
            f"max over the calibrated experts'")


# ------------------------------------------------------------------------------------------- report
OWN_GATE_NOTE = "the module's own gate function (_apply_gate) runs in high precision between the FP8 GEMMs"


def report_rows(st: MoeState) -> list[dict[str, Any]]:
    """``dbr_quant.report`` rows of an experts module: one per 3-D expert tensor, FP8 or not and why (or
    which experts fell back to the max-over-experts down-input scale)."""
    rows = []
    for op in st.seen_ops:
        note = op.reason
        if op.quantize and op.qconfig.weight_only:
            note = "weight-only FP8 (activations stay high precision)"
        elif op.quantize and op.qconfig.activation.granularity == "mx":
            note = "MXFP8: dynamic E8M0 activation scales per token per 32 channels, 1×32 weight blocks"
        elif op.quantize and op.qconfig.dynamic:
            note = "dynamic activation scales"
            if op.qconfig.weight.granularity == "block":
                bn, bk = op.qconfig.weight.block
                groups = f"per token per {bk} channels" if op.qconfig.activation.granularity == "group" else \
                    f"per {op.qconfig.activation.granularity}"
                note = f"dynamic activation scales ({groups}), {bn}×{bk} weight blocks"
        elif op.quantize and (op.index == 1 or st.spec.dense) and st.converted:  # the per-expert input scales
            note = fallback_note(st.fallback, st.spec.num_experts)
        if op.quantize and op.index == 0 and st.spec.own_gate:
            note = "; ".join(filter(None, (note, OWN_GATE_NOTE)))
        rows.append({"fqn": op.fqn, "kind": EXPERTS, "module": st.fqn, "fp8": op.quantize, "fusion": op.fusion,
                     "reason": note, "weight": op.fqn})
    return rows
