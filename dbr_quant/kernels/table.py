"""The FP8 kernels, each declared once: signature, documentation, output rule, launch counter, implementations.

Each declaration below is the kernel's signature and docstring; its body is the rule for the output's shape
and dtype only (the fake implementation a traced graph runs: it computes nothing). :func:`kernel_op` says the
rest: the launch counter(s), the reference module whose function of the same name is the exact
implementation, and the Triton kernel. ``dbr_quant.kernels`` (entry points), ``kernels.triton.backend``
(forwarding) and ``fx_rewriter.ops`` (``dbr_quant::`` ops, fakes, ``GraphOps``) are generated from
:data:`TABLE` (see :mod:`.op_table`). A new kernel is one declaration here plus its implementations.

Annotations are read as text by ``fx_rewriter.ops`` to give each argument its graph form (``FP8Format`` ↔
its name, an activation ``str | None`` ↔ "" for None, ``tuple[int, int]`` ↔ a list); an op with an argument
that has no graph form (``MoeRouting``) has no graph op.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.dispatch import record_launch
from dbr_quant.kernels.op_table import KernelOp, TritonKernel, kernel_op
from dbr_quant.kernels.reference import block as reference_block
from dbr_quant.kernels.reference import dense as reference
from dbr_quant.kernels.reference import grouped as reference_grouped
from dbr_quant.kernels.reference import mx as reference_mx
from dbr_quant.kernels.reference import weight_only as reference_weight_only
from dbr_quant.kernels.reference.block import DEFAULT_BLOCK, DEFAULT_GROUP
from dbr_quant.kernels.reference.dense import GATED
from dbr_quant.kernels.routing import MoeRouting

# ------------------------------------------------------------------------------------------ output rules


def _scale_shape(x: Tensor, per_token: bool) -> tuple[int, ...]:
    return (*x.shape[:-1], 1) if per_token else ()


def _group_scale_shape(x: Tensor, group: int) -> tuple[int, ...]:
    return (*x.shape[:-1], -(-x.shape[-1] // group))


def _linear_output(x_q: Tensor, w_q: Tensor, activation: str | None, out_dtype: torch.dtype,
                   out_scale: Tensor | None, out_fmt: FP8Format, rows: int | None = None) -> Tensor:
    """A linear's output: x's rows (or ``rows``) × W's rows (half of them for a gated activation: [gate; up]),
    FP8 in ``out_fmt`` when ``out_scale`` is given, else ``out_dtype``."""
    n = w_q.shape[-2] // 2 if activation in GATED else w_q.shape[-2]
    lead = x_q.shape[:-1] if rows is None else (rows,)
    return x_q.new_empty((*lead, n), dtype=out_dtype if out_scale is None else out_fmt.dtype)


def _grouped_output(x_q: Tensor, w_q: Tensor, routing: MoeRouting, activation: str | None, out_dtype: torch.dtype,
                    out_scale: Tensor | None, out_fmt: FP8Format, topk_weights: Tensor | None) -> Tensor:
    """Rows in sorted order [T·top_k, N], or with ``topk_weights`` combined into token order [T, N]."""
    if topk_weights is not None:
        return _linear_output(x_q, w_q, activation, out_dtype, None, out_fmt, rows=routing.num_tokens)
    return _linear_output(x_q, w_q, activation, out_dtype, out_scale, out_fmt, rows=routing.num_rows)


# ------------------------------------------------------------------------------------- dense (per tensor/row)


@kernel_op(launches="quantize", reference=reference, triton=TritonKernel("quantize"))
def quantize(x: Tensor, scale: Tensor, fmt: FP8Format) -> Tensor:
    """``x / scale`` saturated to ±fmt.max and rounded to FP8 (nearest, ties to even); ``scale`` broadcasts."""
    return torch.empty_like(x, dtype=fmt.dtype)


@kernel_op(launches="dynamic_quantize", reference=reference, triton=TritonKernel("quantize"))
def dynamic_quantize(x: Tensor, fmt: FP8Format, per_token: bool = False) -> tuple[Tensor, Tensor]:
    """Quantize with a scale computed from ``x`` itself (per tensor, or per row of the last dim), in one
    launch where the backend can: returns (fp8, scale)."""
    return torch.empty_like(x, dtype=fmt.dtype), x.new_empty(_scale_shape(x, per_token), dtype=torch.float32)


@kernel_op(launches="dequantize", reference=reference)  # the high-precision path only: plain torch everywhere
def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q · scale`` in ``dtype``."""
    return torch.empty_like(q, dtype=dtype)


@kernel_op(launches="amax", reference=reference, triton=TritonKernel("quantize", "dynamic_quantize", output=1))
def dynamic_scale(x: Tensor, fmt: FP8Format, per_token: bool = False) -> Tensor:
    """The scale ``dynamic_quantize`` would use: amax / fmt.max per tensor (0-d) or per row ([..., 1])."""
    return x.new_empty(_scale_shape(x, per_token), dtype=torch.float32)


@kernel_op(launches="fp8_linear", reference=reference, triton=TritonKernel("gemm"))
def fp8_linear(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, *, bias: Tensor | None = None,
               activation: str | None = None, residual: Tensor | None = None, out_dtype: torch.dtype = torch.float32,
               out_scale: Tensor | None = None, out_fmt: FP8Format = FP8Format.E4M3) -> Tensor:
    """``act(x·Wᵀ·sx·sw + bias) + residual`` on FP8 operands, FP8 out when ``out_scale`` is given
    (see reference.fp8_linear)."""
    return _linear_output(x_q, w_q, activation, out_dtype, out_scale, out_fmt)


def _two_linears(impl: ModuleType, x_q: Tensor, x_scale: Tensor, w1_q: Tensor, w1_scale: Tensor, b1: Tensor | None,
                 activation: str | None, h_scale: Tensor, h_fmt: FP8Format, w2_q: Tensor, w2_scale: Tensor,
                 b2: Tensor | None, residual: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """fp8_mlp's launches: both GEMMs on one backend (``h`` lives where ``x_q`` does)."""
    h = impl.fp8_linear(x_q, x_scale, w1_q, w1_scale, bias=b1, activation=activation, out_dtype=out_dtype,
                        out_scale=h_scale, out_fmt=h_fmt)
    return impl.fp8_linear(h, h_scale, w2_q, w2_scale, bias=b2, residual=residual, out_dtype=out_dtype,
                           out_scale=None, out_fmt=FP8Format.E4M3)


@kernel_op(launches=("fp8_linear", "fp8_linear"), reference=reference, launch=_two_linears)
def fp8_mlp(x_q: Tensor, x_scale: Tensor, w1_q: Tensor, w1_scale: Tensor, b1: Tensor | None, activation: str | None,
            h_scale: Tensor, h_fmt: FP8Format, w2_q: Tensor, w2_scale: Tensor, b2: Tensor | None,
            residual: Tensor | None, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """An MLP's two GEMMs, FP8 between them: fc1's epilogue applies the activation (gated ones take a
    stacked [gate; up] w1) and quantizes with fc2's input scale ``h_scale``; fc2's adds bias and residual.
    Two launches; one graph node (``dbr_quant::fp8_mlp``) when captured."""
    return x_q.new_empty((*x_q.shape[:-1], w2_q.shape[0]), dtype=out_dtype)


@kernel_op(launches="norm_quantize", reference=reference, triton=TritonKernel("norm"))
def layer_norm_quantize(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, scale: Tensor,
                        fmt: FP8Format, *, rms: bool = False) -> tuple[Tensor, Tensor]:
    """LayerNorm / RMSNorm over the last dim and FP8 quantization in one kernel: (normalized, fp8)."""
    return torch.empty_like(x), torch.empty_like(x, dtype=fmt.dtype)


@kernel_op(launches="fp8_matmul", reference=reference, triton=TritonKernel("gemm"))
def fp8_matmul(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor) -> Tensor:
    """``(a·b)·sa·sb`` in fp32, batch dims broadcast as torch.matmul."""
    shape = torch.matmul(a_q.new_empty(a_q.shape, dtype=torch.float32, device="meta"),
                         b_q.new_empty(b_q.shape, dtype=torch.float32, device="meta")).shape
    return torch.empty(shape, dtype=torch.float32, device=a_q.device)


@kernel_op(launches="fp8_attention", reference=reference, triton=TritonKernel("attention"))
def fp8_attention(q_q: Tensor, q_scale: Tensor, k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor, *,
                  attn_mask: Tensor | None = None, is_causal: bool = False, softmax_scale: float | None = None,
                  p_scale: Tensor | None = None, fmt: FP8Format = FP8Format.E4M3) -> Tensor:
    """Scaled dot-product attention on FP8 q, k, v (P quantized with ``p_scale`` when given): fp32 out. Scales
    per tensor (one element), per head (1-D: q, p [Hq]; k, v [Hkv]) or per token (q, k; see reference)."""
    return q_q.new_empty((*q_q.shape[:-1], v_q.shape[-1]), dtype=torch.float32)


# ------------------------------------------------------------------------------- mixture of experts (grouped)


@kernel_op(launches="moe_quantize", reference=reference_grouped, triton=TritonKernel("grouped_gemm"))
def moe_quantize(x: Tensor, x_scale: Tensor, routing: MoeRouting, fmt: FP8Format) -> Tensor:
    """Quantize each (token, expert) row with its expert's input scale ``x_scale`` [E]; rows come out sorted by
    expert ([T·top_k, K], see moe_routing) for ``fp8_grouped_linear(..., x_sorted=True)``. One launch."""
    return x.new_empty((routing.num_rows, x.shape[-1]), dtype=fmt.dtype)


def _combine_launch(impl: ModuleType, routing: MoeRouting, topk_weights: Tensor | None, deterministic: bool) -> None:
    """The Triton path's fixed-order combine is a launch of its own (the reference's is part of its loop)."""
    plain = impl is reference_grouped or impl is cpu_backend
    if not plain and deterministic and topk_weights is not None and routing.top_k > 1:
        record_launch("moe_sum")


@kernel_op(launches="fp8_grouped_linear", reference=reference_grouped, triton=TritonKernel("grouped_gemm"),
           more_launches=_combine_launch)
def fp8_grouped_linear(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, routing: MoeRouting, *,
                       x_sorted: bool = False, bias: Tensor | None = None, activation: str | None = None,
                       out_dtype: torch.dtype = torch.float32, out_scale: Tensor | None = None,
                       out_fmt: FP8Format = FP8Format.E4M3, topk_weights: Tensor | None = None,
                       deterministic: bool = False) -> Tensor:
    """Every expert's rows against its FP8 weight ``w_q[e]`` in one launch, with the dense GEMM's epilogues
    (see reference_grouped.fp8_grouped_linear); with ``topk_weights`` the routing-weighted scatter-add into
    token order. ``deterministic`` (Triton, top_k > 2 matters) combines slots in a fixed order: +1 launch."""
    return _grouped_output(x_q, w_q, routing, activation, out_dtype, out_scale, out_fmt, topk_weights)


@kernel_op(launches="fp8_grouped_block_linear", reference=reference_grouped, triton=TritonKernel("grouped_block_gemm"))
def fp8_grouped_block_linear(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, routing: MoeRouting, *,
                             block: tuple[int, int], x_sorted: bool = False, bias: Tensor | None = None,
                             activation: str | None = None, out_dtype: torch.dtype = torch.float32,
                             topk_weights: Tensor | None = None) -> Tensor:
    """Block-scaled MoE experts: every expert's rows (per-token-group scales ``x_scale`` [rows, ⌈K/bk⌉])
    against its weight ``w_q[e]`` with block scales ``w_scale[e]`` (see
    reference_grouped.fp8_grouped_block_linear). Triton: one launch (the block's K a multiple of 32)."""
    return _grouped_output(x_q, w_q, routing, activation, out_dtype, None, FP8Format.E4M3, topk_weights)


@kernel_op(launches="fp8_grouped_weight_only_linear", reference=reference_grouped, fp8_tensor_cores=False,
           triton=TritonKernel("grouped_weight_only_gemm"), more_launches=_combine_launch)
def fp8_grouped_weight_only_linear(x: Tensor, w_q: Tensor, w_scale: Tensor, routing: MoeRouting, *,
                                   x_sorted: bool = False, bias: Tensor | None = None, activation: str | None = None,
                                   out_dtype: torch.dtype = torch.float32, topk_weights: Tensor | None = None,
                                   deterministic: bool = False) -> Tensor:
    """Weight-only FP8 MoE experts (W8A16): every expert's rows of the high-precision ``x`` against its FP8 weight
    ``w_q[e]`` (per-channel [E, N] or per-expert scales), decoded exactly, in one launch, with the epilogues of
    fp8_weight_only_linear and fp8_grouped_linear's ``topk_weights`` combine (see
    reference_grouped.fp8_grouped_weight_only_linear). Triton on every CUDA GPU (bf16/fp16 MMA: Ampere's path),
    ``deterministic`` as fp8_grouped_linear's."""
    return _grouped_output(x, w_q, routing, activation, out_dtype, None, FP8Format.E4M3, topk_weights)


@kernel_op(launches="fp8_grouped_mx_linear", reference=reference_grouped, triton=TritonKernel("grouped_block_gemm"))
def fp8_grouped_mx_linear(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, routing: MoeRouting, *,
                          x_sorted: bool = False, bias: Tensor | None = None, activation: str | None = None,
                          out_dtype: torch.dtype = torch.float32, topk_weights: Tensor | None = None) -> Tensor:
    """MXFP8 MoE experts: every expert's rows (E8M0 codes ``x_scale`` [rows, ⌈K/32⌉] from mx_quantize) against its
    weight ``w_q[e]`` with codes ``w_scale[e]`` [N, ⌈K/32⌉], each expert exactly fp8_mx_linear (see
    reference_grouped.fp8_grouped_mx_linear); ``topk_weights`` combine as fp8_grouped_linear's. Triton: the grouped
    block GEMM with 1×32 blocks on the decoded scales (sm_89/90; no ``tl.dot_scaled`` grouped kernel yet)."""
    return _grouped_output(x_q, w_q, routing, activation, out_dtype, None, FP8Format.E4M3, topk_weights)


# ---------------------------------------------------- block-scaled FP8 (128×128 weight blocks, 1×128 groups)


@kernel_op(launches="block_quantize_weight", reference=reference_block)  # convert-time work: plain torch everywhere
def block_quantize_weight(w: Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                          fmt: FP8Format = FP8Format.E4M3) -> tuple[Tensor, Tensor]:
    """(fp8 [N, K], scale [⌈N/bn⌉, ⌈K/bk⌉]): the compressed-tensors FP8_BLOCK / FineGrainedFP8 layout.
    Convert-time work: plain torch on every backend and device."""
    grid = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    return torch.empty_like(w, dtype=fmt.dtype), w.new_empty(grid, dtype=torch.float32)


@kernel_op(launches="group_quantize", reference=reference_block, triton=TritonKernel("group_quantize"))
def group_quantize(x: Tensor, group: int = DEFAULT_GROUP, fmt: FP8Format = FP8Format.E4M3) -> tuple[Tensor, Tensor]:
    """Dynamic per-token-group quantization in one launch: (fp8 like x, scale [..., ⌈K/group⌉])."""
    return torch.empty_like(x, dtype=fmt.dtype), x.new_empty(_group_scale_shape(x, group), dtype=torch.float32)


@kernel_op(launches="norm_group_quantize", reference=reference_block, triton=TritonKernel("group_quantize"))
def layer_norm_group_quantize(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                              group: int = DEFAULT_GROUP, fmt: FP8Format = FP8Format.E4M3, *,
                              rms: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm / RMSNorm then per-token-group FP8 in one kernel: (normalized, fp8, scale [..., ⌈K/group⌉])."""
    return (torch.empty_like(x), torch.empty_like(x, dtype=fmt.dtype),
            x.new_empty(_group_scale_shape(x, group), dtype=torch.float32))


@kernel_op(launches="fp8_block_linear", reference=reference_block, triton=TritonKernel("block_gemm"))
def fp8_block_linear(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, *,
                     block: tuple[int, int] = DEFAULT_BLOCK, bias: Tensor | None = None, activation: str | None = None,
                     residual: Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                     out_scale: Tensor | None = None, out_fmt: FP8Format = FP8Format.E4M3) -> Tensor:
    """Block-scaled ``act(x·Wᵀ + bias) + residual``: x_scale [..., ⌈K/bk⌉] per token-group, w_scale
    [⌈N/bn⌉, ⌈K/bk⌉] per block, applied per K block in fp32 (see reference_block.fp8_block_linear)."""
    return _linear_output(x_q, w_q, activation, out_dtype, out_scale, out_fmt)


# ------------------------------------------- MXFP8 (OCP MX: E8M0 scale per 32 along K) and weight-only FP8


@kernel_op(launches="mx_quantize", reference=reference_mx, triton=TritonKernel("mx_quantize"))
def mx_quantize(x: Tensor, fmt: FP8Format = FP8Format.E4M3, round_up: bool = False) -> tuple[Tensor, Tensor]:
    """MX quantization along the last dim (weights [N, K] and dynamic activations alike): (fp8 like x, E8M0 codes
    uint8 [..., ⌈K/32⌉], scale = 2^(code - 127); the exponent rounded down (OCP, saturating) or up (``round_up``:
    nothing saturates); see reference_mx). One launch on Triton; the CPU backend runs the reference's torch ops."""
    return (torch.empty_like(x, dtype=fmt.dtype),
            x.new_empty(_group_scale_shape(x, reference_mx.MX_BLOCK), dtype=torch.uint8))


@kernel_op(launches="fp8_mx_linear", reference=reference_mx, triton=TritonKernel("mx_gemm"))
def fp8_mx_linear(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, *, bias: Tensor | None = None,
                  activation: str | None = None, residual: Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                  out_scale: Tensor | None = None, out_fmt: FP8Format = FP8Format.E4M3) -> Tensor:
    """MXFP8 ``act(x·Wᵀ + bias) + residual``: E8M0 scales x_scale [..., ⌈K/32⌉], w_scale [N, ⌈K/32⌉] (see
    reference_mx.fp8_mx_linear). Triton: ``tl.dot_scaled`` on sm_100, the block GEMM on sm_89/90."""
    return _linear_output(x_q, w_q, activation, out_dtype, out_scale, out_fmt)


@kernel_op(launches="fp8_weight_only_linear", reference=reference_weight_only, fp8_tensor_cores=False,
           triton=TritonKernel("weight_only_gemm"))
def fp8_weight_only_linear(x: Tensor, w_q: Tensor, w_scale: Tensor, *, bias: Tensor | None = None,
                           activation: str | None = None, residual: Tensor | None = None,
                           out_dtype: torch.dtype = torch.float32, out_scale: Tensor | None = None,
                           out_fmt: FP8Format = FP8Format.E4M3) -> Tensor:
    """Weight-only FP8 (W8A16) ``act(x·(w_q·w_scale)ᵀ + bias) + residual``, x high precision, w_scale per channel
    [N] or per tensor (see reference_weight_only). Triton on every CUDA GPU (FP8 decoded to bf16/fp16 in the K loop:
    Ampere's path), the CPU backend's upcasts on the CPU."""
    return _linear_output(x, w_q, activation, out_dtype, out_scale, out_fmt)


TABLE: tuple[KernelOp[Any], ...] = tuple(op for op in list(globals().values()) if isinstance(op, KernelOp))
