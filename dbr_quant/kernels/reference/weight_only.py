"""Weight-only FP8 (W8A16) in plain torch: FP8 weights, activations as they come (fp32 / bf16 / fp16).

The layout vLLM's ``CompressedTensorsW8A16Fp8`` reads (compressed-tensors weights ``float`` with strategy
``channel`` or ``tensor``, no ``input_activations``): ``w_q`` float8_e4m3fn [N, K] and ``w_scale`` fp32 [N] per
output channel, or 0-d per tensor. It is the FP8 checkpoint for GPUs without FP8 tensor cores (Ampere: vLLM runs
it through Marlin) and the memory-bound decode case: the weight bytes halve, the activations stay exact.

Semantics (the ground truth of the CPU and Triton paths): ``acc = x · w_qᵀ`` with the exact FP8 values and x in
fp32, accumulated in fp32; ``y = acc · w_scale + bias`` (the scale on the accumulator, as the FP8 GEMMs), then
:func:`dense.linear_epilogue` (activation incl. gated [gate; up], residual, output dtype or FP8 out). Fast paths:

* Triton (``kernels/triton/weight_only_gemm.py``, sm_80+): W decoded FP8 → x's dtype inside the K loop (exact:
  every E4M3 value is a bf16 and an fp16 value), bf16/fp16 MMA with fp32 accumulation: the same numbers up to
  the order of the fp32 additions for bf16/fp16 x; fp32 x is rounded to bf16 first (relative 2⁻⁹ per element).
* CPU (``kernels/cpu/backend.py``): bf16 x on the bf16 GEMM path: W upcast exactly, the accumulator scaled as
  here (the GEMM's result rounded once to bf16); otherwise an fp32 GEMM on W dequantized first (``q·s``, one
  rounding per weight: compressed-tensors' order), within about an fp32 ulp of |x|·|w| per term.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.dense import Quantize, dequantize_accumulator, linear_epilogue, quantize

# (x, w_q, w_scale as one value or [N], bias) → the fp32 ``x·(w_q·w_scale)ᵀ + bias``: here exact (the accumulator
# scaled); the CPU backend passes its upcasts and GEMM dtype
WeightOnlyGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def exact_gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x·w_qᵀ`` in fp32 on the exact FP8 values, then ``· w_scale + bias`` on the accumulator."""
    return dequantize_accumulator(F.linear(x.float(), w_q.float()), w_scale, bias)


def check_weight_only(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> None:
    """A ValueError naming the tensor for operands :func:`fp8_weight_only_linear` does not take."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"fp8_weight_only_linear: x must be fp32, bf16 or fp16 (activations stay high precision), "
                        f"got {x.dtype}")
    if w_q.dim() != 2 or w_q.shape[1] != x.shape[-1]:
        raise ValueError(f"fp8_weight_only_linear: w_q must be N×K with K = {x.shape[-1]}, got {tuple(w_q.shape)}")
    if w_scale.numel() not in (1, w_q.shape[0]):
        raise ValueError(f"fp8_weight_only_linear: w_scale must be one value (per tensor) or one per output channel "
                         f"({w_q.shape[0]}), got shape {tuple(w_scale.shape)}")


def fp8_weight_only_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    out_scale: torch.Tensor | None = None,
    out_fmt: FP8Format = FP8Format.E4M3,
    gemm: WeightOnlyGemm = exact_gemm,
    quantize: Quantize = quantize,
) -> torch.Tensor:
    """``act(x·(w_q·w_scale)ᵀ + bias) + residual`` with x high precision (see the module docstring). ``gemm`` and
    ``quantize`` are swappable (the CPU backend passes its upcasts and its C quantize)."""
    check_weight_only(x, w_q, w_scale)
    y = gemm(x, w_q, w_scale.reshape(-1) if w_scale.dim() else w_scale, bias)
    return linear_epilogue(y, activation, residual, out_dtype, out_scale, FP8Format.parse(out_fmt), quantize)
