"""An experts module's call in prepare()'s trace: its record (:class:`MoeState`), and its router kept in
high precision.

The trace run (``runtime.tracer.TraceRun``) runs the module as written, nothing inside recorded, logs the
call as one opaque op of its dataflow, then hands it here (:func:`trace_experts`): the module gets a
``MoeState`` with two ops of kind ``experts`` (``<fqn>.gate_up_proj`` / ``up_proj`` and ``<fqn>.down_proj``,
FP8 or not and why), and the linear that computed the router logits reaching its top-k ids stays high
precision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from dbr_quant.moe.experts import EXPERTS, ExpertsSpec, MoeState, bind_call
from dbr_quant.ops.patterns import Event
from dbr_quant.ops.state import AutoQuantizationState, SeenOp, TensorInfo, observer_key
from dbr_quant.ops.tags import TAG, ModuleTag
from dbr_quant.qconfig import OpQConfig, QConfig

Bound = tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # an experts call's (x, ids, weights): bind_call


class TracedModel(Protocol):
    """The model's record while it is traced (``runtime.runs.ModelRecord``): the settings ops resolve."""

    @property
    def qconfig(self) -> QConfig: ...


class TracedRun(Protocol):
    """What an experts call's trace reads and writes (``runtime.tracer.TraceRun`` has it): the records so far,
    the module stack, and the dataflow logged — tensor id → trace id, trace id → producing event, events."""

    states: dict[nn.Module, AutoQuantizationState]

    @property
    def stack(self) -> Sequence[nn.Module]: ...

    @property
    def record(self) -> TracedModel: ...

    @property
    def tids(self) -> Mapping[int, int]: ...

    @property
    def producers(self) -> Mapping[int, int]: ...

    @property
    def events(self) -> Sequence[Event]: ...


def trace_experts(run: TracedRun, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """After the trace ran the experts ``module`` as written and logged the call: its record (the first call's;
    a module called again keeps it), and its router in high precision."""
    tag: ModuleTag = module.__dict__[TAG]
    bound = bind_call(args, kwargs, tag.experts)
    if module not in run.states:
        run.states[module] = _new_state(run, module, bound)
    if bound is not None and tag.experts is not None and tag.experts.dense:
        keep_router_high_precision(run, bound[:1], through_topk=True)  # the router scales the rows themselves
    elif bound is not None:
        keep_router_high_precision(run, bound[1:])


# Measured on the test suite's small Mixtral (3 seeds, logits vs fp32): router in FP8 0.078 relative error,
# min cosine 0.9953; router in high precision 0.068, 0.9972. It is 0.1 % of the weights, and as a functional
# F.linear its weight would be quantized on every call (two extra launches per layer).
ROUTER_REASON = ("MoE router: its logits pick the experts, so it stays high precision (as vLLM and llm-compressor "
                 "keep it)")


# ops whose output takes only the dtype / shape / device of these positional operands, never their values: the
# router walk does not follow them (Granite's ``softmax(...).type_as(hidden_states)`` would lead it past the
# router into the attention's output projection)
_METADATA_OPERANDS: dict[object, frozenset[int]] = {
    **{f: frozenset({1}) for f in (torch.Tensor.type_as, torch.Tensor.expand_as, torch.Tensor.view_as,
                                   torch.Tensor.reshape_as, torch.Tensor.to)},
    **{f: frozenset({0}) for f in (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
                                   torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty,
                                   torch.Tensor.new_full)},
}


_TOPK = (torch.topk, torch.Tensor.topk)


def keep_router_high_precision(run: TracedRun, routing: tuple[torch.Tensor, ...], max_events: int = 64,
                               through_topk: bool = False) -> None:
    """Walk the trace's dataflow back from the top-k ids and weights an experts module receives (topk ←
    softmax ← …) to the linear ops that computed the router logits, and keep those in high precision.

    Breadth first, through the operands that carry values, stopping at the nearest level that holds a linear:
    a group-limited router (DeepSeek-V3: masks, scatters, a gather of the scores) has long side paths, and
    past the router the walk would reach the block's input and the linears before it. ``through_topk``: the
    walk starts at the experts' input rows (Llama 4: the hidden states times the router's scores), and a linear
    is the router only when reached through a top-k (a path without one leads to the block's input)."""
    level = [(run.tids[id(t)], not through_topk) for t in routing if id(t) in run.tids]
    seen: set[int] = set()
    while level and len(seen) < max_events:
        routers: list[SeenOp] = []
        upstream: list[tuple[int, bool]] = []
        for tid, past_topk in level:
            ev_index = run.producers.get(tid)
            if ev_index is None or ev_index in seen:
                continue
            seen.add(ev_index)
            ev = run.events[ev_index]
            if isinstance(ev.op, SeenOp) and ev.op.kind == "linear":  # a trace's events hold SeenOps
                if past_topk:
                    routers.append(ev.op)
                continue
            past_topk = past_topk or ev.func in _TOPK
            skip = _METADATA_OPERANDS.get(ev.func, frozenset())
            upstream += [(i, past_topk) for pos, i in enumerate(ev.arg_ids) if i is not None and pos not in skip]
            upstream += [] if skip else [(i, past_topk) for i in ev.kwarg_ids]
        for op in routers:
            _keep_high_precision(run, op)
        if routers:  # the router's input is the block's input: stop there
            return
        level = upstream


def _keep_high_precision(run: TracedRun, op: SeenOp) -> None:
    if not op.quantize:
        return
    for st in run.states.values():
        if any(o is op for o in st.seen_ops):
            for key in (observer_key(op.index, slot) for slot in op.slots):
                if key in st.observers:
                    del st.observers[key]
    op.quantize, op.reason, op.slots = False, ROUTER_REASON, ()


def _new_state(run: TracedRun, module: nn.Module, bound: Bound) -> MoeState:
    tag: ModuleTag = module.__dict__[TAG]
    spec = tag.experts
    assert spec is not None, "trace_experts is called for recognised experts modules only"
    fqn = tag.fqn or ""
    types = tuple(type(m) for m in run.stack) + (type(module),)
    qconfig = run.record.qconfig
    reason = spec.reason
    if not reason and bound is None:
        reason = "called with other arguments than (hidden_states, top_k_index, top_k_weights)"
    elif not reason and bound is not None and bound[0].dtype == torch.float64:
        reason = "hidden_states have dtype torch.float64"
    qcs = [qconfig.for_op(f"{fqn}.{name}", types) for name in spec.names]
    if not reason and any(qc.skip for qc in qcs):
        reason = "skipped by a QConfig override (both expert projections run as one block)"
    if not reason and (qcs[0].dynamic != qcs[1].dynamic or qcs[0].activation.format != qcs[1].activation.format):
        reason = "the two expert projections resolve to different activation settings; the MoE block takes one"
    if not reason:
        reason = _block_reason(module, spec, qcs)
    ops = []
    for i, (name, qc, w) in enumerate(zip(spec.names, qcs, spec.weights(module))):
        io = _routed_rows(bound, w, spec.transposed)
        ops.append(SeenOp(index=i, kind=EXPERTS, fqn=f"{fqn}.{name}", target=type(module).__name__, inputs=io[:1],
                          outputs=io[1:], qconfig=qc, quantize=not reason, reason=reason,
                          slots=("input",) if not reason else (), weight_owner=fqn,
                          fusion=f"moe_block[{w.shape[0]} experts]" if not reason else None))
    return MoeState(fqn, dataclasses.replace(spec, reason=reason), ops)


def _block_reason(module: nn.Module, spec: ExpertsSpec, qcs: list[OpQConfig]) -> str:
    """Why block-scaled weights cannot run this experts module ("" when they can, or are not asked for)."""
    first, second = (qc.weight.block if qc.weight.granularity == "block" else None for qc in qcs)
    if first is None and second is None:
        return ""
    if first is None or first != second:
        return (f"the two expert projections resolve to different weight granularities ({first or 'not block'} "
                f"vs {second or 'not block'}); the MoE block takes one: give both the same block")
    if spec.interleaved:
        return (f"block-scaled experts need gate and up as the two halves of gate_up; {type(module).__name__} "
                "interleaves them (gate even rows, up odd rows): use per-channel weight scales for these experts")
    w1, _ = spec.weights(module)
    inter = (w1.shape[2] if spec.transposed else w1.shape[1]) // (2 if spec.gated else 1)
    if spec.gated and inter % first[0]:
        return (f"block-scaled experts need the intermediate size ({inter}) to be a multiple of the block's rows "
                f"({first[0]}): gate and up are blocked on their own in [gate; up]; pick a block that divides it")
    return ""


def _routed_rows(bound: Bound, w: torch.Tensor, transposed: bool) -> tuple[TensorInfo, ...]:
    """(input [rows, K], output [rows, N]) of one expert tensor at the trace: one row per (token, top-k slot)
    routed, all experts together (what ``dq.inspect`` counts FLOPs on). The rows exist only inside the call,
    so they have no trace id (-1)."""
    if bound is None:
        return ()
    x, ids, _ = bound
    rows = int(math.prod(ids.shape))
    n, k = (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])
    return TensorInfo(-1, x.dtype, (rows, int(k))), TensorInfo(-1, x.dtype, (rows, int(n)))
