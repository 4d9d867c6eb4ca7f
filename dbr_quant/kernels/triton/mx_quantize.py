"""Triton MX quantization (OCP MX v1.0): FP8 elements, one E8M0 scale per 32 along the last dim, one launch.

Semantics are :func:`dbr_quant.kernels.reference.mx.mx_quantize`, bit for bit (bytes and codes):

* a block's amax ignores non-finite values (:func:`quantize.finite_abs`; max is order-independent, so exact);
* its exponent ``floor(log2 amax) - emax_elem`` is read from amax's fp32 exponent field (integer ops, no
  ``log2``), with ``ROUND_UP`` one up where amax's mantissa exceeds the format maximum's (1.75 for E4M3 and E5M2),
  clamped to E8M0's [-127, 127]; an all-zero block gets code 127 (scale 1);
* the elements are multiplied by ``2^(127 - code)``, built from its bits (the reference's ``reciprocal`` of a power
  of two: exact, 2⁻¹²⁷ as the fp32 subnormal it is), then :func:`quantize.quantize_bits`: rounded onto the FP8 grid
  in fp32 and saturated (Triton's own float→fp8 cast drops a carry in the interpreter, see kernels.triton.common);
  NaN → the FP8 NaN byte, ±inf → ±fmt.max.

One program quantizes ``BLOCK_ROWS`` rows × ``BLOCKS`` MX blocks, held as a [rows, blocks, 32] tile: each block's
amax is a reduction along the last axis, so the block is read once (amax and quantize from registers) and the rows'
``BLOCKS·32`` consecutive elements load coalesced. A K that is not a multiple of 32 masks the trailing block to its
real elements (zeros never raise an amax), as the reference pads. Inputs of any float dtype and shape:
fp32/bf16/fp16 load as they are, others go through ``x.float()`` first (:func:`quantize.loadable`).
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.mx import E8M0_BIAS, MX_BLOCK, element_emax
from dbr_quant.kernels.triton.common import AotEntry, Kernel, cdiv, check_device, device_function, fp8_constants
from dbr_quant.kernels.triton.quantize import FORMATS, TRITON_DTYPES, aot_signature, finite_abs, loadable, quantize_bits

BLOCK_ROWS = 16  # rows per program
BLOCKS = 4  # MX blocks per row per program: 128 consecutive elements (256 B of bf16) per row
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension (the K tiles)
AOT_ARCHES = ("sm_89", "sm_90", "sm_100")  # every GPU an MX linear runs Triton on: its activations come through here


@device_function
def widen(x):
    """x in fp32, exactly. bf16 by moving its bits up: Triton 3.7's interpreter converts bf16 subnormals wrongly
    (2⁻¹³⁰ reads as -1.5), the shift is exact everywhere and is what the GPU's conversion does."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


def _mx_quantize_kernel(x_ptr, q_ptr, code_ptr, M, K, KB, BLOCK_ROWS: tl.constexpr, BLOCKS: tl.constexpr,
                        EMAX: tl.constexpr, ROUND_UP: tl.constexpr, TOP_MANTISSA: tl.constexpr,
                        FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                        EXP_BIAS: tl.constexpr):
    """Program (i, j): rows i·BLOCK_ROWS …, MX blocks j·BLOCKS … . x and q contiguous [M, K], codes [M, KB] uint8
    (KB = ⌈K/32⌉)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    cols = blocks[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]  # [1, BLOCKS, 32]
    row_ok = rows < M
    mask = row_ok[:, None, None] & (cols < K)
    offs = rows[:, None, None] * K + cols
    x = widen(tl.load(x_ptr + offs, mask=mask, other=0.0))
    amax = tl.reduce(finite_abs(x), 2, tl.standard._elementwise_max)  # [BLOCK_ROWS, BLOCKS], ≥ 0 and finite
    bits = amax.to(tl.uint32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - (127 + EMAX)  # floor(log2 amax) - emax_elem
    if ROUND_UP:  # amax > fmt.max·2^exponent: one binade up, so nothing saturates
        exponent += ((bits & 0x7FFFFF) > TOP_MANTISSA).to(tl.int32)
    code = tl.minimum(tl.maximum(exponent, -127), 127) + 127
    code = tl.where(amax > 0, code, 127)
    inv_field = 254 - code  # the fp32 exponent field of 2^(127 - code); 0 is 2⁻¹²⁷, the subnormal 1 << 22
    inv = tl.where(inv_field == 0, 1 << 22, inv_field << 23).to(tl.uint32).to(tl.float32, bitcast=True)
    q = quantize_bits(x, inv[:, :, None], FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)
    tl.store(q_ptr + offs, q, mask=mask)
    code_offs = rows[:, None] * KB + blocks[None, :]
    tl.store(code_ptr + code_offs, code.to(tl.uint8), mask=row_ok[:, None] & (blocks[None, :] < KB))


MX_QUANTIZE = Kernel(_mx_quantize_kernel)


def format_constexprs(fmt: FP8Format, round_up: bool) -> dict[str, object]:
    """The kernel's format constexprs: the element format's emax, the rounding rule and fmt.max's fp32 mantissa
    field (``fmt.max / 2^emax`` is 1.75 for E4M3 and E5M2: a dyadic number, so the product below is exact)."""
    emax = element_emax(fmt)
    top = int((fmt.max / 2.0**emax - 1.0) * 2**23)
    return {"EMAX": emax, "ROUND_UP": bool(round_up), "TOP_MANTISSA": top, **fp8_constants(fmt)}


def mx_quantize(x: torch.Tensor, fmt: FP8Format = FP8Format.E4M3,
                round_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.mx.mx_quantize`` on the device, one launch: (fp8 like x, E8M0 codes uint8 [..., ⌈K/32⌉])."""
    check_device(x)
    fmt = FP8Format.parse(fmt)
    if x.dim() == 0:
        raise ValueError("mx_quantize: x needs at least one dimension (the channels, along which the 32-wide MX "
                         "blocks run); reshape a scalar to [1]")
    k = x.shape[-1]
    kb = math.ceil(k / MX_BLOCK)
    k_tiles = cdiv(kb, BLOCKS)
    if k_tiles > MAX_GRID_Y:
        raise ValueError(f"mx_quantize: a last dimension of {k} needs {k_tiles} programs along K, more than the CUDA "
                         f"grid's {MAX_GRID_Y}; split the tensor along its last dimension")
    q = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    code = torch.empty(*x.shape[:-1], kb, dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        code.fill_(E8M0_BIAS)  # an empty block's amax is 0: scale 1, as the reference
        return q, code
    m = x.numel() // k
    MX_QUANTIZE[(cdiv(m, BLOCK_ROWS), k_tiles)](
        loadable(x), q.view(torch.uint8), code, m, k, kb,
        BLOCK_ROWS=BLOCK_ROWS, BLOCKS=BLOCKS, **format_constexprs(fmt, round_up))
    return q, code


# ----------------------------------------------------------------------------------------------------
# ahead-of-time configurations: every (dtype, format, rounding) the wrapper launches, for sm_89, sm_90 and sm_100


def _aot_configs() -> list[AotEntry]:
    configs: list[AotEntry] = []
    for x_ty in TRITON_DTYPES.values():
        sig = aot_signature(MX_QUANTIZE, {"x_ptr": f"*{x_ty}", "q_ptr": "*u8", "code_ptr": "*u8", "M": "i32",
                                          "K": "i32", "KB": "i32"})
        for fmt in FORMATS:
            for round_up in (False, True):
                desc = (f"x={x_ty} {fmt.value} round={'ceil' if round_up else 'floor'} rows={BLOCK_ROWS} "
                        f"blocks={BLOCKS} | {' '.join(AOT_ARCHES)}")
                configs.append(("mx_quantize", desc, MX_QUANTIZE, sig,
                                {"BLOCK_ROWS": BLOCK_ROWS, "BLOCKS": BLOCKS, **format_constexprs(fmt, round_up)}))
    return configs


AOT_CONFIGS: list[AotEntry] = _aot_configs()
