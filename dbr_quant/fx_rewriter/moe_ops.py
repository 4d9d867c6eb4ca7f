"""``dbr_quant::fp8_moe_experts``: a converted MoE experts module's whole computation as one graph node.

An experts call (``moe/call.py``) routes tokens to experts: how many rows each expert gets depends on the
data. In a graph that would mean data-dependent shapes (``nonzero``, a Python loop over the experts hit),
which ``torch.export`` and ``torch.compile(fullgraph=True)`` cannot take without unbacked sizes. So the
routing plan (``kernels.moe_route``) is built *inside* the op: its inputs and output have static shapes
(hidden states [T, H], top-k ids and weights [T, k] → [T, H_out]); the fake implementation needs nothing
else. The op body is the function the eager converted model runs (``moe.compute.fp8_experts_compute``), so the
graph computes what eager does, bit for bit.

Under ``torch.compile`` inductor keeps the op opaque (no lowering registered: a grouped GEMM over a ragged
plan has no static-shape decomposition worth having on CPU; on CUDA it calls the Triton grouped kernels).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.fx_rewriter.lowering import ensure_lowerings
from dbr_quant.fx_rewriter.oplib import define
from dbr_quant.moe.compute import ExpertsScheme, down_combine, fp8_experts_compute, gate_up_rows


@define("fp8_moe_experts")
def fp8_moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13_q: Tensor, w13_scale: Tensor,
                    w2_q: Tensor, w2_scale: Tensor, x_scale: Tensor | None, h_scale: Tensor | None,
                    bias13: Tensor | None, bias2: Tensor | None, activation: str, fmt: str, per_token: bool,
                    out_dtype: torch.dtype, block: list[int] | None = None, group: bool = False,
                    weight_only: bool = False, mx: bool = False, mx_round_up: bool = False) -> Tensor:
    """x [T, H], topk_ids / topk_weights [T, k], w13_q [E, N1, H], w2_q [E, H_out, I] → [T, H_out].
    Static activation scales when ``x_scale`` and ``h_scale`` are given, else dynamic (``per_token``, or per
    token-group with ``group``). ``block``: block-scaled weights (scales [E, ⌈N/bn⌉, ⌈K/bk⌉]). ``weight_only`` /
    ``mx``: W8A16 / MXFP8 experts (see moe.compute.fp8_experts_compute)."""
    return fp8_experts_compute(x, topk_ids, topk_weights, w13_q, w13_scale, w2_q, w2_scale, x_scale, h_scale,
                               bias13, bias2, activation=activation, fmt=FP8Format.parse(fmt),
                               per_token=per_token, out_dtype=out_dtype,
                               block=None if block is None else (block[0], block[1]), group=group,
                               weight_only=weight_only, mx=mx, mx_round_up=mx_round_up)


@fp8_moe_experts.register_fake
def _(x, topk_ids, topk_weights, w13_q, w13_scale, w2_q, w2_scale, x_scale, h_scale, bias13, bias2, activation,
      fmt, per_token, out_dtype, block=None, group=False, weight_only=False, mx=False, mx_round_up=False):
    ensure_lowerings()
    torch._check(topk_ids.shape[0] == x.shape[0], lambda: "fp8_moe_experts: topk_ids must have one row per token")
    return x.new_empty((x.shape[0], w2_q.shape[1]), dtype=out_dtype)


def graph_fp8_moe_experts(x, topk_ids, topk_weights, w13_q, w13_scale, w2_q, w2_scale, x_scale, h_scale, bias13,
                          bias2, *, activation, fmt, per_token, out_dtype, block=None, group=False,
                          weight_only=False, mx=False, mx_round_up=False):
    """The ``GraphOps`` entry (``fmt`` an ``FP8Format``)."""
    return torch.ops.dbr_quant.fp8_moe_experts(x, topk_ids, topk_weights, w13_q, w13_scale, w2_q, w2_scale,
                                               x_scale, h_scale, bias13, bias2, activation or "", fmt.value,
                                               per_token, out_dtype, None if block is None else list(block), group,
                                               weight_only, mx, mx_round_up)


# ------------------------------------------------------------------ an experts module with its own gate function
# (GPT-OSS's clamped SwiGLU, moe/experts.py): two nodes, the gate traced between them. The rows in between are
# in the routing plan's sorted order, T·top_k of them whatever the routing (a static shape); each op builds the
# plan from the ids (the same plan: moe_route is deterministic), so the graph computes what eager does, bit
# for bit.


def _scheme(fmt: str, per_token: bool, out_dtype: torch.dtype, block: list[int] | None, group: bool,
            weight_only: bool, mx: bool, mx_round_up: bool) -> ExpertsScheme:
    return ExpertsScheme(FP8Format.parse(fmt), per_token, out_dtype, None if block is None else (block[0], block[1]),
                         group, weight_only, mx, mx_round_up)


@define("fp8_moe_gate_up")
def fp8_moe_gate_up(x: Tensor, topk_ids: Tensor, w13_q: Tensor, w13_scale: Tensor, x_scale: Tensor | None,
                    bias13: Tensor | None, static: bool, fmt: str, per_token: bool, out_dtype: torch.dtype,
                    block: list[int] | None = None, group: bool = False, weight_only: bool = False, mx: bool = False,
                    mx_round_up: bool = False) -> Tensor:
    """x [T, H], topk_ids [T, k] → the gate_up rows [T·k, N1] in sorted order, no epilogue
    (moe.compute.gate_up_rows)."""
    routing = kernels.moe_route(topk_ids, w13_q.shape[0])
    return gate_up_rows(x, routing, w13_q, w13_scale, x_scale, bias13,
                        _scheme(fmt, per_token, out_dtype, block, group, weight_only, mx, mx_round_up),
                        activation=None, static=static)


@fp8_moe_gate_up.register_fake
def _(x, topk_ids, w13_q, w13_scale, x_scale, bias13, static, fmt, per_token, out_dtype, block=None, group=False,
      weight_only=False, mx=False, mx_round_up=False):
    ensure_lowerings()
    fp32_rows = static and block is None and not weight_only and not mx  # what gate_up_rows returns
    return x.new_empty((topk_ids.shape[0] * topk_ids.shape[1], w13_q.shape[1]),
                       dtype=torch.float32 if fp32_rows else out_dtype)


@define("fp8_moe_down")
def fp8_moe_down(h: Tensor, topk_ids: Tensor, topk_weights: Tensor, w2_q: Tensor, w2_scale: Tensor,
                 h_scale: Tensor | None, bias2: Tensor | None, fmt: str, per_token: bool, out_dtype: torch.dtype,
                 block: list[int] | None = None, group: bool = False, weight_only: bool = False, mx: bool = False,
                 mx_round_up: bool = False) -> Tensor:
    """The gated rows h [T·k, I] in sorted order → [T, H_out] (moe.compute.down_combine)."""
    routing = kernels.moe_route(topk_ids, w2_q.shape[0])
    return down_combine(h, routing, topk_weights, w2_q, w2_scale, h_scale, bias2,
                        _scheme(fmt, per_token, out_dtype, block, group, weight_only, mx, mx_round_up))


@fp8_moe_down.register_fake
def _(h, topk_ids, topk_weights, w2_q, w2_scale, h_scale, bias2, fmt, per_token, out_dtype, block=None, group=False,
      weight_only=False, mx=False, mx_round_up=False):
    ensure_lowerings()
    return h.new_empty((topk_ids.shape[0], w2_q.shape[1]), dtype=out_dtype)


def graph_fp8_moe_gated(x, topk_ids, topk_weights, w13_q, w13_scale, w2_q, w2_scale, x_scale, h_scale, bias13,
                        bias2, gate, *, fmt, per_token, out_dtype, block=None, group=False, weight_only=False,
                        mx=False, mx_round_up=False):
    """The ``GraphOps`` entry for experts with their own ``gate`` function: two nodes, ``gate`` between them."""
    flags = (fmt.value, per_token, out_dtype, None if block is None else list(block), group, weight_only, mx,
             mx_round_up)
    rows = torch.ops.dbr_quant.fp8_moe_gate_up(x, topk_ids, w13_q, w13_scale, x_scale, bias13, h_scale is not None,
                                               *flags)
    return torch.ops.dbr_quant.fp8_moe_down(gate(rows), topk_ids, topk_weights, w2_q, w2_scale, h_scale, bias2,
                                            *flags)
