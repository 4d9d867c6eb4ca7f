"""MoE experts modules in ``dbr_quant.inspect``: each 3-D expert tensor is a layer.

An experts module (``moe/experts.py``) records two ops of kind ``experts``, ``<fqn>.gate_up_proj`` and
``<fqn>.down_proj``; here each is one inspect layer (named by that fqn, ``kind: experts`` in YAML),
with the tensors ``input`` (the rows routed to the experts, sorted by expert: [rows, K]), ``weight``
([E, N, K], all experts) and ``output`` ([rows, N], before the routing-weighted sum). Inside a session
an experts call is computed expert by expert (the routing from the call's arguments) with each projection
in FP8 (what convert stores: static input scales — one for gate_up, one per expert for down — or
dynamic; the FP8 weights, or on a prepared model the weights quantized as convert would) or in high
precision, as that layer's features decide. So ``sensitivity`` measures "only this expert tensor in
FP8", and the statistics features log per expert tensor. ``Scaling`` (another format / granularity)
is not supported for expert tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dbr_quant import kernels
from dbr_quant.inspect.features import Feature, Quantized, TensorContext, feature_pass, not_quantized
from dbr_quant.inspect.layers import model_record, named_ops
from dbr_quant.kernels.reference.mx import MX_BLOCK
from dbr_quant.kernels.routing import MoeRouting
from dbr_quant.moe.compute import flat_inputs
from dbr_quant.moe.experts import MoeState, observer_of
from dbr_quant.moe.siblings import SiblingScales
from dbr_quant.moe.weights import expert_parameter
from dbr_quant.ops.state import SeenOp, observer_key
from dbr_quant.quantize.weight_quantization import quantize_weight
from dbr_quant.quantize.weights import FP8Weight

if TYPE_CHECKING:  # the inspector calls run_experts with itself
    from dbr_quant.inspect.inspector import Inspector


def experts_flops(op: SeenOp) -> int:
    """FLOPs of one expert tensor (an op of kind ``experts``) per call at prepare()'s traced shapes:
    2 × routed rows × N × K, a routed row being one (token, top-k slot) pair — top_k × tokens rows over all
    experts, whichever experts they go to; the same count as an ``nn.Linear`` on those rows. 0 when the trace
    recorded no routing (the module was called with other arguments, moe/trace.py)."""
    rows = op.inputs[0] if op.inputs else None
    if rows is None or not op.outputs:
        return 0
    n_rows, k = rows.shape
    return 2 * n_rows * k * op.outputs[0].shape[-1]


def sibling_expert_flops(model: nn.Module, flops: dict[str, int]) -> dict[str, int]:
    """``flops`` (layer name → FLOPs at the traced shapes) with the layers of ``ModuleList`` / ``ModuleDict``
    experts (moe/siblings.py) evened out: the trace ran only the experts the example reached, and an unreached
    expert's record is a copy of a reached one's, shapes included. Each layer of a sibling group gets the
    group's traced FLOPs (over the reached experts: the rows really routed, top_k per token) divided by the
    number of experts — its share under uniform routing; the group's total stays what the trace computed."""
    names = {id(op): n for n, op in named_ops(model)}
    groups: dict[tuple, list[tuple[str, bool]]] = {}
    for st in model_record(model).states:
        rule = st.scale_fallback
        if isinstance(rule, SiblingScales):
            for op in st.seen_ops:
                if id(op) in names:
                    groups.setdefault((id(rule.group), rule.rel, op.index), []).append((names[id(op)], rule.traced))
    out = dict(flops)
    for members in groups.values():
        total = sum(flops.get(n, 0) for n, traced in members if traced)
        for n, _ in members:
            out[n] = round(total / len(members))
    return out


def run_experts(inspector: Inspector, module: nn.Module, st: MoeState, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """One experts call inside an inspect session (see the module docstring)."""
    spec = st.spec
    x2, ids2, w2 = flat_inputs(x, ids, weights)
    routing = kernels.moe_route(ids2, spec.num_experts)
    tokens, row_w = routing.tokens, routing.row_weights(w2)
    offsets = routing.expert_offsets.tolist()
    gate_up, down = st.seen_ops
    y = _projection(inspector, module, st, gate_up, x2[tokens], routing, offsets)
    h = spec.activate(module, y)
    y = _projection(inspector, module, st, down, h, routing, offsets)
    out = torch.zeros(x2.shape[0], y.shape[-1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y.float() * row_w[:, None])
    return out.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def _projection(inspector: Inspector, module: nn.Module, st: MoeState, op: SeenOp, rows: torch.Tensor,
                routing: MoeRouting, offsets: list[int]) -> torch.Tensor:
    name = inspector.names.get(id(op))
    layer = inspector.layers.get(name) if name is not None else None
    features: tuple[Feature, ...] = (inspector.plan.get(layer.name) or ()) if layer is not None else ()
    fp8 = op.quantize and (layer is None or all(f.use_fp8(layer) is not False for f in features))
    index = st.seen_ops.index(op)
    pname = st.spec.names[index]
    param = expert_parameter(module, pname)
    bias = module._parameters.get(f"{pname}_bias") if st.spec.has_bias else None
    w_hp = _hp_weight(param, st.spec.transposed)  # [E, N, K]
    for f in features:
        for tensor in ("input", "weight"):
            base = op.qconfig.weight if tensor == "weight" else op.qconfig.activation
            if layer is not None and f.tensor_config(layer, tensor, base) != base:
                raise NotImplementedError(f"dbr_quant.inspect: {type(f).name} changes the scaling of '{name}', an MoE "
                                          "expert tensor; expert tensors keep their format and granularity (select "
                                          "other layers for Scaling)")
    row_experts = routing.row_experts
    weight_only = op.qconfig.weight_only  # W8A16: the rows go into the GEMM as they are
    quantizers = {"input": (not_quantized(str(name), "input") if weight_only else
                            lambda t: _quantize_rows(st, op, index, t, row_experts)),
                  "weight": lambda t: _quantize_weight(st, op, param, t)}
    inputs = {"input": rows, "weight": w_hp}
    processed, quantized = {}, {}
    want_q = fp8 or any(f.overrides("log_quantized") for f in features)
    for tensor, t in inputs.items():
        quantize = quantizers[tensor]
        ctx = TensorContext(layer, tensor, inspector.step, fp8, inspector._logger(layer.name, tensor), quantize) \
            if layer is not None else None
        quantizes = not (weight_only and tensor == "input")
        processed[tensor], q = feature_pass(features, ctx, t, tensor == "weight", want_q and quantizes, fp8,
                                            quantize)
        if q is not None:
            quantized[tensor] = q
    y = _gemm(processed, quantized if fp8 else None, offsets, rows.dtype)
    if bias is not None:
        y = y + bias[row_experts]
    if layer is not None:
        ctx = TensorContext(layer, "output", inspector.step, fp8, inspector._logger(layer.name, "output"),
                            _no_quantizer)
        for f in features:
            f.log_tensor(ctx, y)
        for f in features:
            y = f.process_tensor(ctx, y)
    return y


def _hp_weight(param: torch.Tensor, transposed: bool) -> torch.Tensor:
    if type(param) is FP8Weight:
        return kernels.dequantize(param.qdata, param.elementwise_scale(), param.dtype)
    w = param.detach()
    return w.transpose(-2, -1) if transposed else w


def _quantize_rows(st: MoeState, op: SeenOp, index: int, rows: torch.Tensor | None, row_experts: torch.Tensor
                   ) -> Quantized:
    """The rows with the scale FP8 execution uses: dynamic (per token or tensor), or static — the gate_up
    input scale, or each row's expert's down-input scale."""
    if rows is None:
        raise RuntimeError("expert input rows are needed to quantize them")
    cfg = op.qconfig.activation
    if cfg.granularity == "mx":  # MXFP8 experts: E8M0 codes per row per 32 channels (dynamic)
        data, code = kernels.mx_quantize(rows, cfg.format, cfg.mx_scale_rounding == "ceil")
        return Quantized(data, code, cfg.format, group=MX_BLOCK)
    if op.qconfig.dynamic and cfg.granularity == "group":  # block-scaled experts: per token per group
        q, scale = kernels.group_quantize(rows, cfg.group_size, cfg.format)
        return Quantized(q, scale, cfg.format, group=cfg.group_size)
    if op.qconfig.dynamic:
        scale = kernels.dynamic_scale(rows, cfg.format, per_token=cfg.granularity == "token")
    else:
        scale = _static_scale(st, op, index).to(rows.device)
        scale = scale[row_experts].unsqueeze(-1) if scale.numel() > 1 else scale.reshape(())
    return Quantized(kernels.quantize(rows, scale, cfg.format), scale, cfg.format)


def _static_scale(st: MoeState, op: SeenOp, index: int) -> torch.Tensor:
    if st.converted:
        return st.frozen_scale(op, "input")
    if index == 0 and not st.spec.dense:
        return observer_of(st, observer_key(0, "input")).scale().detach()
    return st.expert_input_scales(index)[0]  # what freeze_scales will store: one per expert


def _quantize_weight(st: MoeState, op: SeenOp, param: torch.Tensor, w: torch.Tensor | None) -> Quantized:
    """The stored FP8 weight (converted, ``w`` None), or ``w`` [E, N, K] quantized as convert does."""
    cfg = op.qconfig.weight
    if w is None and type(param) is FP8Weight:
        return Quantized.weight(param.qdata, param.scale, cfg.format, param.block)
    quantized = quantize_weight(_hp_weight(param, st.spec.transposed) if w is None else w, cfg)
    return Quantized.weight(quantized.qdata, quantized.scale, cfg.format, quantized.block)


def _gemm(x: dict[str, torch.Tensor], q: dict[str, Quantized] | None, offsets: list[int],
          dtype: torch.dtype) -> torch.Tensor:
    w = x["weight"]
    out = x["input"].new_empty((x["input"].shape[0], w.shape[1]), dtype=dtype)
    for e in range(w.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        if q is None:
            out[lo:hi] = F.linear(x["input"][lo:hi], w[e]).to(dtype)
            continue
        qi, qw = q.get("input"), q["weight"]
        if qi is None:  # weight-only experts (W8A16): the rows as they are
            out[lo:hi] = kernels.fp8_weight_only_linear(x["input"][lo:hi], qw.data[e], qw.scale[e].reshape(-1),
                                                        out_dtype=dtype)
            continue
        xs = qi.scale[lo:hi] if qi.scale.dim() else qi.scale
        if qw.scale.dtype == torch.uint8:  # MXFP8: E8M0 codes on both operands
            out[lo:hi] = kernels.fp8_mx_linear(qi.data[lo:hi], xs, qw.data[e], qw.scale[e], out_dtype=dtype)
            continue
        if qw.block is not None:  # block GEMM: one x scale per row per K block (coarser ones repeated)
            kb = -(-qw.data.shape[-1] // qw.block[1])
            xs = xs if qi.group is not None else xs.float().reshape(-1, 1).expand(hi - lo, kb)
            out[lo:hi] = kernels.fp8_block_linear(qi.data[lo:hi], xs, qw.data[e], qw.scale[e], block=qw.block,
                                                  out_dtype=dtype)
            continue
        out[lo:hi] = kernels.fp8_linear(qi.data[lo:hi], xs, qw.data[e], qw.scale[e].reshape(-1), out_dtype=dtype)
    return out


def _no_quantizer(x: torch.Tensor) -> Quantized:
    raise RuntimeError("the 'output' tensor has no FP8 scale: it is not quantized")

