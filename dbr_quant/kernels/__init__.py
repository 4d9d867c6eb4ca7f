"""FP8 kernels behind one dispatch point.

Every quantized subgraph calls one of the entry points below. Each entry point counts a launch (see
:func:`count_launches`) and runs the implementation of the current backend (:func:`current_backend`;
``$DBR_QUANT_BACKEND`` or :func:`use_backend`). This release ships the ``reference`` backend (plain
torch, exact FP8 semantics, the CPU default; its GEMMs run in bf16 or fp32, see :mod:`.cpu` and
:func:`use_cpu_gemm`); the Triton backends plug into the same entry points.
"""

from __future__ import annotations

import torch

from ..formats import FP8Format
from . import reference
from .cpu import current_gemm_path, use_cpu_gemm
from .dispatch import (
    BACKENDS,
    count_launches,
    current_backend,
    graph_ops,
    record_launch,
    resolve_backend,
    use_backend,
)

__all__ = [
    "BACKENDS", "count_launches", "current_backend", "resolve_backend", "use_backend", "current_gemm_path",
    "use_cpu_gemm",
    "quantize", "dynamic_quantize", "dequantize", "dynamic_scale", "fp8_linear", "fp8_mlp", "fp8_matmul",
    "fp8_attention", "layer_norm_quantize",
]


def _impl(t: torch.Tensor):
    """The implementation module for the backend that runs on ``t``'s device."""
    if resolve_backend(t.device) == "reference":
        return reference
    from . import triton_backend

    return triton_backend


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    if (ops := graph_ops()) is not None:
        return ops.quantize(x, scale, fmt)
    record_launch("quantize")
    return _impl(x).quantize(x, scale, fmt)


def dynamic_quantize(x: torch.Tensor, fmt: FP8Format, per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with a scale computed from ``x`` itself (per tensor, or per row of the last dim), in one
    launch where the backend can: returns (fp8, scale)."""
    if (ops := graph_ops()) is not None:
        return ops.dynamic_quantize(x, fmt, per_token)
    record_launch("dynamic_quantize")
    return _impl(x).dynamic_quantize(x, fmt, per_token)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if (ops := graph_ops()) is not None:
        return ops.dequantize(q, scale, dtype)
    record_launch("dequantize")
    return _impl(q).dequantize(q, scale, dtype)


def dynamic_scale(x: torch.Tensor, fmt: FP8Format, per_token: bool = False) -> torch.Tensor:
    if (ops := graph_ops()) is not None:
        return ops.dynamic_scale(x, fmt, per_token)
    record_launch("amax")
    return _impl(x).dynamic_scale(x, fmt, per_token)


def fp8_linear(x_q, x_scale, w_q, w_scale, *, bias=None, activation=None, residual=None,
               out_dtype=torch.float32, out_scale=None, out_fmt=FP8Format.E4M3) -> torch.Tensor:
    """``act(x·Wᵀ·sx·sw + bias) + residual`` on FP8 operands, FP8 out when ``out_scale`` is given
    (see reference.fp8_linear)."""
    if (ops := graph_ops()) is not None:
        return ops.fp8_linear(x_q, x_scale, w_q, w_scale, bias=bias, activation=activation, residual=residual,
                              out_dtype=out_dtype, out_scale=out_scale, out_fmt=out_fmt)
    record_launch("fp8_linear")
    return _impl(x_q).fp8_linear(x_q, x_scale, w_q, w_scale, bias=bias, activation=activation,
                              residual=residual, out_dtype=out_dtype, out_scale=out_scale, out_fmt=out_fmt)


def fp8_mlp(x_q, x_scale, w1_q, w1_scale, b1, activation, h_scale, h_fmt, w2_q, w2_scale, b2, residual,
            out_dtype=torch.float32) -> torch.Tensor:
    """An MLP's two GEMMs, FP8 between them: fc1's epilogue applies the activation (gated ones take a
    stacked [gate; up] w1) and quantizes with fc2's input scale ``h_scale``; fc2's adds bias and residual.
    Two launches; one graph node (``dbr_quant::fp8_mlp``) when captured."""
    if (ops := graph_ops()) is not None:
        return ops.fp8_mlp(x_q, x_scale, w1_q, w1_scale, b1, activation, h_scale, h_fmt, w2_q, w2_scale, b2,
                           residual, out_dtype)
    h = fp8_linear(x_q, x_scale, w1_q, w1_scale, bias=b1, activation=activation, out_dtype=out_dtype,
                   out_scale=h_scale, out_fmt=h_fmt)
    return fp8_linear(h, h_scale, w2_q, w2_scale, bias=b2, residual=residual, out_dtype=out_dtype)


def layer_norm_quantize(x, weight, bias, eps, scale, fmt, *, rms=False) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm / RMSNorm over the last dim and FP8 quantization in one kernel: (normalized, fp8)."""
    if (ops := graph_ops()) is not None:
        return ops.layer_norm_quantize(x, weight, bias, eps, scale, fmt, rms=rms)
    record_launch("norm_quantize")
    return _impl(x).layer_norm_quantize(x, weight, bias, eps, scale, fmt, rms=rms)


def fp8_matmul(a_q, a_scale, b_q, b_scale) -> torch.Tensor:
    if (ops := graph_ops()) is not None:
        return ops.fp8_matmul(a_q, a_scale, b_q, b_scale)
    record_launch("fp8_matmul")
    return _impl(a_q).fp8_matmul(a_q, a_scale, b_q, b_scale)


def fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, *, attn_mask=None, is_causal=False,
                  softmax_scale=None, p_scale=None, fmt=FP8Format.E4M3) -> torch.Tensor:
    if (ops := graph_ops()) is not None:
        return ops.fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, attn_mask=attn_mask, is_causal=is_causal,
                                 softmax_scale=softmax_scale, p_scale=p_scale, fmt=fmt)
    record_launch("fp8_attention")
    return _impl(q_q).fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, attn_mask=attn_mask,
                                 is_causal=is_causal, softmax_scale=softmax_scale, p_scale=p_scale, fmt=fmt)
