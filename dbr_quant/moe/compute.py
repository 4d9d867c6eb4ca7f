"""The FP8 experts computation on flat inputs: what an eager converted experts call and the graph op
``dbr_quant::fp8_moe_experts`` (fx_rewriter/moe_ops.py) both run. Plain tensors in, tensor out: no module,
no record."""

from __future__ import annotations

import torch

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.routing import MoeRouting


def flat_inputs(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An experts call's (hidden_states, top_k_index, top_k_weights) as x [T, H], ids / weights [T, k]."""
    return x.reshape(-1, x.shape[-1]), ids.reshape(-1, ids.shape[-1]), w.reshape(-1, w.shape[-1])


def fp8_experts_compute(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13_q: torch.Tensor,
                        w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
                        x_scale: torch.Tensor | None, h_scale: torch.Tensor | None, bias13: torch.Tensor | None,
                        bias2: torch.Tensor | None, *, activation: str, fmt: FP8Format, per_token: bool,
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


def _block_experts(x: torch.Tensor, routing: MoeRouting, weights: torch.Tensor, w13_q: torch.Tensor,
                   w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor, x_scale: torch.Tensor | None,
                   h_scale: torch.Tensor | None, bias13: torch.Tensor | None, bias2: torch.Tensor | None, *,
                   activation: str | None, fmt: FP8Format, per_token: bool, group: bool, block: tuple[int, int],
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


def _group_layout(x: torch.Tensor, scale: torch.Tensor | None, fmt: FP8Format, per_token: bool, group: bool,
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
