"""Triton LayerNorm / RMSNorm fused with FP8 quantization: one kernel, one program per row.

Matches :func:`reference.layer_norm_quantize` up to fp32 rounding of the statistics (the reference sums
in torch's order, this kernel blockwise): the normalized output is within fp32 rounding of the
reference, and an FP8 byte differs only where that difference flips a rounding boundary (one step).

* Statistics in fp32, two passes (mean, then the sum of squared deviations: no cancellation), then a
  third pass that writes both outputs; rows longer than BLOCK are walked in BLOCK chunks, so any hidden
  size works (re-reads of a row hit L2). ``rstd = 1 / sqrt(var + eps)`` with correctly rounded sqrt and
  division, not the approximate ``rsqrt``.
* RMSNorm: ``x * rstd(mean(x²)) * weight``; bias is ignored, as in the reference.
* The high-precision output has x's dtype; the FP8 output is quantized from the fp32 value before that
  rounding (as the reference quantizes its fp32 result). The static scale is one value (numel 1); its
  reciprocal is computed by torch, as in reference.quantize. A NaN in a row makes the row NaN (both
  outputs; FP8 NaN byte 0x7F | sign), and so does ±inf for LayerNorm; for RMSNorm ±inf gives rstd 0,
  so NaN at the inf and ±0 elsewhere. Same as the reference in every case.
* weight and bias are loaded in x's dtype or fp32 (others, or a mixed pair, are widened to fp32 first).
"""

from __future__ import annotations

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.triton.common import Kernel, check_device, device_function, fp8_constants, reciprocal_rn
from dbr_quant.kernels.triton.gemm_core import fp32
from dbr_quant.kernels.triton.quantize import (
    FORMATS,
    TRITON_DTYPES,
    aot_signature,
    block_sum,
    loadable,
    pick_block,
    quantize_bits,
)

NORM_BLOCKS = (256, 1024, 4096)  # chunk sizes; hidden sizes above 4096 loop (up to 16384 and beyond)


@device_function
def row_stats(x_row, N, eps, BLOCK: tl.constexpr, RMS: tl.constexpr):
    """(mean, rstd) of one row of N values in BLOCK chunks: mean (0 for RMSNorm), then the biased variance
    (RMSNorm: the mean square) from the deviations, so there is no cancellation; rstd = 1 / sqrt(var + eps)."""
    cols = tl.arange(0, BLOCK)
    n = tl.full([], 0.0, tl.float32) + N  # the row length as fp32 for the divisions below
    mean = tl.full([], 0.0, tl.float32)
    if not RMS:
        acc = tl.full([BLOCK], 0.0, tl.float32)  # tl.zeros is a jit function the interpreter cannot call
        for start in range(0, N, BLOCK):
            acc += tl.load(x_row + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
        mean = tl.math.div_rn(block_sum(acc), n)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean, 0.0)
        acc += d * d
    var = tl.math.div_rn(block_sum(acc), n)
    rstd = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(var + eps))
    return mean, rstd


@device_function
def normalize(x, mean, rstd, w_ptr, b_ptr, offs, mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """fp32 ``(x - mean) · rstd · weight + bias`` for the columns ``offs`` of a row."""
    y = (x - mean) * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return y


def _layer_norm_quantize_kernel(x_ptr, w_ptr, b_ptr, scale_ptr, y_ptr, q_ptr, N, eps, BLOCK: tl.constexpr,
                                HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr,
                                FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                                EXP_BIAS: tl.constexpr):
    """One row per program: mean (LayerNorm only), variance or mean square, then y and its FP8 bytes."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N
    cols = tl.arange(0, BLOCK)
    mean, rstd = row_stats(x_row, N, eps, BLOCK, RMS)
    inv = reciprocal_rn(tl.load(scale_ptr))
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = normalize(x, mean, rstd, w_ptr, b_ptr, start + cols, mask, HAS_WEIGHT, HAS_BIAS)
        tl.store(y_ptr + row * N + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(q_ptr + row * N + start + cols, quantize_bits(y, inv, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS),
                 mask=mask)


LAYER_NORM_QUANTIZE = Kernel(_layer_norm_quantize_kernel)


def affine_params(x: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """weight/bias contiguous in one loadable dtype: x's dtype if they both have it, else fp32."""
    params = [p for p in (weight, bias) if p is not None]
    for p in params:
        if p.shape != x.shape[-1:]:
            raise ValueError(f"weight/bias of shape {tuple(p.shape)} do not match the hidden size {x.shape[-1]}")
    dtype = x.dtype if all(p.dtype == x.dtype for p in params) else torch.float32
    def cast(p: torch.Tensor | None) -> torch.Tensor | None:
        return None if p is None else p.to(dtype).contiguous()

    return cast(weight), cast(bias)


def layer_norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor,
    fmt: FP8Format,
    *,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm (or RMSNorm) over the last dim, then FP8 with a static per-tensor scale; returns
    ``(normalized, fp8)`` from one launch. ``normalized`` has x's dtype (fp32 for inputs other than
    fp32/bf16/fp16), where reference.layer_norm_quantize always returns fp32."""
    check_device(x, weight, bias, scale)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError("layer_norm_quantize needs a non-empty last dimension")
    if scale.numel() != 1:
        raise ValueError("the fused norm+quantize takes a per-tensor scale (numel 1)")
    if rms:
        bias = None  # reference.layer_norm_quantize ignores bias for RMSNorm
    x_c = loadable(x)
    weight, bias = affine_params(x_c, weight, bias)
    y = torch.empty(x.shape, dtype=x_c.dtype, device=x.device)
    q = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    if x.numel() == 0:
        return y, q
    n = x.shape[-1]
    LAYER_NORM_QUANTIZE[(x.numel() // n,)](
        x_c, x_c if weight is None else weight, x_c if bias is None else bias, fp32(scale), y, q.view(torch.uint8), n,
        float(eps), BLOCK=pick_block(n, NORM_BLOCKS), HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        RMS=rms, **fp8_constants(fmt))
    return y, q


def _aot_configs() -> list[tuple[str, str, Kernel, dict, dict]]:
    """Every launchable combination: x dtype × affine params (none / weight / bias / both; dtype x's or
    fp32; an absent pointer is x's) × LayerNorm/RMSNorm (RMS never has bias) × format × BLOCK."""
    configs = []
    for x_ty in TRITON_DTYPES.values():
        param_types = sorted({x_ty, "fp32"})
        for rms in (False, True):
            for has_w in (False, True):
                for has_b in (False, True) if not rms else (False,):
                    for p_ty in param_types if (has_w or has_b) else (x_ty,):
                        sig = aot_signature(LAYER_NORM_QUANTIZE, {
                            "x_ptr": f"*{x_ty}", "w_ptr": f"*{p_ty}" if has_w else f"*{x_ty}",
                            "b_ptr": f"*{p_ty}" if has_b else f"*{x_ty}", "scale_ptr": "*fp32", "y_ptr": f"*{x_ty}",
                            "q_ptr": "*u8", "N": "i32", "eps": "fp32"})
                        for fmt in FORMATS:
                            for block in NORM_BLOCKS:
                                desc = (f"x={x_ty} {'rms' if rms else 'layer'}norm weight={has_w} bias={has_b} "
                                        f"params={p_ty} {fmt.value} BLOCK={block}")
                                configs.append(("layer_norm_quantize", desc, LAYER_NORM_QUANTIZE, sig,
                                                {"BLOCK": block, "HAS_WEIGHT": has_w, "HAS_BIAS": has_b, "RMS": rms,
                                                 **fp8_constants(fmt)}))
    return configs


AOT_CONFIGS: list[tuple[str, str, Kernel, dict, dict]] = _aot_configs()
