"""Reference grouped FP8 GEMM for mixture-of-experts blocks: plain torch, exact FP8 semantics (as
:mod:`dbr_quant.kernels.reference.dense` defines them), the ground truth of the CPU backend and the Triton kernel.

A grouped GEMM runs every expert's rows (see :mod:`dbr_quant.kernels.routing`) against that expert's FP8 weight
``w_q[e]`` [N, K] with the dense GEMM's semantics, so each expert's rows get exactly what
:func:`dense.fp8_linear` gives them: FP8 operands, fp32 accumulation, ``acc·(sx·sw[e]) + b[e]``,
then the activation (gated ones take ``w_q[e]`` stacked as [gate; up] and return ``silu(gate)·up``), then
the output dtype or FP8 with the next projection's input scale. It is a loop over the experts that have
rows, each step one dense GEMM: the rows of one expert are one GEMM, as in the Triton kernel. The dense GEMM is
swappable (``linear`` / ``block_linear``): the CPU backend runs this loop with its own.

The same loop runs the other schemes' dense linears per expert: weight-only FP8 (:func:`fp8_grouped_weight_only_linear`:
activations high precision, ``weight_only.fp8_weight_only_linear``), block-scaled FP8
(:func:`fp8_grouped_block_linear`) and MXFP8 (:func:`fp8_grouped_mx_linear`: ``mx.fp8_mx_linear``, E8M0 codes),
so each expert's rows get exactly what that scheme's dense linear gives them.

With ``topk_weights`` the result is not returned per row: each row is multiplied by its routing weight
and added into its token's output row (``out[t] = Σ_j w[t, j]·y[t, j]``, fp32, rows added in sorted order
by ``index_add_``), which is an MoE block's down projection and combine in one step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference import block as reference_block
from dbr_quant.kernels.reference import dense as reference
from dbr_quant.kernels.reference import mx as reference_mx
from dbr_quant.kernels.reference import weight_only as reference_weight_only
from dbr_quant.kernels.routing import MoeRouting, expert_out_scale, expert_weight_scale, input_scale_kind

Rows = slice | torch.Tensor  # the input rows of one expert: a slice of sorted rows, or its tokens' indices


def fp8_grouped_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    routing: MoeRouting,
    *,
    x_sorted: bool = False,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.float32,
    out_scale: torch.Tensor | None = None,
    out_fmt: FP8Format = FP8Format.E4M3,
    topk_weights: torch.Tensor | None = None,
    deterministic: bool = True,
    linear: Callable[..., torch.Tensor] = reference.fp8_linear,
) -> torch.Tensor:
    """Per expert ``e``: ``act(x_rows·w_q[e]ᵀ·sx·sw[e] + bias[e])`` for the rows ``routing`` gives it.

    * ``x_q``: token order [T, K] (rows gather their token; ``x_sorted=False``) or already in sorted row
      order [T·top_k, K] (``x_sorted=True``, e.g. the gate_up output feeding the down projection).
    * ``x_scale``: one value, one per expert ([E]), or one per input row ([T, 1] / [T·top_k, 1]).
    * ``w_q`` [E, N, K] FP8 (gated: [E, 2N, K]); ``w_scale`` one value, [E], or [E, N]; ``bias`` [E, N].
    * ``out_scale`` (one value or [E]): return FP8 in ``out_fmt``, else ``out_dtype``; rows in sorted order.
    * ``topk_weights`` [T, top_k]: return [T, N] in ``out_dtype``, the routing-weighted sum over each
      token's experts (no ``out_scale`` then). The combine is always in a fixed order here
      (``deterministic`` is accepted for the backends' common signature).
    * ``linear``: the dense GEMM each expert's rows run (``dense.fp8_linear``'s signature).
    """
    op = "fp8_grouped_linear"
    check_grouped_args(x_q, w_q, routing, x_sorted, activation, out_scale, topk_weights, op)
    num_e, n_w = w_q.shape[0], w_q.shape[1]
    n = n_w // 2 if activation in reference.GATED else n_w
    rows_in = x_q.shape[0]
    kind = input_scale_kind(x_scale, num_e, rows_in, op)
    xs_all = x_scale.detach().float()
    ws_all = expert_weight_scale(w_scale, num_e, n_w, op)
    os_all = None if out_scale is None else expert_out_scale(out_scale, num_e, op)
    scatter = topk_weights is not None
    rows_dtype = torch.float32 if scatter else (out_fmt.dtype if out_scale is not None else out_dtype)

    def expert_rows(e: int, src: Rows) -> torch.Tensor:
        xs = xs_all[src] if kind == "row" else xs_all[e] if kind == "expert" else xs_all.reshape(())
        os = None if os_all is None else os_all if os_all.dim() == 0 else os_all[e]
        return linear(x_q[src], xs, w_q[e], expert_scale(ws_all, e), bias=None if bias is None else bias[e],
                      activation=activation, out_dtype=torch.float32 if scatter else out_dtype, out_scale=os,
                      out_fmt=out_fmt)

    y_rows = run_experts(routing, x_sorted, n, rows_dtype, x_q.device, expert_rows)
    return y_rows if topk_weights is None else combine(y_rows, routing, topk_weights, out_dtype)


def fp8_grouped_block_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    routing: MoeRouting,
    *,
    block: tuple[int, int],
    x_sorted: bool = False,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.float32,
    topk_weights: torch.Tensor | None = None,
    block_linear: Callable[..., torch.Tensor] = reference_block.fp8_block_linear,
) -> torch.Tensor:
    """Block-scaled experts: per expert ``e``, ``block_linear`` (:func:`block.fp8_block_linear`) of its rows with
    ``w_scale[e]`` [⌈N/bn⌉, ⌈K/bk⌉] (gated: [gate; up] blocked half by half, 2·⌈N/2/bn⌉ rows) and the rows'
    per-token-group scales ``x_scale`` [rows, ⌈K/bk⌉] (token order, or sorted rows with ``x_sorted``), applied
    per K block in fp32. Output, ``topk_weights`` combine and ``x_sorted`` as :func:`fp8_grouped_linear`
    (no FP8 output: the next projection's group scales come from this output)."""
    op = "fp8_grouped_block_linear"
    check_grouped_args(x_q, w_q, routing, x_sorted, activation, None, topk_weights, op)
    bn, bk = reference_block.check_block(block)
    num_e, n_w, k = w_q.shape
    rows_in = x_q.shape[0]
    if tuple(x_scale.shape) != (rows_in, -(-k // bk)):
        raise ValueError(f"{op}: x_scale must be [{rows_in}, {-(-k // bk)}] (one scale per row per group of {bk} "
                         f"channels), got {tuple(x_scale.shape)}")
    if w_scale.dim() != 3 or w_scale.shape[0] != num_e:
        raise ValueError(f"{op}: w_scale must be [E={num_e}, row blocks, K blocks] (one block grid per expert), got "
                         f"{tuple(w_scale.shape)}")
    n = n_w // 2 if activation in reference.GATED else n_w
    rows_dtype = torch.float32 if topk_weights is not None else out_dtype
    y_rows = run_experts(routing, x_sorted, n, rows_dtype, x_q.device, lambda e, src: block_linear(
        x_q[src], x_scale[src], w_q[e], w_scale[e], block=(bn, bk), bias=None if bias is None else bias[e],
        activation=activation, out_dtype=rows_dtype))
    return y_rows if topk_weights is None else combine(y_rows, routing, topk_weights, out_dtype)


def fp8_grouped_weight_only_linear(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, routing: MoeRouting, *, x_sorted: bool = False,
    bias: torch.Tensor | None = None, activation: str | None = None, out_dtype: torch.dtype = torch.float32,
    topk_weights: torch.Tensor | None = None, deterministic: bool = True,
    linear: Callable[..., torch.Tensor] = reference_weight_only.fp8_weight_only_linear,
) -> torch.Tensor:
    """Weight-only FP8 experts (W8A16): per expert ``e``, ``linear`` (:func:`weight_only.fp8_weight_only_linear`)
    of its rows of the high-precision ``x`` (fp32 / bf16 / fp16: never quantized) with ``w_q[e]`` and its scale
    (``w_scale`` one value, [E] or [E, N] as :func:`fp8_grouped_linear`'s). Rows, ``x_sorted``, ``bias``,
    ``topk_weights`` and ``deterministic`` as :func:`fp8_grouped_linear` (no FP8 output: the next projection
    reads this one's output as it is)."""
    op = "fp8_grouped_weight_only_linear"
    check_grouped_args(x, w_q, routing, x_sorted, activation, None, topk_weights, op)
    num_e, n_w = w_q.shape[0], w_q.shape[1]
    n = n_w // 2 if activation in reference.GATED else n_w
    ws_all = expert_weight_scale(w_scale, num_e, n_w, op)
    rows_dtype = torch.float32 if topk_weights is not None else out_dtype
    y_rows = run_experts(routing, x_sorted, n, rows_dtype, x.device, lambda e, src: linear(
        x[src], w_q[e], expert_scale(ws_all, e), bias=None if bias is None else bias[e], activation=activation,
        out_dtype=rows_dtype))
    return y_rows if topk_weights is None else combine(y_rows, routing, topk_weights, out_dtype)


def fp8_grouped_mx_linear(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, routing: MoeRouting, *,
    x_sorted: bool = False, bias: torch.Tensor | None = None, activation: str | None = None,
    out_dtype: torch.dtype = torch.float32, topk_weights: torch.Tensor | None = None,
    mx_linear: Callable[..., torch.Tensor] = reference_mx.fp8_mx_linear,
) -> torch.Tensor:
    """MXFP8 experts: per expert ``e``, ``mx_linear`` (:func:`mx.fp8_mx_linear`) of its rows with their E8M0
    codes ``x_scale`` [rows, ⌈K/32⌉] (``mx_quantize`` of x: token order, or sorted rows with ``x_sorted``) and
    ``w_q[e]`` with its codes ``w_scale[e]`` ([E, N, ⌈K/32⌉] uint8; gated: [gate; up] rows). Output,
    ``topk_weights`` and ``x_sorted`` as :func:`fp8_grouped_linear` (no FP8 output: MX activations are dynamic,
    the next projection's codes come from this output)."""
    op = "fp8_grouped_mx_linear"
    check_grouped_args(x_q, w_q, routing, x_sorted, activation, None, topk_weights, op)
    reference_mx.check_e8m0(x_scale, f"{op}: x_scale")
    reference_mx.check_e8m0(w_scale, f"{op}: w_scale")
    num_e, n_w, k = w_q.shape
    kb = -(-k // reference_mx.MX_BLOCK)
    if tuple(x_scale.shape) != (x_q.shape[0], kb) or tuple(w_scale.shape) != (num_e, n_w, kb):
        raise ValueError(f"{op}: x_scale must be [{x_q.shape[0]}, {kb}] and w_scale [{num_e}, {n_w}, {kb}] (one E8M0 "
                         f"code per row per 32 channels), got {tuple(x_scale.shape)} and {tuple(w_scale.shape)}")
    n = n_w // 2 if activation in reference.GATED else n_w
    rows_dtype = torch.float32 if topk_weights is not None else out_dtype
    y_rows = run_experts(routing, x_sorted, n, rows_dtype, x_q.device, lambda e, src: mx_linear(
        x_q[src], x_scale[src], w_q[e], w_scale[e], bias=None if bias is None else bias[e], activation=activation,
        out_dtype=rows_dtype))
    return y_rows if topk_weights is None else combine(y_rows, routing, topk_weights, out_dtype)


def run_experts(routing: MoeRouting, x_sorted: bool, n: int, rows_dtype: torch.dtype, device: torch.device,
                expert_rows: Callable[[int, Rows], torch.Tensor]) -> torch.Tensor:
    """[T·top_k, n] rows in sorted order: ``expert_rows(e, src)`` for each expert with rows, ``src`` its input
    rows (sorted rows with ``x_sorted``, else its tokens)."""
    tokens = routing.tokens
    y_rows = torch.empty((routing.num_rows, n), dtype=rows_dtype, device=device)
    offsets = routing.expert_offsets.tolist()  # the CPU path: a host copy of E + 1 ints is free
    for e in range(routing.num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        if lo != hi:
            y_rows[lo:hi] = expert_rows(e, slice(lo, hi) if x_sorted else tokens[lo:hi])
    return y_rows


def combine(y_rows: torch.Tensor, routing: MoeRouting, topk_weights: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor:
    """The routing-weighted sum of fp32 sorted rows into token order (``index_add_`` in sorted order), then
    ``out_dtype``: ``out[t] = Σ_j w[t, j]·y[t, j]``."""
    y_rows.mul_(routing.row_weights(topk_weights)[:, None])
    out = torch.zeros((routing.num_tokens, y_rows.shape[1]), dtype=torch.float32, device=y_rows.device)
    return out.index_add_(0, routing.tokens, y_rows).to(out_dtype)


def expert_scale(ws_all: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e``'s weight scale from :func:`expert_weight_scale`'s form: 0-d, or [N] per channel."""
    return ws_all if ws_all.dim() == 0 else ws_all[e].reshape(-1) if ws_all.shape[1] > 1 else ws_all[e, 0]


def moe_quantize(x: torch.Tensor, x_scale: torch.Tensor, routing: MoeRouting, fmt: FP8Format,
                 quantize: reference.Quantize = reference.quantize) -> torch.Tensor:
    """Per-expert static input scales: each sorted row is its token quantized with its expert's scale
    ``x_scale[e]`` ([E]), returned in sorted row order [T·top_k, K] (a token picked by two experts is
    quantized twice, once per scale). Scalar and per-token scales need no gather: use ``quantize`` /
    ``dynamic_quantize`` on x and let the grouped GEMM gather. ``quantize`` is swappable (the CPU backend's)."""
    if x_scale.dim() != 1 or x_scale.numel() != routing.num_experts:
        raise ValueError(f"moe_quantize: x_scale must hold one scale per expert ([{routing.num_experts}]), "
                         f"got shape {tuple(x_scale.shape)}")
    if x.dim() != 2 or x.shape[0] != routing.num_tokens:
        raise ValueError(f"moe_quantize: x must be [{routing.num_tokens}, K] (tokens of the routing), "
                         f"got {tuple(x.shape)}")
    return quantize(x[routing.tokens], x_scale.float()[routing.row_experts][:, None], fmt)


def check_grouped_args(x_q, w_q, routing, x_sorted, activation, out_scale, topk_weights, op) -> None:
    """Shape checks shared by both backends' grouped GEMMs; errors say which argument to fix."""
    if w_q.dim() != 3 or w_q.shape[0] != routing.num_experts:
        raise ValueError(f"{op}: w_q must be [E, N, K] with E = {routing.num_experts} (the routing's experts), "
                         f"got {tuple(w_q.shape)}")
    if x_q.dim() != 2 or x_q.shape[1] != w_q.shape[2]:
        raise ValueError(f"{op}: x_q must be [rows, K] with K = {w_q.shape[2]}, got {tuple(x_q.shape)}")
    rows = routing.num_rows if x_sorted else routing.num_tokens
    if x_q.shape[0] != rows:
        order = "sorted rows (T·top_k)" if x_sorted else "tokens (T)"
        raise ValueError(f"{op}: x_q must have one row per {order} = {rows}, got {x_q.shape[0]}")
    if activation is not None and activation not in reference.ACTIVATIONS + reference.GATED:
        raise ValueError(f"{op}: unknown activation {activation!r}; use one of "
                         f"{reference.ACTIVATIONS + reference.GATED}")
    if activation in reference.GATED and w_q.shape[1] % 2:
        raise ValueError(f"{op}: gated activation {activation!r} needs w_q stacked as [gate; up], "
                         f"got {w_q.shape[1]} rows")
    if topk_weights is not None and out_scale is not None:
        raise ValueError(f"{op}: topk_weights (weighted scatter-add, fp32 sums) and out_scale (FP8 rows) exclude "
                         "each other")
