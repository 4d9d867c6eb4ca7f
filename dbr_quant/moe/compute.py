"""The FP8 experts computation on flat inputs: what an eager converted experts call and the graph op
``dbr_quant::fp8_moe_experts`` (fx_rewriter/moe_ops.py) both run. Plain tensors in, tensor out: no module,
no record."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.routing import MoeRouting

Gate = Callable[[torch.Tensor], torch.Tensor]  # an experts module's own gate function on gate_up rows (GPT-OSS)


def flat_inputs(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An experts call's (hidden_states, top_k_index, top_k_weights) as x [T, H], ids / weights [T, k]."""
    return x.reshape(-1, x.shape[-1]), ids.reshape(-1, ids.shape[-1]), w.reshape(-1, w.shape[-1])


@dataclasses.dataclass(frozen=True)
class ExpertsScheme:
    """How both expert projections quantize (see :func:`fp8_experts_compute`'s keywords)."""

    fmt: FP8Format
    per_token: bool
    out_dtype: torch.dtype
    block: tuple[int, int] | None = None
    group: bool = False
    weight_only: bool = False
    mx: bool = False
    mx_round_up: bool = False


def fp8_experts_compute(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13_q: torch.Tensor,
                        w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
                        x_scale: torch.Tensor | None, h_scale: torch.Tensor | None, bias13: torch.Tensor | None,
                        bias2: torch.Tensor | None, *, activation: str | None = None, fmt: FP8Format, per_token: bool,
                        out_dtype: torch.dtype, block: tuple[int, int] | None = None,
                        group: bool = False, weight_only: bool = False, mx: bool = False,
                        mx_round_up: bool = False, gate: Gate | None = None) -> torch.Tensor:
    """An experts call on flat inputs (x [T, H], ids / weights [T, k]) → [T, H_out]: routing plan, then
    static scales (``x_scale``, ``h_scale`` given) → ``kernels.fp8_moe_block`` (3 launches after routing);
    otherwise :func:`gate_up_rows` then :func:`down_combine` (dynamic: quantize, gate_up, quantize, down +
    scatter-add, 4 launches). The eager model and the graph op ``dbr_quant::fp8_moe_experts`` both run this.
    ``block``: block-scaled weights (scales [E, ⌈N/bn⌉, ⌈K/bk⌉]). ``weight_only``: W8A16 experts, x and h never
    quantized (2 launches); ``mx``: MXFP8 experts (E8M0 weight codes [E, N, ⌈K/32⌉], x and h quantized per 32
    channels by ``mx_quantize``, the exponent rounded up with ``mx_round_up``).
    ``gate``: the module's own gate function (``activation`` None): the gate_up GEMM has no epilogue, ``gate``
    runs on its high-precision sorted rows between the two halves (the graph: two ops, the gate between them)."""
    if gate is not None and activation is not None:
        raise ValueError(f"fp8_experts_compute: a gate function and the epilogue {activation!r} both given; the "
                         "gate function replaces the epilogue")
    routing = kernels.moe_route(ids, w13_q.shape[0])
    scheme = ExpertsScheme(fmt, per_token, out_dtype, block, group, weight_only, mx, mx_round_up)
    if h_scale is not None and gate is None and block is None and not weight_only and not mx:
        assert activation is not None  # no gate function: the epilogue does act(gate)·up
        return kernels.fp8_moe_block(x, routing, weights, w13_q, w13_scale, w2_q, w2_scale, h_scale,
                                     x_scale=x_scale, activation=activation, fmt=fmt, bias13=bias13, bias2=bias2,
                                     out_dtype=out_dtype)
    h = gate_up_rows(x, routing, w13_q, w13_scale, x_scale, bias13, scheme, activation=activation,
                     static=h_scale is not None)
    return down_combine(h if gate is None else gate(h), routing, weights, w2_q, w2_scale, h_scale, bias2, scheme)


def gate_up_rows(x: torch.Tensor, routing: MoeRouting, w13_q: torch.Tensor, w13_scale: torch.Tensor,
                 x_scale: torch.Tensor | None, bias13: torch.Tensor | None, s: ExpertsScheme, *,
                 activation: str | None, static: bool) -> torch.Tensor:
    """The first half of an experts call: x quantized as ``s`` says, the gate_up grouped GEMM with its bias and
    ``activation`` epilogue (None: none) → high-precision rows in sorted order [T·top_k, N]. Static scales
    without an epilogue (a gate function follows): fp32 rows, what the fused epilogue sees before it quantizes."""
    if s.weight_only:  # the high-precision rows go straight into the grouped W8A16 GEMMs, as the dense linears read x
        return kernels.fp8_grouped_weight_only_linear(x, w13_q, w13_scale, routing, bias=bias13,
                                                      activation=activation, out_dtype=s.out_dtype)
    if s.mx:  # each expert's rows exactly the dense MX linear's (fp8_mx_linear); x's codes per token, h's per row
        x_q, xs = kernels.mx_quantize(x, s.fmt, s.mx_round_up)
        return kernels.fp8_grouped_mx_linear(x_q, xs, w13_q, w13_scale, routing, bias=bias13, activation=activation,
                                             out_dtype=s.out_dtype)
    if s.block is not None:  # the DeepSeek-V3 layout: per-token groups of block[1] channels, or coarser repeated
        x_q, xs = _group_layout(x, x_scale if static else None, s, s.block[1])
        return kernels.fp8_grouped_block_linear(x_q, xs, w13_q, w13_scale, routing, block=s.block, bias=bias13,
                                                activation=activation, out_dtype=s.out_dtype)
    x_sorted = False
    if not static:
        x_q, xs = kernels.dynamic_quantize(x, s.fmt, s.per_token)
    elif x_scale is not None and x_scale.numel() > 1:  # one per expert (dense experts): rows gathered, sorted
        x_q, xs, x_sorted = kernels.moe_quantize(x, x_scale, routing, s.fmt), x_scale, True
    else:
        assert x_scale is not None, "static experts have a gate_up input scale"
        x_q, xs = kernels.quantize(x, x_scale, s.fmt), x_scale
    return kernels.fp8_grouped_linear(x_q, xs, w13_q, w13_scale, routing, x_sorted=x_sorted, bias=bias13,
                                      activation=activation, out_dtype=torch.float32 if static else s.out_dtype)


def down_combine(h: torch.Tensor, routing: MoeRouting, weights: torch.Tensor, w2_q: torch.Tensor,
                 w2_scale: torch.Tensor, h_scale: torch.Tensor | None, bias2: torch.Tensor | None,
                 s: ExpertsScheme) -> torch.Tensor:
    """The second half: the sorted rows ``h`` quantized as ``s`` says (static: each row with its expert's
    down-input scale), the down grouped GEMM with its bias and the routing-weighted scatter-add → [T, H_out]."""
    if s.weight_only:
        return kernels.fp8_grouped_weight_only_linear(h, w2_q, w2_scale, routing, x_sorted=True, bias=bias2,
                                                      topk_weights=weights, out_dtype=s.out_dtype)
    if s.mx:
        h_q, hs = kernels.mx_quantize(h, s.fmt, s.mx_round_up)
        return kernels.fp8_grouped_mx_linear(h_q, hs, w2_q, w2_scale, routing, x_sorted=True, bias=bias2,
                                             topk_weights=weights, out_dtype=s.out_dtype)
    row_scale = None if h_scale is None else h_scale.float().reshape(()) if h_scale.numel() == 1 else \
        h_scale.float()[routing.row_experts, None]
    if s.block is not None:
        h_q, hs = _group_layout(h, row_scale, s, s.block[1])
        return kernels.fp8_grouped_block_linear(h_q, hs, w2_q, w2_scale, routing, block=s.block, x_sorted=True,
                                                bias=bias2, topk_weights=weights, out_dtype=s.out_dtype)
    if row_scale is None:
        h_q, hs = kernels.dynamic_quantize(h, s.fmt, s.per_token)
    else:
        assert h_scale is not None
        h_q, hs = kernels.quantize(h, row_scale, s.fmt), h_scale
    return kernels.fp8_grouped_linear(h_q, hs, w2_q, w2_scale, routing, x_sorted=True, bias=bias2,
                                      topk_weights=weights, out_dtype=s.out_dtype)


def _group_layout(x: torch.Tensor, scale: torch.Tensor | None, s: ExpertsScheme, bk: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x [rows, K], scale [rows, ⌈K/bk⌉]): dynamic per-token-group, or any coarser scale (dynamic per
    tensor / per token, static one value / one per row) repeated over the groups."""
    if scale is None and s.group:
        return kernels.group_quantize(x, bk, s.fmt)
    if scale is None:
        x_q, sc = kernels.dynamic_quantize(x, s.fmt, s.per_token)
    else:
        sc = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
        x_q = kernels.quantize(x, sc, s.fmt)
    return x_q, sc.reshape(-1, 1).expand(x.shape[0], -(-x.shape[-1] // bk))
