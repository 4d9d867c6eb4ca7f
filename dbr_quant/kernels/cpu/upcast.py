"""Exact FP8 → bf16 / fp32 upcasts for the CPU backend's GEMMs, and the scratch buffers they write into.

torch's FP8 → bf16/fp32 casts are scalar code (≈1 ms per 0.6 M elements here), and they, not the GEMM, dominated
a naive CPU path. Every FP8 value is exactly representable in bf16 and in fp32, so the upcast is a bit move: one
pass of C where the E4M3 kernels are built (:mod:`dbr_quant.kernels.cpu.e4m3`), else a few vectorized torch ops
on the bits. Both give the same bits. E4M3's NaN code (0x7F/0xFF) comes out as ±480 (NaN input is unsupported on
the fast path); E5M2 keeps NaN and ±inf.
"""

from __future__ import annotations

import threading

import torch

from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3

# 2**120 re-biases the exponent after the bit move (bf16 bias 127 vs E4M3 bias 7). Multiplying in bf16
# is exact and lifts E4M3 subnormals out of bf16's subnormal range, which AVX512-BF16 dot products flush.
_E4M3_REBIAS = 2.0**120

# E4M3's bits moved up by 7 sit where fp16 keeps them (mantissa 7..9, exponent 10..13, sign 15 after the
# sign-extending widen): keep those, clear the copy of the sign in bit 14 (0xBF80 as a signed int16)
_E4M3_FP16_MASK = 0xBF80 - (1 << 16)


def e4m3_to_bf16(q: torch.Tensor, reuse_buffer: bool = False) -> torch.Tensor:
    """Exact E4M3 → bf16 by moving bits: sign to bit 15, exponent+mantissa up by 4, then ×2**120.

    NaN (0x7F/0xFF) is not representable this way and comes out as ±480; quantize() never produces
    NaN from finite input, and NaN input is documented as unsupported on the fast path.
    """
    # int8 × a 1-d int16 tensor promotes to int16: the sign-extending widen and the shift by 4 in one pass
    out = scratch(q.shape, q.device, torch.int16) if reuse_buffer else None
    bits = torch.mul(q.view(torch.int8), _const(16, q.device), out=out)
    bits.bitwise_and_(0x87F0)  # sign bit to 15; clear the copies sign-extension left in bits 11..14
    return bits.view(torch.bfloat16).mul_(_E4M3_REBIAS)


def e4m3_to_fp32(q: torch.Tensor, reuse_buffer: bool = False) -> torch.Tensor:
    """Exact E4M3 → fp32: bits moved into fp16 (a value 2⁻⁸ times too small: biases 15 vs 7), fp16 → fp32
    (a vectorized, exact hardware conversion), ×2**8. Via fp16, not straight into fp32 bits, so E4M3
    subnormals never become fp32 subnormals: the conversion takes fp16 subnormals in hardware, and the
    ×2**8 sees normal numbers only (no denormal-operand assists, no dependence on denormals-are-zero).
    NaN (0x7F/0xFF) comes out as ±480, as in :func:`e4m3_to_bf16`. ``reuse_buffer``: as fp8_to_bf16's."""
    bits = torch.mul(q.view(torch.int8), _const(128, q.device),  # widen and shift by 7 in one pass
                     out=scratch(q.shape, q.device, torch.int16) if reuse_buffer else None)
    halves = bits.bitwise_and_(_E4M3_FP16_MASK).view(torch.float16)
    out = scratch(q.shape, q.device, torch.float32) if reuse_buffer else None
    return (halves.float() if out is None else out.copy_(halves)).mul_(256.0)


_tls = threading.local()


def scratch(shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """A reusable buffer for upcasting weights, so each GEMM does not allocate (and page-fault in)
    a fresh weight-sized temporary. Only without autograd: a GEMM recorded for backward keeps its input.
    The buffer is handed out again at the next call, after the GEMM that read it has finished."""
    if torch.is_grad_enabled() or len(shape) != 2:
        return None
    cache = getattr(_tls, "scratch", None)
    if cache is None:
        cache = _tls.scratch = {}
    key = (tuple(shape), device, dtype)
    buf = cache.get(key)
    if buf is None:
        if len(cache) >= 16:  # bounded: a model has a handful of distinct weight shapes
            cache.clear()
        with torch.inference_mode(False):  # an inference tensor could not be written outside that mode
            buf = cache[key] = torch.empty(shape, dtype=dtype, device=device)
    return buf


_CONSTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _const(value: int, device: torch.device) -> torch.Tensor:
    """A 1-d int16 tensor: int8 × it promotes to int16 (the widen and the multiply in one pass)."""
    t = _CONSTS.get((value, device))
    if t is None:
        t = _CONSTS[(value, device)] = torch.tensor([value], dtype=torch.int16, device=device)
    return t


def fp8_to_bf16(q: torch.Tensor, reuse_buffer: bool = False) -> torch.Tensor:
    """Exact upcast. ``reuse_buffer`` (weights only) writes into a per-shape scratch buffer that the next
    call with that shape overwrites: use it for one operand of one GEMM at a time."""
    if q.dtype == torch.float8_e4m3fn:
        out = scratch(q.shape, q.device, torch.bfloat16) if reuse_buffer else None
        decoded = cpu_e4m3.decode_e4m3(q, torch.bfloat16, out)  # one pass of C where it could be built
        return decoded if decoded is not None else e4m3_to_bf16(q, reuse_buffer)
    return q.to(torch.bfloat16)  # E5M2 is the top byte of fp16; torch's cast is exact


def fp8_to_fp32(q: torch.Tensor, reuse_buffer: bool = False) -> torch.Tensor:
    """Exact upcast to fp32 (``reuse_buffer`` as in :func:`fp8_to_bf16`)."""
    if q.dtype == torch.float8_e4m3fn:
        out = scratch(q.shape, q.device, torch.float32) if reuse_buffer else None
        decoded = cpu_e4m3.decode_e4m3(q, torch.float32, out)
        return decoded if decoded is not None else e4m3_to_fp32(q, reuse_buffer)
    # E5M2 is the top byte of fp16 (inf and NaN included): ×256 after the widen puts it there, and
    # fp16 → fp32 is an exact, vectorized cast
    return q.view(torch.int8).to(torch.int16).mul_(256).view(torch.float16).float()


def fp8_upcast(q: torch.Tensor, dtype: torch.dtype, reuse_buffer: bool = False) -> torch.Tensor:
    """Exact FP8 → ``dtype`` (bf16 or fp32), the GEMM operand of the CPU GEMM path."""
    if dtype == torch.bfloat16:
        return fp8_to_bf16(q, reuse_buffer)
    if dtype == torch.float32:
        return fp8_to_fp32(q, reuse_buffer)
    raise ValueError(f"kernels.cpu.upcast.fp8_upcast: no exact upcast to {dtype}; use torch.bfloat16 or "
                     "torch.float32")
