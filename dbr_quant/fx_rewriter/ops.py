"""``torch.library`` ops (namespace ``dbr_quant``, registered by ``oplib.define``): the FP8 kernels as opaque
graph leaves.

Each op runs the same kernel dispatch as eager (``dbr_quant.kernels``) and has a fake implementation
that only computes the output's shape and dtype, so ``torch.export`` and ``torch.compile`` trace them
as single nodes. :class:`GraphOps` is the table that kernel entry points call while a graph is
captured (see ``kernels.dispatch.capture_with``). A gradient reaching any op is a clear error (``oplib``):
straight-through gradients go around them, through ``dbr_quant::straight_through`` (straight_through.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.fx_rewriter.moe_ops import graph_fp8_moe_experts
from dbr_quant.fx_rewriter.oplib import define
from dbr_quant.kernels.cpu import upcast
from dbr_quant.kernels.reference.dense import GATED

_FORMATS = {f.value: f for f in FP8Format}


def _fmt(name: str) -> FP8Format:
    """The format an op's ``fmt`` string names (a dict look-up: this runs on every op call)."""
    fmt = _FORMATS.get(name)
    return fmt if fmt is not None else FP8Format.parse(name)


@define("quantize")
def quantize(x: Tensor, scale: Tensor, fmt: str) -> Tensor:
    return kernels.quantize(x, scale, _fmt(fmt))


@quantize.register_fake
def _(x, scale, fmt):
    _ensure_lowerings()
    return torch.empty_like(x, dtype=_fmt(fmt).dtype)


@define("dequantize")
def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return kernels.dequantize(q, scale, dtype)


@dequantize.register_fake
def _(q, scale, dtype):
    _ensure_lowerings()
    return torch.empty_like(q, dtype=dtype)


@define("fp8_to_bf16")
def fp8_to_bf16(q: Tensor) -> Tensor:
    """Exact FP8 → bf16 upcast (the CPU backend's bit moves). Not emitted by rewrite(): the inductor
    lowering of fp8_linear calls it for weights, whose upcast inductor's own code does 10× slower."""
    return upcast.fp8_to_bf16(q)


@fp8_to_bf16.register_fake
def _(q):
    _ensure_lowerings()
    return torch.empty_like(q, dtype=torch.bfloat16)


@define("fp8_to_fp32")
def fp8_to_fp32(q: Tensor) -> Tensor:
    """Exact FP8 → fp32 upcast (bit moves), for the fp32 CPU GEMM path; used like ``fp8_to_bf16``."""
    return upcast.fp8_to_fp32(q)


@fp8_to_fp32.register_fake
def _(q):
    _ensure_lowerings()
    return torch.empty_like(q, dtype=torch.float32)


@define("dynamic_scale")
def dynamic_scale(x: Tensor, fmt: str, per_token: bool) -> Tensor:
    return kernels.dynamic_scale(x, _fmt(fmt), per_token)


@dynamic_scale.register_fake
def _(x, fmt, per_token):
    _ensure_lowerings()
    shape = (*x.shape[:-1], 1) if per_token else ()
    return x.new_empty(shape, dtype=torch.float32)


@define("dynamic_quantize")
def dynamic_quantize(x: Tensor, fmt: str, per_token: bool) -> tuple[Tensor, Tensor]:
    q, scale = kernels.dynamic_quantize(x, _fmt(fmt), per_token)
    return q, scale


@dynamic_quantize.register_fake
def _(x, fmt, per_token):
    _ensure_lowerings()
    shape = (*x.shape[:-1], 1) if per_token else ()
    return torch.empty_like(x, dtype=_fmt(fmt).dtype), x.new_empty(shape, dtype=torch.float32)


@define("fp8_linear")
def fp8_linear(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None,
               activation: str, residual: Tensor | None, out_dtype: torch.dtype, out_scale: Tensor | None,
               out_fmt: str) -> Tensor:
    return kernels.fp8_linear(x_q, x_scale, w_q, w_scale, bias=bias, activation=activation or None,
                              residual=residual, out_dtype=out_dtype, out_scale=out_scale, out_fmt=_fmt(out_fmt))


@fp8_linear.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, activation, residual, out_dtype, out_scale, out_fmt):
    _ensure_lowerings()
    n = w_q.shape[0] // 2 if activation in GATED else w_q.shape[0]
    dtype = out_dtype if out_scale is None else _fmt(out_fmt).dtype
    return x_q.new_empty((*x_q.shape[:-1], n), dtype=dtype)


@define("fp8_mlp")
def fp8_mlp(x_q: Tensor, x_scale: Tensor, w1_q: Tensor, w1_scale: Tensor, b1: Tensor | None, activation: str,
            h_scale: Tensor, h_fmt: str, w2_q: Tensor, w2_scale: Tensor, b2: Tensor | None, residual: Tensor | None,
            out_dtype: torch.dtype) -> Tensor:
    return kernels.fp8_mlp(x_q, x_scale, w1_q, w1_scale, b1, activation or None, h_scale, _fmt(h_fmt), w2_q,
                           w2_scale, b2, residual, out_dtype)


@fp8_mlp.register_fake
def _(x_q, x_scale, w1_q, w1_scale, b1, activation, h_scale, h_fmt, w2_q, w2_scale, b2, residual, out_dtype):
    _ensure_lowerings()
    return x_q.new_empty((*x_q.shape[:-1], w2_q.shape[0]), dtype=out_dtype)


@define("layer_norm_quantize")
def layer_norm_quantize(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, scale: Tensor,
                        fmt: str, rms: bool) -> tuple[Tensor, Tensor]:
    y, q = kernels.layer_norm_quantize(x, weight, bias, eps, scale, _fmt(fmt), rms=rms)
    return y, q


@layer_norm_quantize.register_fake
def _(x, weight, bias, eps, scale, fmt, rms):
    _ensure_lowerings()
    return torch.empty_like(x), torch.empty_like(x, dtype=_fmt(fmt).dtype)


@define("fp8_matmul")
def fp8_matmul(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor) -> Tensor:
    return kernels.fp8_matmul(a_q, a_scale, b_q, b_scale)


@fp8_matmul.register_fake
def _(a_q, a_scale, b_q, b_scale):
    _ensure_lowerings()
    return torch.empty(torch.matmul(a_q.new_empty(a_q.shape, dtype=torch.float32, device="meta"),
                                    b_q.new_empty(b_q.shape, dtype=torch.float32, device="meta")).shape,
                       dtype=torch.float32, device=a_q.device)


@define("fp8_attention")
def fp8_attention(q_q: Tensor, q_scale: Tensor, k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor,
                  attn_mask: Tensor | None, is_causal: bool, softmax_scale: float | None, p_scale: Tensor | None,
                  fmt: str) -> Tensor:
    return kernels.fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, attn_mask=attn_mask,
                                 is_causal=is_causal, softmax_scale=softmax_scale, p_scale=p_scale, fmt=_fmt(fmt))


@fp8_attention.register_fake
def _(q_q, q_scale, k_q, k_scale, v_q, v_scale, attn_mask, is_causal, softmax_scale, p_scale, fmt):
    _ensure_lowerings()
    return q_q.new_empty((*q_q.shape[:-1], v_q.shape[-1]), dtype=torch.float32)


# ----------------------------------------------------------------------------- block-scaled FP8 (opaque ops:
# no inductor decomposition yet, so under torch.compile they run the eager kernels as single graph nodes)
@define("block_quantize_weight")
def block_quantize_weight(w: Tensor, block: list[int], fmt: str) -> tuple[Tensor, Tensor]:
    q, scale = kernels.block_quantize_weight(w, tuple(block), _fmt(fmt))
    return q, scale


@block_quantize_weight.register_fake
def _(w, block, fmt):
    _ensure_lowerings()
    grid = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    return torch.empty_like(w, dtype=_fmt(fmt).dtype), w.new_empty(grid, dtype=torch.float32)


def _group_scale_shape(x: Tensor, group: int) -> tuple:
    return (*x.shape[:-1], -(-x.shape[-1] // group))


@define("group_quantize")
def group_quantize(x: Tensor, group: int, fmt: str) -> tuple[Tensor, Tensor]:
    q, scale = kernels.group_quantize(x, group, _fmt(fmt))
    return q, scale


@group_quantize.register_fake
def _(x, group, fmt):
    _ensure_lowerings()
    return torch.empty_like(x, dtype=_fmt(fmt).dtype), x.new_empty(_group_scale_shape(x, group), dtype=torch.float32)


@define("layer_norm_group_quantize")
def layer_norm_group_quantize(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group: int,
                              fmt: str, rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    y, q, scale = kernels.layer_norm_group_quantize(x, weight, bias, eps, group, _fmt(fmt), rms=rms)
    return y, q, scale


@layer_norm_group_quantize.register_fake
def _(x, weight, bias, eps, group, fmt, rms):
    _ensure_lowerings()
    return (torch.empty_like(x), torch.empty_like(x, dtype=_fmt(fmt).dtype),
            x.new_empty(_group_scale_shape(x, group), dtype=torch.float32))


@define("fp8_block_linear")
def fp8_block_linear(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, block: list[int],
                     bias: Tensor | None, activation: str, residual: Tensor | None, out_dtype: torch.dtype,
                     out_scale: Tensor | None, out_fmt: str) -> Tensor:
    return kernels.fp8_block_linear(x_q, x_scale, w_q, w_scale, block=tuple(block), bias=bias,
                                    activation=activation or None, residual=residual, out_dtype=out_dtype,
                                    out_scale=out_scale, out_fmt=_fmt(out_fmt))


@fp8_block_linear.register_fake
def _(x_q, x_scale, w_q, w_scale, block, bias, activation, residual, out_dtype, out_scale, out_fmt):
    _ensure_lowerings()
    n = w_q.shape[0] // 2 if activation in ("swiglu", "geglu") else w_q.shape[0]
    dtype = out_dtype if out_scale is None else _fmt(out_fmt).dtype
    return x_q.new_empty((*x_q.shape[:-1], n), dtype=dtype)


class GraphOps:
    """Kernel entry points → custom ops (what ``kernels.*`` call while a graph is captured)."""

    fp8_moe_experts = staticmethod(graph_fp8_moe_experts)  # a whole MoE experts call (moe_ops.py)

    @staticmethod
    def quantize(x, scale, fmt):
        return torch.ops.dbr_quant.quantize(x, scale, fmt.value)

    @staticmethod
    def dynamic_quantize(x, fmt, per_token):
        return torch.ops.dbr_quant.dynamic_quantize(x, fmt.value, per_token)

    @staticmethod
    def dequantize(q, scale, dtype):
        return torch.ops.dbr_quant.dequantize(q, scale, dtype)

    @staticmethod
    def dynamic_scale(x, fmt, per_token):
        return torch.ops.dbr_quant.dynamic_scale(x, fmt.value, per_token)

    @staticmethod
    def fp8_linear(x_q, x_scale, w_q, w_scale, *, bias, activation, residual, out_dtype, out_scale, out_fmt):
        return torch.ops.dbr_quant.fp8_linear(x_q, x_scale, w_q, w_scale, bias, activation or "", residual,
                                              out_dtype, out_scale, out_fmt.value)

    @staticmethod
    def fp8_mlp(x_q, x_scale, w1_q, w1_scale, b1, activation, h_scale, h_fmt, w2_q, w2_scale, b2, residual,
                out_dtype):
        return torch.ops.dbr_quant.fp8_mlp(x_q, x_scale, w1_q, w1_scale, b1, activation or "", h_scale, h_fmt.value,
                                           w2_q, w2_scale, b2, residual, out_dtype)

    @staticmethod
    def layer_norm_quantize(x, weight, bias, eps, scale, fmt, *, rms):
        return torch.ops.dbr_quant.layer_norm_quantize(x, weight, bias, eps, scale, fmt.value, rms)

    @staticmethod
    def fp8_matmul(a_q, a_scale, b_q, b_scale):
        return torch.ops.dbr_quant.fp8_matmul(a_q, a_scale, b_q, b_scale)

    @staticmethod
    def fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, *, attn_mask, is_causal, softmax_scale, p_scale,
                      fmt):
        return torch.ops.dbr_quant.fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, attn_mask, is_causal,
                                                 softmax_scale, p_scale, fmt.value)

    @staticmethod
    def block_quantize_weight(w, block, fmt):
        return torch.ops.dbr_quant.block_quantize_weight(w, list(block), fmt.value)

    @staticmethod
    def group_quantize(x, group, fmt):
        return torch.ops.dbr_quant.group_quantize(x, group, fmt.value)

    @staticmethod
    def layer_norm_group_quantize(x, weight, bias, eps, group, fmt, *, rms):
        return torch.ops.dbr_quant.layer_norm_group_quantize(x, weight, bias, eps, group, fmt.value, rms)

    @staticmethod
    def fp8_block_linear(x_q, x_scale, w_q, w_scale, *, block, bias, activation, residual, out_dtype, out_scale,
                         out_fmt):
        return torch.ops.dbr_quant.fp8_block_linear(x_q, x_scale, w_q, w_scale, list(block), bias, activation or "",
                                                    residual, out_dtype, out_scale, FP8Format.parse(out_fmt).value)


_lowerings_registered = False


def _ensure_lowerings() -> None:
    """Register the inductor lowerings (fx_rewriter.lowering) the first time any op is traced.

    Not at import: importing inductor's decomposition table costs ~1.5 s, and ``import dbr_quant`` defines
    these ops (so a saved ExportedProgram loads). Every path to inductor traces the ops with fake tensors
    (dynamo, export) before inductor picks its decomposition table, so registering here is in time."""
    global _lowerings_registered
    if not _lowerings_registered:
        _lowerings_registered = True
        from dbr_quant.fx_rewriter.lowering import register_inductor_lowerings

        register_inductor_lowerings()
