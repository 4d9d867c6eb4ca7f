"""Triton FP8 quantization: static scales, and dynamic scales computed from the data on the device.

Semantics are :func:`reference.quantize` / :func:`reference.dynamic_scale`, bit for bit:

* ``q = saturate(x * reciprocal(scale))`` rounded to nearest even, via :func:`round_to_fp8` (never
  Triton's own fp8 cast, see kernels.triton.common). Every reciprocal is computed in the kernel with ``div_rn``
  (:func:`common.reciprocal_rn`: IEEE like torch.reciprocal, not the GPU's fast ``/``), so a static scale
  costs no host-side launch.
* dynamic scales are ``safe_scale(amax)``: ``amax / fmt.max`` (``div_rn``: IEEE like torch on CPU),
  1 when that is 0, clamped to ≥ fp32 tiny. amax ignores non-finite values, as ``reference.amax``.
* NaN in x gives the FP8 NaN byte ``0x7F | sign(x)``, as torch's cast does (``±inf`` saturates to
  ``±fmt.max``; ``-0.0`` keeps its sign). The byte is built from x's sign bit rather than the product's
  because a GPU multiply returns a canonical NaN. With a finite positive scale this equals the
  reference; a scale of 0, inf or NaN is outside the contract.

Inputs of any float dtype and shape: fp32/bf16/fp16 are loaded as they are and widened in registers;
other dtypes (fp64, fp8) are converted with ``x.float()`` first, which is the reference's first step.
Non-contiguous inputs are made contiguous (the reference's ``x.float()`` copies too).
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.triton.common import (
    Kernel,
    cdiv,
    check_device,
    device_function,
    fp8_bits,
    fp8_constants,
    reciprocal_rn,
    round_to_fp8,
)

QUANT_BLOCK = 1024  # elements per program of the elementwise kernels
AMAX_BLOCK = 4096  # elements per program (and per atomic) of the per-tensor amax kernel
TOKEN_BLOCKS = (256, 1024, 4096)  # chunk sizes of the one-program-per-row kernel
LOADED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------------
# device helpers (also used by norm, group_quantize and grouped_gemm)


@device_function
def block_max(x):
    """Max of a 1-d block. ``tl.max`` is a plain jit function the interpreter cannot call without
    TRITON_INTERPRET; ``tl.reduce`` with the standard combiner compiles the same and interprets natively."""
    return tl.reduce(x, 0, tl.standard._elementwise_max)


@device_function
def block_sum(x):
    """Sum of a 1-d block (see :func:`block_max` for why not ``tl.sum``)."""
    return tl.reduce(x, 0, tl.standard._sum_combine)


@device_function
def finite_abs(x):
    """``|x|`` with inf and NaN replaced by 0, like reference.amax (NaN fails the comparison)."""
    a = tl.abs(x)
    return tl.where(a <= 3.4028234663852886e38, a, 0.0)


@device_function
def scale_from_amax(amax, FP8_MAX: tl.constexpr):
    """formats.safe_scale with margin 0: ``amax / FP8_MAX`` rounded as IEEE division, 1 if that is 0
    (all-zero data or underflow), at least fp32 tiny so its reciprocal stays finite."""
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    scale = tl.where((scale > 0) & (scale <= 3.4028234663852886e38), scale, 1.0)
    return tl.maximum(scale, 1.1754943508222875e-38)


@device_function
def quantize_bits(x, inv, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                  EXP_BIAS: tl.constexpr):
    """FP8 bytes (uint8) of fp32 ``x * inv``: saturating round-to-nearest-even, NaN → 0x7F | sign(x)."""
    y = x * inv
    nan = y != y
    y = tl.where(nan, 0.0, y)  # keeps NaN out of fp8_bits' float→int conversion (undefined, warns on CPU)
    code = fp8_bits(round_to_fp8(y, FP8_MAX, MANTISSA_BITS, MIN_NORMAL), MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)
    sign = ((x.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    return tl.where(nan, sign | 0x7F, code)


# ----------------------------------------------------------------------------------------------------
# kernels


def _quantize_kernel(x_ptr, scale_ptr, q_ptr, numel, N, BLOCK: tl.constexpr, PER_ROW: tl.constexpr,
                     FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                     EXP_BIAS: tl.constexpr):
    """Static scale: elementwise over the flat contiguous tensor; the scale is one value or one per row of N."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PER_ROW:
        inv = reciprocal_rn(tl.load(scale_ptr + offs // N, mask=mask, other=1.0))  # a gather that hits cache
    else:
        inv = reciprocal_rn(tl.load(scale_ptr))
    tl.store(q_ptr + offs, quantize_bits(x, inv, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS), mask=mask)


def _amax_kernel(x_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
    """Per-tensor amax, pass 1: each program reduces its block, then one fp32 ``atomic_max`` into a
    zero-initialised scalar. Values are ≥ 0, for which float max is order-independent (deterministic)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, block_max(finite_abs(x)))


def _amax_quantize_kernel(x_ptr, amax_ptr, q_ptr, scale_ptr, numel, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                          MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    """Per-tensor amax, pass 2: every program derives scale and reciprocal from the finished amax (two
    scalar divisions, cheaper than a third launch); program 0 publishes the scale."""
    scale = scale_from_amax(tl.load(amax_ptr), FP8_MAX)
    inv = reciprocal_rn(scale)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, scale)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, quantize_bits(x, inv, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS), mask=mask)


def _token_quantize_kernel(x_ptr, q_ptr, scale_ptr, N, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                           MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    """Per-token scale: one program per row reads the row twice (amax, then quantize; the second read
    mostly hits L2), so any hidden size works with a fixed BLOCK."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N
    q_row = q_ptr + row * N
    cols = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], 0.0, tl.float32)  # tl.zeros is a jit function the interpreter cannot call
    for start in range(0, N, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, finite_abs(x))
    scale = scale_from_amax(block_max(acc), FP8_MAX)
    inv = reciprocal_rn(scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_row + start + cols, quantize_bits(x, inv, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS),
                 mask=mask)


QUANTIZE = Kernel(_quantize_kernel)
AMAX = Kernel(_amax_kernel)
AMAX_QUANTIZE = Kernel(_amax_quantize_kernel)
TOKEN_QUANTIZE = Kernel(_token_quantize_kernel)


# ----------------------------------------------------------------------------------------------------
# host wrappers


@functools.cache
def pick_block(n: int, choices: tuple[int, ...]) -> int:
    """The smallest block holding ``n`` elements, else the largest (the kernel then loops)."""
    return next((b for b in choices if b >= n), choices[-1])


def loadable(x: torch.Tensor) -> torch.Tensor:
    """x contiguous, in a dtype the kernels load directly (others widened to fp32 exactly as the reference)."""
    if x.dtype not in LOADED_DTYPES:
        x = x.float()
    return x.contiguous()


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """``reference.quantize`` on the device: scale is one value (any shape of numel 1) or one per row,
    shaped (..., 1) and broadcasting against x's leading dims. The result has x's shape."""
    check_device(x, scale)
    shape = x.shape
    per_row = scale.numel() != 1
    # one value of no more dims than x broadcasts to x's shape (torch.broadcast_shapes costs microseconds)
    if (per_row or scale.dim() > x.dim()) and torch.broadcast_shapes(shape, scale.shape) != shape:
        raise ValueError(f"scale of shape {tuple(scale.shape)} does not broadcast to x's {tuple(shape)}")
    if per_row and scale.shape[-1] != 1:
        raise ValueError("the Triton quantize takes a per-tensor or per-row (…, 1) scale, not per-column")
    x_c = loadable(x)
    q = torch.empty(shape, dtype=fmt.dtype, device=x.device)
    numel = x.numel()
    if numel == 0:
        return q
    scale = scale if scale.dtype == torch.float32 else scale.float()
    if per_row:  # one per row of x, contiguous (the kernel reads scale[offset // N]); one value: read in place
        scale = scale.expand(*shape[:-1], 1).contiguous()
    QUANTIZE[(cdiv(numel, QUANT_BLOCK),)](x_c, scale, q.view(torch.uint8), numel, shape[-1] if shape else 1,
                                          BLOCK=QUANT_BLOCK, PER_ROW=per_row, **fp8_constants(fmt))
    return q


def dynamic_quantize(x: torch.Tensor, fmt: FP8Format, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with scale == reference.dynamic_scale(x, fmt, per_token) and q == reference.quantize(x,
    scale, fmt), bit for bit. Per token: one launch; per tensor: amax launch + quantize launch."""
    check_device(x)
    numel = x.numel()
    if numel == 0:
        raise ValueError("dynamic quantization needs a non-empty tensor (its amax is undefined)")
    x_c = loadable(x)
    shape, device = x.shape, x.device
    q = torch.empty(shape, dtype=fmt.dtype, device=device)
    consts = fp8_constants(fmt)
    if per_token:
        if not shape:
            raise ValueError("per-token scales need at least one dimension")
        n = shape[-1]
        scale = torch.empty((*shape[:-1], 1), dtype=torch.float32, device=device)
        TOKEN_QUANTIZE[(numel // n,)](x_c, q.view(torch.uint8), scale, n, BLOCK=pick_block(n, TOKEN_BLOCKS), **consts)
        return q, scale
    amax = torch.zeros(1, dtype=torch.float32, device=device)
    scale = torch.empty((), dtype=torch.float32, device=device)
    AMAX[(cdiv(numel, AMAX_BLOCK),)](x_c, amax, numel, BLOCK=AMAX_BLOCK)
    AMAX_QUANTIZE[(cdiv(numel, QUANT_BLOCK),)](x_c, amax, q.view(torch.uint8), scale, numel, BLOCK=QUANT_BLOCK,
                                               **consts)
    return q, scale


# ----------------------------------------------------------------------------------------------------
# ahead-of-time configurations: every (kernel, signature, constexprs) the wrappers above can launch

TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
FORMATS = (FP8Format.E4M3, FP8Format.E5M2)


def aot_signature(kernel: Kernel, types: dict[str, str]) -> dict[str, str]:
    """ASTSource signature in the kernel's argument order: given types, constexpr for the rest."""
    return {name: types.get(name, "constexpr") for name in kernel.jit.arg_names}


def _aot_configs() -> list[tuple[str, str, Kernel, dict, dict]]:
    configs: list[tuple[str, str, Kernel, dict, dict]] = []
    for ty in TRITON_DTYPES.values():
        sig = aot_signature(AMAX, {"x_ptr": f"*{ty}", "amax_ptr": "*fp32", "numel": "i32"})
        configs.append(("amax", f"x={ty} BLOCK={AMAX_BLOCK}", AMAX, sig, {"BLOCK": AMAX_BLOCK}))
        for fmt in FORMATS:
            fp8 = fp8_constants(fmt)
            for per_row in (False, True):
                sig = aot_signature(QUANTIZE, {"x_ptr": f"*{ty}", "scale_ptr": "*fp32", "q_ptr": "*u8", "numel": "i32",
                                            "N": "i32"})
                desc = f"x={ty} {fmt.value} {'per-row' if per_row else 'per-tensor'} BLOCK={QUANT_BLOCK}"
                configs.append(("quantize", desc, QUANTIZE, sig,
                                {"BLOCK": QUANT_BLOCK, "PER_ROW": per_row, **fp8}))
            sig = aot_signature(AMAX_QUANTIZE, {"x_ptr": f"*{ty}", "amax_ptr": "*fp32", "q_ptr": "*u8",
                                             "scale_ptr": "*fp32", "numel": "i32"})
            configs.append(("amax_quantize", f"x={ty} {fmt.value} BLOCK={QUANT_BLOCK}", AMAX_QUANTIZE, sig,
                            {"BLOCK": QUANT_BLOCK, **fp8}))
            for block in TOKEN_BLOCKS:
                sig = aot_signature(TOKEN_QUANTIZE, {"x_ptr": f"*{ty}", "q_ptr": "*u8", "scale_ptr": "*fp32",
                                                  "N": "i32"})
                configs.append(("token_quantize", f"x={ty} {fmt.value} BLOCK={block}", TOKEN_QUANTIZE, sig,
                                {"BLOCK": block, **fp8}))
    return configs


AOT_CONFIGS: list[tuple[str, str, Kernel, dict, dict]] = _aot_configs()
