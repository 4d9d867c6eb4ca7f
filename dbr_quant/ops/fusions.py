"""The built-in fusions (which recorded op sequences run as one subgraph, and how) and the matching of the
registered ones over a trace. The pattern language and the registry are in patterns.py.

A fusion is a pattern over the trace (a head op and the ops that consume its output, one after the
other) plus ``run``: an implementation that must equal running its ops one by one (``reference``).
Register one with ``@register_fusion``; matching tries longer patterns first. A subgraph only forms
where every intermediate tensor has exactly one consumer (the next op of the pattern), is not
returned to the caller, and crosses no module that has hooks — so fusing never changes what user
code or hooks can observe. See docs/extending.md for the recipe.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dbr_quant import kernels
from dbr_quant.ops.basic import (
    linear_input,
    linear_kernel,
    linear_operands,
    linear_parts,
    run_linear,
    stacked_gate_up,
    weight_block,
)
from dbr_quant.ops.call import Call, Env
from dbr_quant.ops.mappings import (
    ACT,
    ADD,
    DIV,
    LINEAR,
    MATMUL,
    MUL,
    NORM,
    SOFTMAX,
    activation_name,
    rms_norm_module_eps,
)
from dbr_quant.ops.patterns import FUSIONS, Event, Fusion, Step, TraceGraph, register_fusion, threads
from dbr_quant.ops.tags import is_placeholder
from dbr_quant.quantize.weights import FP8Weight


def find_subgraphs(graph: TraceGraph) -> list[tuple[Fusion, list[Event]]]:
    """Greedy left-to-right matching over the trace: each event joins at most one subgraph."""
    taken = graph.taken
    found = []
    for head in graph.events:
        if head.index in taken or head.op is None:
            continue
        for fusion in FUSIONS:
            matched = fusion.match(graph, head)
            if matched and not any(ev.index in taken for ev in matched) and _self_contained(graph, fusion, matched):
                taken.update(ev.index for ev in matched)
                found.append((fusion, matched))
                break
    return found


def _self_contained(graph: TraceGraph, fusion: Fusion, matched: list[Event]) -> bool:
    """Whatever a fusion's ``match`` found, the subgraph runs as one only if its dataflow is what its ``run``
    assumes. Each tensor made inside (but the last) exists only as a placeholder that the pattern's next op
    reads, once: read by any other op (even one of the subgraph, as ``y + y``'s other operand or a residual),
    returned, or seen by a hook, it would be that empty placeholder. And as every op of the subgraph runs
    when its last one arrives, no op in between may write in place into a tensor the subgraph read before."""
    members = {ev.index for ev in matched}
    for ev in matched[:-1]:
        if ev.output is None or ev.output in graph.escaped:
            return False
        users = graph.consumers.get(ev.output, ())
        reads = sum((*graph.events[u].arg_ids, *graph.events[u].kwarg_ids).count(ev.output) for u in users)
        if not members.issuperset(users) or reads != (fusion.head_readers if ev is matched[0] else 1):
            return False
    def storage(tid: int) -> int | None:
        return graph.storage[tid] if tid < len(graph.storage) else None

    read: set[int | None] = set()  # storages the subgraph has read so far, in trace order
    for ev in graph.events[min(members): max(members)]:
        if ev.index in members:
            read.update(storage(i) for i in (*ev.arg_ids, *ev.kwarg_ids) if i is not None)
        elif ev.written is not None and read:
            written = storage(ev.written)
            if written is None or written in read or None in read:  # None: not known, so it may alias any
                return False
    return True


# --------------------------------------------------------------------------- step conditions
def _first_arg(ev: Event, prev: Event | None) -> bool:
    return prev is not None and ev.arg_ids[:1] == (prev.output,)


def _residual(ev: Event, prev: Event | None) -> bool:
    """``a + b`` with both tensors of the same shape, no ``alpha`` (a residual connection)."""
    ids = [i for i in ev.arg_ids[:2] if i is not None]
    return len(ids) == 2 and not ev.kwarg_ids and ev.detail.get("same_shape", False) \
        and "alpha" not in ev.detail.get("kwargs", ())


def _scalar_operand(ev: Event, prev: Event | None) -> bool:
    """Multiplying or dividing the scores by a Python number (the softmax scale)."""
    return _first_arg(ev, prev) and ev.detail.get("scalar_other", False)


def _last_dim(ev: Event, prev: Event | None) -> bool:
    return ev.detail.get("softmax_last_dim", False)


def _calls(calls: Sequence[Call], kind: str) -> list[Call]:
    return [c for c in calls if c.kind == kind]


def _other_operand(call: Call) -> torch.Tensor:
    """The operand of a binary op that is not the subgraph's own intermediate (a placeholder)."""
    a, b = call.args[0], call.args[1]
    return b if is_placeholder(a) else a


def _activation(calls: Sequence[Call]) -> str | None:
    acts = _calls(calls, ACT)
    return activation_name(acts[0].func, acts[0].args, acts[0].kwargs) if acts else None


# --------------------------------------------------------------------------- the fusions
@register_fusion
class LinearActivation(Fusion):
    """linear (+bias) → relu / gelu / gelu-tanh / silu, one GEMM with the activation in its epilogue."""

    name = "linear_act"
    steps = (Step(LINEAR), Step(ACT, accepts=_first_arg))

    def run(self, calls, env):
        act = calls[-1]  # a passthrough op is never last (the matcher drops trailing ones)
        return run_linear(calls[0], env, activation=activation_name(act.func, act.args, act.kwargs))


@register_fusion
class LinearResidual(Fusion):
    """linear (+bias) → + residual, the residual added in the GEMM epilogue."""

    name = "linear_residual"
    steps = (Step(LINEAR), Step(ADD, accepts=_residual))

    def run(self, calls, env):
        out = run_linear(calls[0], env, residual=_other_operand(_calls(calls, ADD)[0]))
        return out


def _mlp(fc1: Call, fc2: Call, env: Env, x: torch.Tensor, act: str | None, residual: torch.Tensor | None,
         x_fp8: tuple[torch.Tensor, torch.Tensor | None] | None = None,
         fc1_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, int] | None] | None = None
         ) -> torch.Tensor:
    """fc1 → act → fc2 (+ residual), the one MLP executor: fc1's epilogue applies the activation and quantizes
    with fc2's input scale (static), so FP8 goes from one GEMM to the next: one ``kernels.fp8_mlp`` (quantize
    + 2 GEMMs; with a fused norm, norm + 2 GEMMs), or with a block-scaled fc1 or fc2 the same hand-off as two
    linear kernels. ``x_fp8``: fc1's input already quantized (a norm's kernel did it); ``fc1_parts``: fc1's
    (fp8 weight, scale, bias, block) when not its module's own (a stacked [gate; up], its act the gated one)."""
    w1_q, w1_scale, b1, block1 = linear_parts(fc1) if fc1_parts is None else fc1_parts
    x_q, x_scale = linear_input(fc1, x, env, block1) if x_fp8 is None else x_fp8
    assert fc2.op is not None, "executors run recorded ops"
    cfg2 = fc2.op.qconfig
    if cfg2.dynamic:  # fc2's scale would depend on fc1's output: no FP8 hand-off
        h = linear_kernel(x_q, x_scale, w1_q, w1_scale, block1, bias=b1, activation=act, out_dtype=x.dtype)
        return run_linear(fc2, env, x=h, residual=residual)
    assert x_scale is not None, "weight-only FP8 is dynamic (QConfig.weight_only sets it): no FP8 hand-off"
    h_scale = env.input_scale(fc2, "input", None)
    h_fmt = cfg2.activation.format
    w2_q, w2_scale, b2, block2 = linear_parts(fc2)
    if block1 is None and block2 is None:
        return kernels.fp8_mlp(x_q, x_scale, w1_q, w1_scale, b1, act, h_scale, h_fmt, w2_q, w2_scale, b2, residual,
                               x.dtype)
    h = linear_kernel(x_q, x_scale, w1_q, w1_scale, block1, bias=b1, activation=act, out_dtype=x.dtype,
                      out_scale=h_scale, out_fmt=h_fmt)
    return linear_kernel(h, h_scale, w2_q, w2_scale, block2, bias=b2, residual=residual, out_dtype=x.dtype)


def _module_mlp(fc1: Call, fc2: Call, env: Env, act: str | None, residual: torch.Tensor | None) -> torch.Tensor:
    """The MLP fusion's executor: for two converted linear modules with per-tensor / per-channel FP8 weights
    and static input scales (the common case: its operands read in one go, one ``kernels.fp8_mlp``), else
    :func:`_mlp`, the general executor it falls back to."""
    m1, m2 = fc1.module, fc2.module
    assert fc1.op is not None and fc2.op is not None, "executors run recorded ops"
    if m1 is not None and m2 is not None:
        p1, p2 = m1._parameters, m2._parameters
        w1, w2 = p1.get("weight"), p2.get("weight")
        c1, c2 = fc1.op.qconfig, fc2.op.qconfig
        if type(w1) is FP8Weight and type(w2) is FP8Weight and w1.block is None and w2.block is None \
                and not c1.dynamic and not c2.dynamic and "bias" in p1 and "bias" in p2:
            x = fc1.args[0]
            x_scale = env.input_scale(fc1, "input", x)
            x_q = kernels.quantize(x, x_scale, c1.activation.format)
            return kernels.fp8_mlp(x_q, x_scale, w1.qdata, w1.scale, p1["bias"], act,
                                   env.input_scale(fc2, "input", None), c2.activation.format, w2.qdata, w2.scale,
                                   p2["bias"], residual, x.dtype)
    return _mlp(fc1, fc2, env, fc1.args[0], act, residual)


@register_fusion
class MLP(Fusion):
    """fc1 → activation → fc2 (→ + residual): fc1's epilogue hands fc2 its input in FP8."""

    name = "mlp"
    steps = (Step(LINEAR), Step(ACT, accepts=_first_arg), Step(LINEAR, accepts=_first_arg),
             Step(ADD, optional=True, accepts=_residual))

    def run(self, calls, env):
        if len(calls) <= 4 and calls[1].kind == ACT and calls[2].kind == LINEAR:  # no passthrough ops between
            fc1, act, fc2 = calls[0], calls[1], calls[2]
            residual = _other_operand(calls[3]) if len(calls) == 4 else None
            return _module_mlp(fc1, fc2, env, activation_name(act.func, act.args, act.kwargs), residual)
        fc1, fc2 = _calls(calls, LINEAR)
        adds = _calls(calls, ADD)
        residual = _other_operand(adds[0]) if adds else None
        return _mlp(fc1, fc2, env, fc1.args[0], _activation(calls), residual)


def _norm_arguments(norm: Call) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, float, bool] | None:
    """(x, weight, bias, eps, rms) of an F.layer_norm / F.rms_norm call over the last dimension only, or of
    a recognised RMSNorm module."""
    if norm.module is not None:
        eps = rms_norm_module_eps(norm.module)
        assert eps is not None, "the trace recognises a norm module by its eps (tracer._norm_module_call)"
        return norm.args[0], norm.module._parameters["weight"], None, eps, True
    rms = norm.func is F.rms_norm
    names = ("input", "normalized_shape", "weight", "eps") if rms else (
        "input", "normalized_shape", "weight", "bias", "eps")
    a = dict(zip(names, norm.args))
    a.update(norm.kwargs)
    x, shape = a["input"], a["normalized_shape"]
    if len(tuple(shape)) != 1:
        return None
    eps = a.get("eps", None if rms else 1e-5)
    if eps is None:  # F.rms_norm's default: the machine epsilon of the input's dtype
        eps = torch.finfo(x.dtype).eps
    return x, a.get("weight"), a.get("bias"), eps, rms


def _norm_quantize(norm: Call, fc: Call, env: Env) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The norm and the quantization of ``fc``'s input in one kernel where its scheme allows: a static scale
    (``layer_norm_quantize``) or dynamic per-token groups of a block linear (``layer_norm_group_quantize``).
    Returns (normalized, (fp8, scale)); (the norm as written, None) otherwise."""
    parts = _norm_arguments(norm)
    if parts is None or not parts[0].is_floating_point():  # an integer input: the norm as written says what it does
        return norm.run_original(), None  # (torch's layer_norm raises; the fused kernel cast its result back to int)
    x, weight, bias, eps, rms = parts
    assert fc.op is not None, "executors run recorded ops"
    cfg = fc.op.qconfig
    if not cfg.dynamic:
        scale = env.input_scale(fc, "input", None)
        y, q = kernels.layer_norm_quantize(x, weight, bias, eps, scale, cfg.activation.format, rms=rms)
        return y, (q, scale)
    block = weight_block(fc)
    if block is not None and cfg.activation.granularity == "group":
        y, q, scale = kernels.layer_norm_group_quantize(x, weight, bias, eps, block[1], cfg.activation.format,
                                                        rms=rms)
        return y, (q, scale)
    return norm.run_original(), None


@register_fusion
class NormLinear(Fusion):
    """LayerNorm / RMSNorm → linear (optionally → activation → linear: the whole MLP block).

    One kernel normalizes and quantizes with the linear's input scale (static, or dynamic per-token groups for
    block-scaled weights): the MLP block is 3 launches."""

    name = "norm_linear"
    steps = (Step(NORM), Step(LINEAR, accepts=_first_arg), Step(ACT, optional=True, accepts=_first_arg),
             Step(LINEAR, optional=True, accepts=_first_arg), Step(ADD, optional=True, accepts=_residual))

    def run(self, calls, env):
        norm, linears = calls[0], _calls(calls, LINEAR)
        act = _activation(calls)
        adds = _calls(calls, ADD)
        residual = _other_operand(adds[0]) if adds else None
        fc1 = linears[0]
        y, x_fp8 = _norm_quantize(norm, fc1, env)
        if len(linears) == 1:
            return run_linear(fc1, env, x=y, activation=act, residual=residual, x_fp8=x_fp8)
        return _mlp(fc1, linears[1], env, y, act, residual, x_fp8)


# the gated kernel of each activation (Gemma: gelu_tanh)
_GATED_KERNELS: dict[str | None, str] = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}


def _gated_mlp(gate: Call, up: Call, down: Call | None, env: Env, x: torch.Tensor, act: str | None,
               residual: torch.Tensor | None, x_fp8: tuple[torch.Tensor, torch.Tensor | None] | None = None
               ) -> torch.Tensor:
    """down(act(gate(x)) · up(x)): with stacked [gate; up] weights one GEMM computes both halves and
    act(gate)·up in its epilogue, writing FP8 for down (quantize + 2 GEMMs; with a fused norm, 3 launches)."""
    stacked = stacked_gate_up(gate, up)  # convert stacks a pair only when both quantize x identically
    kernel_act = _GATED_KERNELS.get(act)
    if stacked is None or kernel_act is None:
        h = run_linear(gate, env, x=x, activation=act, x_fp8=x_fp8) * run_linear(up, env, x=x, x_fp8=x_fp8)
        return h if down is None else run_linear(down, env, x=h, residual=residual)
    w_q, w_scale = stacked
    block = weight_block(gate)
    x_q, x_scale = linear_input(gate, x, env, block) if x_fp8 is None else x_fp8
    biases = [linear_operands(c)[2] for c in (gate, up)]
    bias = None if biases == [None, None] else torch.cat(
        [b if b is not None else torch.zeros(n, device=x.device) for b, n in zip(biases, (w_q.shape[0] // 2,) * 2)])
    if down is None or down.op is None:
        h = linear_kernel(x_q, x_scale, w_q, w_scale, block, bias=bias, activation=kernel_act, out_dtype=x.dtype)
        return h if down is None else run_linear(down, env, x=h, residual=residual)
    return _mlp(gate, down, env, x, kernel_act, residual, (x_q, x_scale), (w_q, w_scale, bias, block))


def _residual_after(graph: TraceGraph, last: Event) -> Event | None:
    add = graph.sole_consumer(last.output)
    return add if add is not None and add.kind == ADD and threads(add, last.output) and _residual(add, last) else None


@register_fusion
class GatedMLP(Fusion):
    """SwiGLU / GEGLU / ReGLU: down(act(gate(x)) * up(x)) (+ residual); gate and up read the same input."""

    name = "gated_mlp"
    steps = (Step(LINEAR), Step(ACT), Step(LINEAR), Step(MUL), Step(LINEAR, optional=True),
             Step(ADD, optional=True))

    def match(self, graph, head):
        if not head.quantized(LINEAR):
            return None
        act = graph.sole_consumer(head.output)
        if act is None or act.kind != ACT:
            return None
        mul = graph.sole_consumer(act.output)
        if mul is None or mul.kind != MUL or not threads(mul, act.output):
            return None
        other = [i for i in mul.arg_ids[:2] if i != act.output]
        ups = [ev for ev in graph.events[act.index + 1: mul.index] if ev.quantized(LINEAR) and
               ev.index not in graph.taken and ev.output in other and ev.arg_ids[:1] == head.arg_ids[:1]]
        if len(ups) != 1 or graph.sole_consumer(ups[0].output) is not mul:
            return None
        matched = [head, act, ups[0], mul]
        down = graph.sole_consumer(mul.output)
        if down is not None and down.quantized(LINEAR) and down.arg_ids[:1] == (mul.output,):
            matched.append(down)
            add = _residual_after(graph, down)
            if add is not None:
                matched.append(add)
        return matched

    def run(self, calls, env):
        linears = _calls(calls, LINEAR)
        adds = _calls(calls, ADD)
        return _gated_mlp(linears[0], linears[1], linears[2] if len(linears) == 3 else None, env,
                          linears[0].args[0], _activation(calls), _other_operand(adds[0]) if adds else None)


@register_fusion
class NormGatedMLP(Fusion):
    """RMSNorm / LayerNorm → gate and up → act·up → down (+ residual): Llama's MLP block in 3 launches
    (norm + quantize, the stacked gate|up GEMM writing FP8, down with the residual)."""

    name = "norm_gated_mlp"
    steps = (Step(NORM), Step(LINEAR), Step(ACT), Step(LINEAR), Step(MUL), Step(LINEAR, optional=True),
             Step(ADD, optional=True))
    head_readers = 2  # gate and up

    def match(self, graph, head):
        users = graph.consumers.get(head.output, [])
        if head.kind != NORM or head.output in graph.escaped or len(users) != 2:
            return None
        inner = GatedMLP.match(self, graph, graph.events[users[0]])
        if inner is None or inner[2].index != users[1]:
            return None
        return [head, *inner]

    def run(self, calls, env):
        norm, linears = calls[0], _calls(calls, LINEAR)
        gate, up = linears[:2]
        down = linears[2] if len(linears) == 3 else None
        adds = _calls(calls, ADD)
        residual = _other_operand(adds[0]) if adds else None
        act = _activation(calls)
        if stacked_gate_up(gate, up) is None:
            return _gated_mlp(gate, up, down, env, norm.run_original(), act, residual)
        y, x_fp8 = _norm_quantize(norm, gate, env)
        return _gated_mlp(gate, up, down, env, y, act, residual, x_fp8=x_fp8)


@register_fusion
class Attention(Fusion):
    """q·kᵀ → (× or ÷ scale) → (+ mask) → softmax → ·v, with FP8 GEMMs and an fp32 softmax."""

    name = "attention"
    steps = (Step(MATMUL), Step(MUL, optional=True, accepts=_scalar_operand),
             Step(DIV, optional=True, accepts=_scalar_operand), Step(ADD, optional=True),
             Step(SOFTMAX, accepts=_last_dim), Step(MATMUL, accepts=_first_arg))
