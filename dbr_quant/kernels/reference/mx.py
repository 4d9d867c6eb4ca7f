"""MXFP8 in plain torch (OCP Microscaling Formats spec v1.0): FP8 elements, one power-of-two scale per 32 along K.

Layout, identical to compressed-tensors' ``MXFP8`` preset (``mxfp8-quantized`` format, 0.20) and vLLM's MXFP8
linears, so checkpoints load without conversion:

* ``x[..., K]`` (an activation, or a weight ``W[N, K]``: its rows are quantized exactly as activation rows) →
  ``fp8[..., K]`` and ``scale[..., ⌈K/32⌉]`` uint8: the E8M0 code of each block's scale, a biased exponent,
  ``scale = 2^(code - 127)``; code 255 is E8M0's NaN and is never written here.

The scale of a block (OCP v1.0 §6.3, "floor" rounding; torchao ``ScaleCalculationMode.FLOOR``, its default):

* ``amax`` = the largest finite |x| of the block (non-finite values ignored, as everywhere in dbr_quant);
* ``exponent = floor(log2(amax)) - emax_elem`` with ``emax_elem = floor(log2(fmt.max))``: 8 for E4M3 (448 =
  1.75·2⁸), 15 for E5M2. ``floor(log2(amax))`` is read from amax's fp32 bits (its exponent field), never from a
  rounded ``log2``: exact for every fp32 value; an fp32 subnormal amax has floor(log2) ≤ -127 and reads as
  -127 (the clamp below gives the same code either way);
* the exponent is clamped to E8M0's finite range [-127, 127] (code 0 … 254); for E4M3 the top is unreachable
  (amax < 2¹²⁸ gives at most 119);
* an all-zero block (amax 0) gets scale 1 (code 127), as ``formats.safe_scale`` gives per-tensor scales.

So ``amax / scale`` lies in [2⁸, 2⁹) = [256, 512) for E4M3: elements above ``448·scale`` (up to 512·scale:
amax with a mantissa above 1.75) **saturate to ±448**, the spec's saturating conversion (torchao clamps the
same way; compressed-tensors rounds amax up to the next power of two when its 3-bit mantissa rounds over,
which moves only those blocks one code up). In about a fifth of the blocks the largest element is clipped, by up
to 12.5 %: on all-MiniLM-L6-v2 that costs more than the finer granularity gains (benchmarks/mx_accuracy.py).

``round_up=True`` ("ceil", torchao's ``RCEIL``: the smallest power-of-two scale that saturates nothing):
``exponent = floor(log2(amax)) - emax_elem + (mantissa(amax) > mantissa(fmt.max))`` — one code up exactly for the
blocks whose amax exceeds ``fmt.max·2^(floor(log2 amax) - emax_elem)`` (mantissa above 1.75 for E4M3 and E5M2),
read from the bits, so ``amax / scale`` lies in (224, 448] and no element saturates. Either rule writes the same
checkpoint layout (only codes are stored).

Quantization is :func:`dense.quantize` with the block's scale broadcast: ``x · (1/scale)``, one fp32 multiply
(exact: 1/scale is a power of two), a clamp to ±fmt.max and torch's cast — the same bits as
``(x * 2**-e).clamp(-448, 448).to(torch.float8_e4m3fn)``.

GEMM semantics (:func:`fp8_mx_linear`): :func:`block.fp8_block_linear` with 1×32 weight blocks and 32-wide
activation groups, the scales decoded to fp32 (exactly): every partial product of a 32-wide K block is exact
FP8·FP8 in fp32, scaled by ``2^(ex + ew)`` (exact) and summed in fp32 in K order. Blackwell's scaled MMA
(``tl.dot_scaled``, tcgen05 ``kind::mxf8f6f4.block_scale``) and the sm_89/90 path (the block GEMM) differ from it
only in the order of the fp32 additions.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.block import expand_group_scale, fp8_block_linear, group_amax
from dbr_quant.kernels.reference.dense import quantize

MX_BLOCK = 32  # OCP MX: one scale per 32 elements along the reduction dimension
MX_WEIGHT_BLOCK = (1, MX_BLOCK)  # a weight's MX blocks as block-scaled (rows, columns) tiles
E8M0_BIAS = 127
E8M0_NAN = 255


def element_emax(fmt: FP8Format) -> int:
    """``floor(log2(fmt.max))``: the exponent of the element format's largest binade (8 for E4M3, 15 for E5M2)."""
    return math.floor(math.log2(FP8Format.parse(fmt).max))


def e8m0_from_amax(amax: torch.Tensor, fmt: FP8Format = FP8Format.E4M3, round_up: bool = False) -> torch.Tensor:
    """The E8M0 code (uint8) of the MX scale of blocks with largest |x| ``amax`` (fp32, ≥ 0, finite): the OCP floor
    rule, or with ``round_up`` the smallest scale that saturates nothing (see the module docstring). amax 0 → 127
    (scale 1)."""
    fmt = FP8Format.parse(fmt)
    a = amax.float()
    bits = a.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - E8M0_BIAS - element_emax(fmt)  # floor(log2 amax) from the exponent field
    if round_up:  # amax's mantissa above the format maximum's: amax > fmt.max·2^exponent, one binade up
        top = torch.tensor(fmt.max / 2.0 ** element_emax(fmt), dtype=torch.float32, device=a.device)  # 1.75
        exponent = exponent + ((bits & 0x7FFFFF) > (top.view(torch.int32) & 0x7FFFFF)).to(exponent.dtype)
    code = exponent.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    return torch.where(a > 0, code, torch.full_like(code, E8M0_BIAS)).to(torch.uint8)


def e8m0_to_float(code: torch.Tensor) -> torch.Tensor:
    """``2^(code - 127)`` in fp32, exactly (code 0 is the fp32 subnormal 2⁻¹²⁷; 255 is NaN)."""
    c = code.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 1 << 22), c << 23)  # 2^-127 has no exponent field of its own
    values = bits.view(torch.float32)
    return torch.where(c == E8M0_NAN, torch.full_like(values, float("nan")), values)


def check_e8m0(scale: torch.Tensor, what: str) -> None:
    if scale.dtype != torch.uint8:
        raise TypeError(f"{what} must hold E8M0 scale codes (torch.uint8, scale = 2^(code - 127)), got {scale.dtype}; "
                        "make them with kernels.mx_quantize")


def mx_quantize(x: torch.Tensor, fmt: FP8Format = FP8Format.E4M3,
                round_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quantization along the last dimension: (fp8 like x, E8M0 codes uint8 [..., ⌈K/32⌉]), the scale exponent
    rounded down (OCP) or, with ``round_up``, up. A trailing block of a K that is not a multiple of 32 uses only its
    real elements. Weights [N, K] and activations alike."""
    fmt = FP8Format.parse(fmt)
    code = e8m0_from_amax(group_amax(x, MX_BLOCK), fmt, round_up)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=fmt.dtype, device=x.device), code
    return quantize(x, expand_group_scale(e8m0_to_float(code), x.shape[-1], MX_BLOCK), fmt), code


def mx_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8 · 2^(code - 127)`` per 32-wide block of the last dimension, in ``dtype``."""
    check_e8m0(scale, "mx_dequantize: scale")
    return (q.float() * expand_group_scale(e8m0_to_float(scale), q.shape[-1], MX_BLOCK)).to(dtype)


def fp8_mx_linear(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                  **epilogue: Any) -> torch.Tensor:
    """MXFP8 ``act(x·Wᵀ + bias) + residual``: x_scale [..., ⌈K/32⌉] and w_scale [N, ⌈K/32⌉] E8M0 codes (from
    :func:`mx_quantize`); gated activations take W as [gate; up] with scales [gate rows; up rows]. The block GEMM
    of :mod:`.block` on the decoded scales (see the module docstring): ``epilogue`` is its keyword arguments (bias,
    activation, residual, out_dtype, out_scale, out_fmt; ``operands`` / ``quantize`` for the CPU backend)."""
    check_e8m0(x_scale, "fp8_mx_linear: x_scale")
    check_e8m0(w_scale, "fp8_mx_linear: w_scale")
    return fp8_block_linear(x_q, e8m0_to_float(x_scale), w_q, e8m0_to_float(w_scale), block=MX_WEIGHT_BLOCK,
                            **epilogue)
