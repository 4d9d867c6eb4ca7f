"""Error bounds the GPU tests check against, and the figures they record (make gpu-check's report).

Hopper's FP8 tensor cores add products at reduced precision (about 14 bits); the kernels promote each K step's
partial sum to the fp32 accumulator (see dbr_quant.kernels.triton.gemm_core.main_loop), so a GEMM output is
within the fp32 reordering bound plus one 2^-13 rounding of Σ|products| of the reference's exact-product fp32
sum. ``magnitudes`` takes the dequantized operands' |products| for any scale layout.
"""

from __future__ import annotations

import os

import torch

from dbr_quant import kernels


def magnitudes(x_q, x_scale, w_q, w_scale) -> torch.Tensor:
    """Σ|products| of each output, scaled: what an accumulation error is measured against."""
    return x_q.float().abs() @ w_q.float().abs().t() * (x_scale * w_scale.reshape(1, -1)).abs()


GEMM_ERROR = 2.0 ** -22 + 2.0 ** -13  # per Σ|products|, beside K·2⁻²⁴: the scaling's fp32 rounding, the TC step


def gemm_bound(x_q, x_scale, w_q, w_scale) -> torch.Tensor:
    """|difference| from the reference's fp32 sum: two fp32 accumulations of the same products in different
    orders differ by at most K·2⁻²⁴ of Σ|products| (plus the fp32 rounding of the scaling); each 32-product
    FP8 tensor-core step rounds its partial sum (≤ Σ|products|) once more at 2⁻¹³ (14 bits kept)."""
    return magnitudes(x_q, x_scale, w_q, w_scale) * (x_q.shape[-1] * 2.0 ** -24 + GEMM_ERROR) + 1e-30


def gemm_error(k: int, fp8_mma: bool = True) -> float:
    """The per-Σ|products| difference of a K-long GEMM from the reference's fp32 sum: FP8 MMA as
    :func:`gemm_bound`; bf16/fp16 MMA (the weight-only kernels: products exact in fp32) adds in fp32 with at
    most a truncated ulp per addition (K·2⁻²³; tensor cores align to the largest exponent and truncate), the
    reference's cuBLAS fp32 GEMM K·2⁻²⁴ more, and the scale on the accumulator 2⁻²²."""
    return k * 2.0**-24 + GEMM_ERROR if fp8_mma else k * (2.0**-23 + 2.0**-24) + 2.0**-22


def dequantized_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`gemm_bound` from dequantized operands (any scale layout: per block, MX)."""
    return x.float().abs() @ w.float().abs().t() * (x.shape[-1] * 2.0 ** -24 + GEMM_ERROR) + 1e-30


def carry_bound(b: torch.Tensor, pre: torch.Tensor, activation: str | None) -> torch.Tensor:
    """A bound ``b`` on the pre-activation outputs ``pre`` (bias added) carried through the activation: the
    activations' slopes are at most 1.13 (GELU's largest), so 1.2·b; swiglu's act(g)·u ([gate; up] halves) moves
    by ≤ 1.2·Bg·(|u| + Bu) + |act(g)|·Bu. Plus 2⁻²⁰ of the value for the epilogue's own fp32 rounding (scale,
    bias, activation in another order or libm)."""
    if activation != "swiglu":
        return 1.2 * b + 2.0 ** -20 * pre.abs() + 1e-6
    n = pre.shape[-1] // 2
    gate, up, bg, bu = pre[..., :n], pre[..., n:], b[..., :n], b[..., n:]
    act = torch.nn.functional.silu(gate)
    return 1.2 * bg * (up.abs() + bu) + act.abs() * bu + 2.0 ** -20 * (act * up).abs() + 1e-6


def decode_once_bound(x_mma: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, pre: torch.Tensor,
                      activation: str | None) -> torch.Tensor:
    """The weight-only linear's decode-once (prefill) path against the reference, as weight_only_gemm's docstring
    derives it: each decoded ``w_q·w_scale`` and the GEMM's sum rounded to x's dtype (u = 2⁻⁹ bf16, 2⁻¹¹ fp16) and
    the fp32 sum reordered, (2u + K·2⁻²³)·Σ|x|·|w_q·w_scale| (+ 2⁻²⁴·(Σ|x| + 1) for fp16's subnormals), carried
    through the activation (:func:`carry_bound`; ``pre``: the reference's pre-activation output, bias added)."""
    u = 2.0**-9 if x_mma.dtype == torch.bfloat16 else 2.0**-11
    x = x_mma.double().abs().reshape(-1, x_mma.shape[-1])
    w = (w_q.double() * w_scale.double().reshape(-1, 1)).abs()
    b = (2 * u + x.shape[-1] * 2.0**-23) * (x @ w.t())
    if x_mma.dtype == torch.float16:
        b = b + 2.0**-24 * (x.sum(-1, keepdim=True) + 1)
    return carry_bound(b, pre.double().reshape(b.shape), activation)


def epilogue_bound(x_q, x_scale, w_q, w_scale, bias, activation) -> torch.Tensor:
    """:func:`gemm_bound` carried through bias + activation (:func:`carry_bound`)."""
    with kernels.use_backend("reference"):
        pre = kernels.fp8_linear(x_q, x_scale, w_q, w_scale, bias=bias, out_dtype=torch.float32)
    return carry_bound(gemm_bound(x_q, x_scale, w_q, w_scale), pre, activation)


def record(name: str, value: float) -> None:
    """Append a measured figure to $DBR_GPU_STATS (make gpu-check puts it in the report)."""
    path = os.environ.get("DBR_GPU_STATS")
    if path:
        with open(path, "a") as f:
            f.write(f"{name}\t{value:.3e}\n")
