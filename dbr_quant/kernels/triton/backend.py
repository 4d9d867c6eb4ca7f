"""The ``triton`` / ``triton-interpret`` backend: every kernel entry point mapped to its Triton kernel.

Same signatures as ``reference`` (``reference_block`` for the block-scaled ops). ``dequantize`` (only used
by the high-precision path) stays plain torch.
The kernel modules are imported on first use, so CPU-only users never pay Triton's import cost.
"""

from __future__ import annotations

import importlib

import torch

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference import dense as reference


def _mod(name: str):
    try:
        return importlib.import_module(f"dbr_quant.kernels.triton.{name}")
    except ModuleNotFoundError as e:
        if e.name != "triton" and not (e.name or "").startswith("triton."):
            raise
        raise ImportError(f"dbr_quant.kernels.triton.{name}: the triton backend needs the triton package, which is not "
                          "installed (pip install triton; Linux only), or run the reference backend "
                          "(kernels.use_backend('reference') / DBR_QUANT_BACKEND=reference)") from e


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    return _mod("quantize").quantize(x, scale, fmt)


def dynamic_quantize(x: torch.Tensor, fmt: FP8Format, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _mod("quantize").dynamic_quantize(x, fmt, per_token)


def dynamic_scale(x: torch.Tensor, fmt: FP8Format, per_token: bool) -> torch.Tensor:
    return dynamic_quantize(x, fmt, per_token)[1]


dequantize = reference.dequantize


def fp8_linear(x_q, x_scale, w_q, w_scale, *, bias=None, activation=None, residual=None,
               out_dtype=torch.float32, out_scale=None, out_fmt=FP8Format.E4M3):
    kw = {} if out_scale is None else {"out_scale": out_scale, "out_fmt": out_fmt}
    return _mod("gemm").fp8_linear(x_q, x_scale, w_q, w_scale, bias=bias, activation=activation,
                                          residual=residual, out_dtype=out_dtype, **kw)


def fp8_matmul(a_q, a_scale, b_q, b_scale):
    return _mod("gemm").fp8_matmul(a_q, a_scale, b_q, b_scale)


def fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, *, attn_mask=None, is_causal=False,
                  softmax_scale=None, p_scale=None, fmt=FP8Format.E4M3):
    return _mod("attention").fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, attn_mask=attn_mask,
                                                  is_causal=is_causal, softmax_scale=softmax_scale,
                                                  p_scale=p_scale, fmt=fmt)


def layer_norm_quantize(x, weight, bias, eps, scale, fmt, *, rms=False):
    return _mod("norm").layer_norm_quantize(x, weight, bias, eps, scale, fmt, rms=rms)


def fp8_grouped_linear(x_q, x_scale, w_q, w_scale, routing, *, x_sorted=False, bias=None, activation=None,
                       out_dtype=torch.float32, out_scale=None, out_fmt=FP8Format.E4M3, topk_weights=None,
                       deterministic=False):
    return _mod("grouped_gemm").fp8_grouped_linear(
        x_q, x_scale, w_q, w_scale, routing, x_sorted=x_sorted, bias=bias, activation=activation,
        out_dtype=out_dtype, out_scale=out_scale, out_fmt=out_fmt, topk_weights=topk_weights,
        deterministic=deterministic)


def moe_quantize(x, x_scale, routing, fmt):
    return _mod("grouped_gemm").moe_quantize(x, x_scale, routing, fmt)
def group_quantize(x: torch.Tensor, group: int, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    return _mod("group_quantize").group_quantize(x, group, fmt)


def layer_norm_group_quantize(x, weight, bias, eps, group, fmt, *, rms=False):
    return _mod("group_quantize").layer_norm_group_quantize(x, weight, bias, eps, group, fmt, rms=rms)


def fp8_block_linear(x_q, x_scale, w_q, w_scale, *, block, bias=None, activation=None, residual=None,
                     out_dtype=torch.float32, out_scale=None, out_fmt=FP8Format.E4M3):
    return _mod("block_gemm").fp8_block_linear(x_q, x_scale, w_q, w_scale, block=block, bias=bias,
                                                      activation=activation, residual=residual, out_dtype=out_dtype,
                                                      out_scale=out_scale, out_fmt=out_fmt)
