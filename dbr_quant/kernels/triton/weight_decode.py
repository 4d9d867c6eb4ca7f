"""Triton E4M3 weight decode: FP8 bytes → ``w_q · w_scale`` in bf16/fp16, once per call, for the cuBLAS prefill path.

The weight-only linear (:mod:`.weight_only_gemm`) decodes FP8 inside its K loop, once per BLOCK_M-row tile of the
output: at prefill (hundreds of rows) that integer work competes with the bf16 MMA on Ampere. Above
``weight_only_gemm.DECODE_ONCE_ABOVE_M`` rows the wrapper instead decodes the weight once with this kernel and hands
it to cuBLAS (``torch.matmul``). Semantics: :func:`dbr_quant.kernels.reference.dense.dequantize` with ``dtype``
bf16/fp16, bit for bit:

* the byte is decoded exactly to fp32 by bit moves (:func:`decode_e4m3`: no FP8 type involved, which sm_80 lacks;
  E4M3's NaN code reads as ±480, as the CPU backend's upcasts do — weights never hold it), then multiplied by its
  channel's (or the tensor's) fp32 scale: one fp32 rounding, the reference's ``q.float() * s``;
* rounded once to the output dtype, nearest even: bf16 with integer ops (Triton 3.7's interpreter truncates in its
  fp32→bf16 cast; the GPU's ``cvt.rn.bf16.f32`` gives the same bits), fp16 with the cast (``cvt.rn.f16.f32``;
  numpy's in the interpreter), subnormals included.
"""

from __future__ import annotations

import torch
import triton.language as tl

from dbr_quant.kernels.triton.common import AotEntry, Kernel, cdiv, check_device, device_function
from dbr_quant.kernels.triton.quantize import aot_signature

__all__ = ["AOT_CONFIGS", "decode_e4m3", "decode_weight"]

BLOCK_N, BLOCK_K = 32, 128  # a [32, 128] tile per program: 4 KB of FP8 in, 8 KB of bf16 out, rows coalesced along K
NUM_WARPS = 8  # 16 elements per thread: ~80 registers, so enough warps per SM stream the bytes
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension (the K tiles)
DECODED_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@device_function
def decode_e4m3(bits):
    """E4M3 bytes (uint8) → their values in fp32, exactly: normal codes by moving exponent and mantissa into an
    fp32 bit pattern (exponent + 120 rebiases 7 → 127), subnormals as m·2⁻⁹ (no fp32 subnormal, so no
    flush-to-zero question), then the sign bit by an integer or (Triton's unary minus is 0 - x: -0.0 would read
    +0.0)."""
    b = bits.to(tl.uint32)
    exponent = (b >> 3) & 0xF
    normal = (((b & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, (b & 0x7).to(tl.float32) * 0.001953125, normal)
    return (magnitude.to(tl.uint32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@device_function
def round_to_bf16(y):
    """fp32 → bf16, round to nearest even, by integer ops on the bits (finite y; a carry into the exponent is the
    correct result, up to inf past bf16's largest value)."""
    b = y.to(tl.uint32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def _decode_weight_kernel(w_ptr, scale_ptr, out_ptr, N, K, stride_wn, stride_on, stride_s,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_BF16: tl.constexpr):
    """out[n, k] = round(decode(w[n, k]) · s[n]): W [N, K] E4M3 bytes (unit stride along K), s per channel
    (stride_s 1) or per tensor (0), out [N, K] bf16 (OUT_BF16) or fp16."""
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = rn < N
    mask = mask_n[:, None] & (rk < K)[None, :]
    bits = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0)
    scale = tl.load(scale_ptr + rn * stride_s, mask=mask_n, other=1.0)
    y = decode_e4m3(bits) * scale[:, None]
    out_ptrs = out_ptr + rn[:, None] * stride_on + rk[None, :]
    if OUT_BF16:
        tl.store(out_ptrs, round_to_bf16(y), mask=mask)
    else:
        tl.store(out_ptrs, y.to(tl.float16), mask=mask)


# the scale stride (0 per tensor, 1 per channel) would double the variants
DECODE_WEIGHT = Kernel(_decode_weight_kernel, ("stride_s",))


def decode_weight(w_q: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(w_q.float() · w_scale).to(dtype)`` in one launch: w_q float8_e4m3fn [N, K], w_scale one value or [N] fp32,
    dtype bf16 or fp16 (``reference.dense.dequantize`` bit for bit, see the module docstring)."""
    check_device(w_q, w_scale)
    if dtype not in DECODED_DTYPES:
        raise TypeError(f"decode_weight: decodes to bf16 or fp16 (the MMA dtypes), got {dtype}")
    if w_q.dtype != torch.float8_e4m3fn or w_q.dim() != 2:
        raise TypeError(f"decode_weight: w_q must be a float8_e4m3fn matrix [N, K], got {w_q.dtype} "
                        f"{tuple(w_q.shape)}")
    n, k = w_q.shape
    scale = w_scale.detach().float().reshape(-1)
    if scale.numel() not in (1, n):
        raise ValueError(f"decode_weight: w_scale must be one value or one per row ({n}), got {tuple(w_scale.shape)}")
    w_bytes = (w_q if w_q.stride(1) == 1 else w_q.contiguous()).view(torch.uint8)
    out = torch.empty(n, k, dtype=dtype, device=w_q.device)
    k_tiles = cdiv(k, BLOCK_K)
    if k_tiles > MAX_GRID_Y:
        raise ValueError(f"decode_weight: K = {k} needs {k_tiles} programs along K, more than the CUDA grid's "
                         f"{MAX_GRID_Y}")
    if n and k:
        DECODE_WEIGHT[(cdiv(n, BLOCK_N), k_tiles)](
            w_bytes, scale, out, n, k, w_bytes.stride(0), out.stride(0), 0 if scale.numel() == 1 else 1,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, OUT_BF16=dtype == torch.bfloat16, num_warps=NUM_WARPS)
    return out


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time rows, for Ampere (tagged sm_80, like the fused weight-only kernel: the dispatcher runs the
# weight-only path where FP8 tensor cores are missing; elsewhere the JIT compiles it when asked for)


def _aot_configs() -> list[AotEntry]:
    configs: list[AotEntry] = []
    for ty in DECODED_DTYPES.values():
        sig = aot_signature(DECODE_WEIGHT, {"w_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": f"*{ty}", "N": "i32",
                                            "K": "i32", "stride_wn": "i32", "stride_on": "i32", "stride_s": "i32"})
        desc = f"out={ty} {BLOCK_N}x{BLOCK_K} warps={NUM_WARPS} | sm_80"
        configs.append(("decode_weight", desc, DECODE_WEIGHT, sig,
                        {"BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "OUT_BF16": ty == "bf16"}))
    return configs


AOT_CONFIGS: list[AotEntry] = _aot_configs()
