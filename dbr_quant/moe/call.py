"""A marked experts module's call after the trace: what it computes in each phase (experts.py).

The run that intercepts the call (``dbr_quant.runtime``) asks :func:`experts_forward` for the call's body
and runs it — with the module's hooks around it (:func:`call_with_hooks`) — or, when there is none, the
module as written. Calibration computes the experts in high precision expert by expert and feeds the
observers; a converted model runs the FP8 block (compute.py), or its graph op while ``fx_rewriter``
captures; inside a ``dbr_quant.inspect`` session the inspector computes each expert tensor as a layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dbr_quant import kernels
from dbr_quant.kernels.autocast import run_autocast
from dbr_quant.moe.compute import flat_inputs, fp8_experts_compute
from dbr_quant.moe.experts import MoeState, bind_call
from dbr_quant.ops.straight_through import run_straight_through, substitute, wants_gradient
from dbr_quant.quantize.weights import FP8Weight

Body = Callable[[tuple, dict], Any]  # an experts call's output from its (args, kwargs)


class ExpertsInspector(Protocol):
    """A ``dbr_quant.inspect`` session (``inspect.inspector.Inspector``): it computes an experts call with
    each expert tensor as a layer."""

    def experts(self, module: nn.Module, st: Any, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor: ...


def experts_forward(module: nn.Module, args: tuple, kwargs: dict, phase: str,
                    inspector: ExpertsInspector | None = None) -> Body | None:
    """The body of a marked experts module's call in ``phase`` — "calibrate", "convert" (FP8 when converted)
    or "hp" (a prepared model inside an inspect session) — or None: the module runs as written (not
    quantized, called with other arguments, nothing to do in this phase)."""
    st = module._modules.get("_auto_quant_state")
    if not isinstance(st, MoeState) or bind_call(args, kwargs, st.spec) is None or not st.quantized:
        return None
    if inspector is not None and (st.converted or phase == "hp"):  # expert tensors are layers
        return lambda a, k: inspector.experts(module, st, *_rebind(st, a, k))
    if phase == "calibrate" and st.static:
        return lambda a, k: _calibrate_experts(module, st, *_rebind(st, a, k))
    if phase == "convert" and st.converted:
        return lambda a, k: _converted_experts(module, st, a, k)
    return None


def call_with_hooks(module: nn.Module, body: Body, args: tuple, kwargs: dict) -> Any:
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


def _rebind(st: MoeState, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The call's (hidden_states, top_k_index, top_k_weights), after its pre-hooks."""
    bound = bind_call(args, kwargs, st.spec)
    if bound is None:
        expected = "(hidden_states,)" if st.spec.dense else "(hidden_states, top_k_index, top_k_weights)"
        raise TypeError(f"dbr_quant: a forward pre-hook of the MoE experts module '{st.fqn}' changed its arguments "
                        f"away from {expected}; return those from the hook")
    return bound


def _converted_experts(module: nn.Module, st: MoeState, args: tuple, kwargs: dict) -> Any:
    """The FP8 experts; with straight-through gradients (straight_through.py: the module as written, its FP8
    weights dequantized, is the reference) when grad mode is on and an input or bias requires grad."""
    fp8 = lambda: _fp8_experts(module, st, *_rebind(st, args, kwargs))  # noqa: E731
    tensors = wants_gradient((), (*args, *kwargs.values(), *(p for p in module._parameters.values()
                                                              if p is not None and p.requires_grad)))
    if tensors is None:
        return fp8()
    # the class's forward, not the module call: in backward no run is active, and calling the module would
    # enter the converted model again (its FP8 path)
    reference = lambda sub: type(module).forward(module, *(substitute(a, sub) for a in args),  # noqa: E731
                                                 **{k: substitute(v, sub) for k, v in kwargs.items()})
    return run_straight_through(fp8, reference, tensors, lambda: f"experts {st.fqn}")


def _expert_weight(p: torch.Tensor, e: int, transposed: bool) -> torch.Tensor:
    return p[e].t() if transposed else p[e]


def _calibrate_experts(module: nn.Module, st: MoeState, x: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
    """The experts in high precision, expert by expert (what every experts implementation computes), each
    expert's gate_up and down inputs fed to its observers."""
    spec = st.spec
    x2, ids2, w2 = flat_inputs(x, ids, weights)
    routing = kernels.moe_route(ids2, spec.num_experts)
    p1, p2 = spec.weights(module)
    b1, b2 = spec.biases(module)
    tokens, offsets = routing.tokens, routing.expert_offsets.tolist()
    row_w = routing.row_weights(w2)
    out = torch.zeros(x2.shape[0], p2.shape[1] if not spec.transposed else p2.shape[2], dtype=torch.float32,
                      device=x.device)
    # dense: a row the router gave this expert no weight is all zeros, its output too (no bias): not a
    # calibration row, not observed (an expert given none takes the fallback scale, as one not routed to)
    live = (x2 != 0).any(-1) if spec.dense else None
    if live is not None:
        st.rows += live.reshape(spec.num_experts, -1).sum(1).to(st.rows.device)
    else:
        st.rows += routing.counts.to(st.rows.device)
        st.observe_tokens(x2)
    for e in range(spec.num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        tok = tokens[lo:hi]
        if live is not None:
            tok = tok[live[tok]]
            if not len(tok):
                continue
        xe = x2[tok]
        if live is not None:
            st.observe_expert(e, xe, op_index=0)
        y = F.linear(xe, _expert_weight(p1, e, spec.transposed), None if b1 is None else b1[e])
        h = spec.activate(module, y)
        y = F.linear(h, _expert_weight(p2, e, spec.transposed), None if b2 is None else b2[e])
        st.observe_expert(e, h)
        out.index_add_(0, tok, y.float() if live is not None else y.float() * row_w[lo:hi, None])  # dense: weight 1
    return out.to(x.dtype).reshape(x.shape)


def _autocast_off(compute: Callable[..., torch.Tensor], device: str) -> Callable[..., torch.Tensor]:
    """``compute`` by ``kernels.autocast.run_autocast``: the experts' exact FP8 result in the hidden states' dtype,
    which an experts module keeps under autocast (it accumulates in it)."""
    return lambda *args, **kwargs: run_autocast("fp8_moe_experts", lambda: compute(*args, **kwargs), device)


def _fp8_experts(module: nn.Module, st: MoeState, x: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """The converted experts: :func:`fp8_experts_compute`, or while ``fx_rewriter`` captures a graph one
    ``dbr_quant::fp8_moe_experts`` node (the routing, whose row counts depend on the data, stays inside)."""
    spec = st.spec
    x2, ids2, w2 = flat_inputs(x, ids, weights)
    p1, p2 = spec.weights(module)
    if type(p1) is not FP8Weight or type(p2) is not FP8Weight:
        raise RuntimeError(f"dbr_quant: experts module '{st.fqn}' is converted but its weights are not FP8; "
                           "convert the prepared model with dbr_quant.convert()")
    b1, b2 = spec.biases(module)
    gate_up, _ = st.seen_ops
    xs = hs = None
    if st.static:
        xs, hs = (st.frozen_scale(op, "input") for op in st.seen_ops)
        if xs.device != x.device:
            xs, hs = xs.to(x.device), hs.to(x.device)
    # experts_spec gives every spec it does not reject an epilogue, or the module's own gate function
    assert spec.activation is not None or spec.own_gate
    cfg = gate_up.qconfig.activation
    gate = None
    if spec.own_gate:  # the module's own function: its alpha / limit, a subclass's gate, stay the model's
        gate = lambda y: spec.activate(module, y)  # noqa: E731
    # a graph: one node, or with the module's own gate two nodes and the gate traced between them (moe_ops.py)
    graph_op = "fp8_moe_experts" if gate is None else "fp8_moe_gated"
    ops = kernels.graph_ops()
    compute: Callable[..., torch.Tensor] | None = fp8_experts_compute if ops is None else getattr(ops, graph_op, None)
    if compute is None:
        raise NotImplementedError(f"dbr_quant: the graph op table {type(ops).__name__} has no {graph_op} "
                                  f"op for the MoE experts module '{st.fqn}'; run the converted model eagerly")
    how: dict[str, Any] = {"activation": spec.activation} if gate is None else {"gate": gate}
    # p1.block: block-scaled weights, both (checked when the state was made); MX: E8M0 codes, run by their own path
    mx = cfg.granularity == "mx"
    if ops is None:  # eager: with autocast off, as the graph ops' autocast kernels run them (kernels/autocast.py)
        compute = _autocast_off(compute, x.device.type)
    return compute(x2, ids2, w2, p1.qdata, p1.scale, p2.qdata, p2.scale, xs, hs, b1, b2, **how,
                   fmt=cfg.format, per_token=cfg.granularity == "token", out_dtype=x.dtype,
                   block=None if mx else p1.block, group=p1.block is not None and cfg.granularity == "group",
                   weight_only=gate_up.qconfig.weight_only, mx=mx,
                   mx_round_up=mx and cfg.mx_scale_rounding == "ceil").reshape(x.shape)
