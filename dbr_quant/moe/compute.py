"""The FP8 experts computation on flat inputs: what an eager converted experts call and the graph op
``dbr_quant::fp8_moe_experts`` (fx_rewriter/moe_ops.py) both run. Plain tensors in, tensor out: no module,
no record."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.routing import MoeRouting

Gate = Callable[[torch.Tensor], torch.Tensor]  # an experts module's own gate function on gate_up rows (GPT-OSS)


def flat_inputs(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An experts call's (hidden_states, top_k_index, top_k_weights) as x [T, H], ids / weights [T, k]."""
    return x.reshape(-1, x.shape[-1]), ids.reshape(-1, ids.shape[-1]), w.reshape(-1, w.shape[-1])


def fp8_experts_compute(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13_q: torch.Tensor,
                        w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
                        x_scale: torch.Tensor | None, h_scale: torch.Tensor | None, bias13: torch.Tensor | None,
                        bias2: torch.Tensor | None, *, activation: str, fmt: FP8Format, per_token: bool,
                        out_dtype: torch.dtype, block: tuple[int, int] | None = None,
                        group: bool = False, weight_only: bool = False, mx: bool = False,
                        mx_round_up: bool = False, gate: Gate | None = None) -> torch.Tensor:
    """An experts call on flat inputs (x [T, H], ids / weights [T, k]) → [T, H_out]: routing plan, then
    static scales (``x_scale``, ``h_scale`` given) → ``kernels.fp8_moe_block`` (3 launches after routing);
    dynamic → quantize, gate_up (high-precision out), quantize, down + scatter-add (4 launches). The eager
    model and the graph op ``dbr_quant::fp8_moe_experts`` both run this. ``block``: block-scaled weights
    (scales [E, ⌈N/bn⌉, ⌈K/bk⌉]), see :func:`_block_experts`. ``weight_only``: W8A16 experts, x and h never
    quantized (2 launches); ``mx``: MXFP8 experts (E8M0 weight codes [E, N, ⌈K/32⌉], x and h quantized per 32
    channels by ``mx_quantize``, the exponent rounded up with ``mx_round_up``), see :func:`_mx_experts`.
    ``gate``: the module's own gate function (``activation`` None): the gate_up GEMM has no epilogue, ``gate``
    runs on its high-precision sorted rows between the two GEMMs (static scales: :func:`_static_gate_experts`)."""
    if gate is not None and activation is not None:
        raise ValueError(f"fp8_experts_compute: a gate function and the epilogue {activation!r} both given; the "
                         "gate function replaces the epilogue")
    routing = kernels.moe_route(ids, w13_q.shape[0])
    if weight_only:  # the high-precision rows go straight into the grouped W8A16 GEMMs, as the dense linears read x
        h = kernels.fp8_grouped_weight_only_linear(x, w13_q, w13_scale, routing, bias=bias13, activation=activation,
                                                   out_dtype=out_dtype)
        return kernels.fp8_grouped_weight_only_linear(h if gate is None else gate(h), w2_q, w2_scale, routing,
                                                      x_sorted=True, bias=bias2, topk_weights=weights,
                                                      out_dtype=out_dtype)
    if mx:  # each expert's rows exactly the dense MX linear's (fp8_mx_linear); x's codes per token, h's per row
        return _dynamic_experts(x, routing, weights, w13_q, w13_scale, w2_q, w2_scale, bias13, bias2,
                                lambda t: kernels.mx_quantize(t, fmt, mx_round_up), kernels.fp8_grouped_mx_linear,
                                activation=activation, out_dtype=out_dtype, gate=gate)
    if block is not None:
        return _block_experts(x, routing, weights, w13_q, w13_scale, w2_q, w2_scale, x_scale, h_scale, bias13, bias2,
                              activation=activation, fmt=fmt, per_token=per_token, group=group, block=block,
                              out_dtype=out_dtype, gate=gate)
    if h_scale is not None and gate is not None:
        return _static_gate_experts(x, routing, weights, w13_q, w13_scale, w2_q, w2_scale, x_scale, h_scale, bias13,
                                    bias2, gate, fmt=fmt, out_dtype=out_dtype)
    if h_scale is not None:
        assert activation is not None  # no gate function: the epilogue does act(gate)·up
        return kernels.fp8_moe_block(x, routing, weights, w13_q, w13_scale, w2_q, w2_scale, h_scale,
                                     x_scale=x_scale, activation=activation, fmt=fmt, bias13=bias13, bias2=bias2,
                                     out_dtype=out_dtype)
    return _dynamic_experts(x, routing, weights, w13_q, w13_scale, w2_q, w2_scale, bias13, bias2,
                            lambda t: kernels.dynamic_quantize(t, fmt, per_token), kernels.fp8_grouped_linear,
                            activation=activation, out_dtype=out_dtype, gate=gate)


def _static_gate_experts(x: torch.Tensor, routing: MoeRouting, weights: torch.Tensor, w13_q: torch.Tensor,
                         w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor, x_scale: torch.Tensor,
                         h_scale: torch.Tensor, bias13: torch.Tensor | None, bias2: torch.Tensor | None, gate: Gate, *,
                         fmt: FP8Format, out_dtype: torch.dtype) -> torch.Tensor:
    """Static scales and the module's own gate (GPT-OSS): quantize x, gate_up grouped GEMM with its bias and no
    epilogue (fp32 rows in sorted order, as the fused epilogue sees them), ``gate`` on them, quantize each row
    with its expert's down-input scale, down grouped GEMM with its bias and the routing-weighted scatter-add:
    kernels.fp8_moe_block's steps, the gate a step of its own (4 launches after routing)."""
    if x_scale.numel() == 1:
        x_q, x_sorted = kernels.quantize(x, x_scale, fmt), False
    else:
        x_q, x_sorted = kernels.moe_quantize(x, x_scale, routing, fmt), True
    y = kernels.fp8_grouped_linear(x_q, x_scale, w13_q, w13_scale, routing, x_sorted=x_sorted, bias=bias13,
                                   out_dtype=torch.float32)
    h = gate(y)
    row_scale = h_scale.float().reshape(()) if h_scale.numel() == 1 else h_scale.float()[routing.row_experts, None]
    h_q = kernels.quantize(h, row_scale, fmt)
    return kernels.fp8_grouped_linear(h_q, h_scale, w2_q, w2_scale, routing, x_sorted=True, bias=bias2,
                                      topk_weights=weights, out_dtype=out_dtype)


def _dynamic_experts(x: torch.Tensor, routing: MoeRouting, weights: torch.Tensor, w13_q: torch.Tensor,
                     w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor, bias13: torch.Tensor | None,
                     bias2: torch.Tensor | None, quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                     grouped: Callable[..., torch.Tensor], *, activation: str | None,
                     out_dtype: torch.dtype, gate: Gate | None = None) -> torch.Tensor:
    """Experts with dynamic activation scales: ``quantize`` x (FP8 and its scales), gate_up ``grouped`` GEMM
    (high-precision out; then the module's own ``gate`` when given), ``quantize`` h (sorted rows), down
    ``grouped`` GEMM with the routing-weighted scatter-add (4 launches)."""
    x_q, xs = quantize(x)
    h = grouped(x_q, xs, w13_q, w13_scale, routing, bias=bias13, activation=activation, out_dtype=out_dtype)
    h_q, hs = quantize(h if gate is None else gate(h))
    return grouped(h_q, hs, w2_q, w2_scale, routing, x_sorted=True, bias=bias2, topk_weights=weights,
                   out_dtype=out_dtype)


def _block_experts(x: torch.Tensor, routing: MoeRouting, weights: torch.Tensor, w13_q: torch.Tensor,
                   w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor, x_scale: torch.Tensor | None,
                   h_scale: torch.Tensor | None, bias13: torch.Tensor | None, bias2: torch.Tensor | None, *,
                   activation: str | None, fmt: FP8Format, per_token: bool, group: bool, block: tuple[int, int],
                   out_dtype: torch.dtype, gate: Gate | None = None) -> torch.Tensor:
    """Block-scaled experts (the DeepSeek-V3 layout): quantize x (per-token groups of ``block[1]`` channels,
    or per-token / static scales repeated per group, as the dense block linear takes them), gate_up block GEMM
    per expert (high-precision out), quantize h the same way (static: each row with its expert's scale), down
    block GEMM per expert with the routing-weighted scatter-add (kernels.fp8_grouped_block_linear)."""
    bk = block[1]
    x_q, xs = _group_layout(x, x_scale, fmt, per_token, group, bk)
    h = kernels.fp8_grouped_block_linear(x_q, xs, w13_q, w13_scale, routing, block=block, bias=bias13,
                                         activation=activation, out_dtype=out_dtype)
    h = h if gate is None else gate(h)
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
