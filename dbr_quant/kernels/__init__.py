"""FP8 kernels behind one dispatch point.

Every quantized subgraph calls one of the entry points below. Each entry point counts a launch (see
:func:`count_launches`) and runs the implementation of the current backend (:func:`current_backend`;
``$DBR_QUANT_BACKEND`` or :func:`use_backend`). This release ships the ``reference`` backend (plain
torch, exact FP8 semantics, the CPU default; its GEMMs run in bf16 or fp32, see :mod:`.cpu` and
:func:`use_cpu_gemm`); the Triton backends plug into the same entry points.
Block-scaled FP8 (128×128 weight blocks, per-token 128-channel activation groups) has its own entry points
at the end, with :mod:`reference_block` as their reference implementation.

The entry points read this thread's settings (``dispatch._tls``: graph ops while capturing, launch counters
inside ``count_launches``, the forced backend) as plain attributes rather than through the accessor
functions: they run once per launch, and on small shapes the runtime's Python is the cost.
"""

from __future__ import annotations

import torch

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.cpu.features import current_gemm_path, use_cpu_gemm
from dbr_quant.kernels.dispatch import (
    BACKENDS,
    _env_backend,
    _env_cache,
    count_launches,
    current_backend,
    graph_ops,
    record_launch,
    resolve_backend,
    use_backend,
)
from dbr_quant.kernels.dispatch import (
    _tls as _settings,  # this thread's backend / graph ops / launch counters (read per launch)
)
from dbr_quant.kernels.reference import block as reference_block
from dbr_quant.kernels.reference import dense as reference
from dbr_quant.kernels.reference import grouped as reference_grouped
from dbr_quant.kernels.routing import MoeRouting, moe_route

__all__ = [
    "BACKENDS", "graph_ops", "count_launches", "current_backend", "resolve_backend", "use_backend", "current_gemm_path",
    "use_cpu_gemm",
    "quantize", "dynamic_quantize", "dequantize", "dynamic_scale", "fp8_linear", "fp8_mlp", "fp8_matmul",
    "fp8_attention", "layer_norm_quantize", "MoeRouting", "moe_route", "moe_quantize", "fp8_grouped_linear",
    "fp8_moe_block", "fp8_grouped_block_linear", "block_quantize_weight", "group_quantize",
    "layer_norm_group_quantize", "fp8_block_linear",
]


def _impl(t: torch.Tensor, ref=reference):
    """The implementation module for the backend that runs on ``t``'s device: ``ref`` (the op's reference module)
    for "reference", the CPU backend for "cpu" (the choice of "auto" off CUDA), else the Triton backend."""
    backend = _settings.backend  # current_backend() inlined: this runs once per launch
    if backend is None:
        backend = (_env_cache[0] if _env_cache else _env_backend()) or "auto"
    if (backend == "auto" and not t.is_cuda) or backend == "cpu":
        return cpu_backend
    if backend == "reference":
        return ref
    if resolve_backend(t.device) == "cpu":  # auto on CUDA without FP8 tensor cores (or without triton)
        return cpu_backend
    from dbr_quant.kernels.triton import backend as triton_backend

    return triton_backend


def _graph_op(ops, name: str):
    """``ops.<name>``, or a clear error while the graph rewriter has no such op yet."""
    op = getattr(ops, name, None)
    if op is None:
        raise NotImplementedError(f"dbr_quant.kernels.{name}: the graph rewriter (fx_rewriter) has no {name} op "
                                  "yet; run this model eagerly (without rewrite/compile)")
    return op


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    if (ops := _settings.graph_ops) is not None:
        return ops.quantize(x, scale, fmt)
    if _settings.counters:
        record_launch("quantize")
    return _impl(x).quantize(x, scale, fmt)


def dynamic_quantize(x: torch.Tensor, fmt: FP8Format, per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with a scale computed from ``x`` itself (per tensor, or per row of the last dim), in one
    launch where the backend can: returns (fp8, scale)."""
    if (ops := _settings.graph_ops) is not None:
        return ops.dynamic_quantize(x, fmt, per_token)
    if _settings.counters:
        record_launch("dynamic_quantize")
    return _impl(x).dynamic_quantize(x, fmt, per_token)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if (ops := _settings.graph_ops) is not None:
        return ops.dequantize(q, scale, dtype)
    if _settings.counters:
        record_launch("dequantize")
    return _impl(q).dequantize(q, scale, dtype)


def dynamic_scale(x: torch.Tensor, fmt: FP8Format, per_token: bool = False) -> torch.Tensor:
    if (ops := _settings.graph_ops) is not None:
        return ops.dynamic_scale(x, fmt, per_token)
    if _settings.counters:
        record_launch("amax")
    return _impl(x).dynamic_scale(x, fmt, per_token)


def fp8_linear(x_q, x_scale, w_q, w_scale, *, bias=None, activation=None, residual=None,
               out_dtype=torch.float32, out_scale=None, out_fmt=FP8Format.E4M3) -> torch.Tensor:
    """``act(x·Wᵀ·sx·sw + bias) + residual`` on FP8 operands, FP8 out when ``out_scale`` is given
    (see reference.fp8_linear)."""
    if (ops := _settings.graph_ops) is not None:
        return ops.fp8_linear(x_q, x_scale, w_q, w_scale, bias=bias, activation=activation, residual=residual,
                              out_dtype=out_dtype, out_scale=out_scale, out_fmt=out_fmt)
    if _settings.counters:
        record_launch("fp8_linear")
    return _impl(x_q).fp8_linear(x_q, x_scale, w_q, w_scale, bias=bias, activation=activation,
                              residual=residual, out_dtype=out_dtype, out_scale=out_scale, out_fmt=out_fmt)


def fp8_mlp(x_q, x_scale, w1_q, w1_scale, b1, activation, h_scale, h_fmt, w2_q, w2_scale, b2, residual,
            out_dtype=torch.float32) -> torch.Tensor:
    """An MLP's two GEMMs, FP8 between them: fc1's epilogue applies the activation (gated ones take a
    stacked [gate; up] w1) and quantizes with fc2's input scale ``h_scale``; fc2's adds bias and residual.
    Two launches; one graph node (``dbr_quant::fp8_mlp``) when captured."""
    if (ops := _settings.graph_ops) is not None:
        return ops.fp8_mlp(x_q, x_scale, w1_q, w1_scale, b1, activation, h_scale, h_fmt, w2_q, w2_scale, b2,
                           residual, out_dtype)
    impl = _impl(x_q)  # h lives where x_q does: one backend for both GEMMs
    if _settings.counters:
        record_launch("fp8_linear")
    h = impl.fp8_linear(x_q, x_scale, w1_q, w1_scale, bias=b1, activation=activation, out_dtype=out_dtype,
                        out_scale=h_scale, out_fmt=h_fmt)
    if _settings.counters:
        record_launch("fp8_linear")
    return impl.fp8_linear(h, h_scale, w2_q, w2_scale, bias=b2, residual=residual, out_dtype=out_dtype,
                           out_scale=None, out_fmt=FP8Format.E4M3)


def layer_norm_quantize(x, weight, bias, eps, scale, fmt, *, rms=False) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm / RMSNorm over the last dim and FP8 quantization in one kernel: (normalized, fp8)."""
    if (ops := _settings.graph_ops) is not None:
        return ops.layer_norm_quantize(x, weight, bias, eps, scale, fmt, rms=rms)
    if _settings.counters:
        record_launch("norm_quantize")
    return _impl(x).layer_norm_quantize(x, weight, bias, eps, scale, fmt, rms=rms)


def fp8_matmul(a_q, a_scale, b_q, b_scale) -> torch.Tensor:
    if (ops := _settings.graph_ops) is not None:
        return ops.fp8_matmul(a_q, a_scale, b_q, b_scale)
    if _settings.counters:
        record_launch("fp8_matmul")
    return _impl(a_q).fp8_matmul(a_q, a_scale, b_q, b_scale)


def fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, *, attn_mask=None, is_causal=False,
                  softmax_scale=None, p_scale=None, fmt=FP8Format.E4M3) -> torch.Tensor:
    if (ops := _settings.graph_ops) is not None:
        return ops.fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, attn_mask=attn_mask, is_causal=is_causal,
                                 softmax_scale=softmax_scale, p_scale=p_scale, fmt=fmt)
    if _settings.counters:
        record_launch("fp8_attention")
    return _impl(q_q).fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, attn_mask=attn_mask,
                                 is_causal=is_causal, softmax_scale=softmax_scale, p_scale=p_scale, fmt=fmt)


def moe_quantize(x: torch.Tensor, x_scale: torch.Tensor, routing: MoeRouting, fmt: FP8Format) -> torch.Tensor:
    """Quantize each (token, expert) row with its expert's input scale ``x_scale`` [E]; rows come out sorted by
    expert ([T·top_k, K], see moe_routing) for ``fp8_grouped_linear(..., x_sorted=True)``. One launch."""
    if (ops := _settings.graph_ops) is not None:
        return _graph_op(ops, "moe_quantize")(x, x_scale, routing, fmt)
    if _settings.counters:
        record_launch("moe_quantize")
    return _impl(x, reference_grouped).moe_quantize(x, x_scale, routing, fmt)


def fp8_grouped_linear(x_q, x_scale, w_q, w_scale, routing: MoeRouting, *, x_sorted=False, bias=None, activation=None,
                       out_dtype=torch.float32, out_scale=None, out_fmt=FP8Format.E4M3, topk_weights=None,
                       deterministic=False) -> torch.Tensor:
    """Every expert's rows against its FP8 weight ``w_q[e]`` in one launch, with the dense GEMM's epilogues
    (see reference_grouped.fp8_grouped_linear); with ``topk_weights`` the routing-weighted scatter-add into
    token order. ``deterministic`` (Triton, top_k > 2 matters) combines slots in a fixed order: +1 launch."""
    kw = dict(x_sorted=x_sorted, bias=bias, activation=activation, out_dtype=out_dtype, out_scale=out_scale,
              out_fmt=out_fmt, topk_weights=topk_weights)
    if (ops := _settings.graph_ops) is not None:
        return _graph_op(ops, "fp8_grouped_linear")(x_q, x_scale, w_q, w_scale, routing, **kw)
    if _settings.counters:
        record_launch("fp8_grouped_linear")
    impl = _impl(x_q, reference_grouped)
    if impl not in (reference_grouped, cpu_backend) and deterministic and topk_weights is not None \
            and routing.top_k > 1:
        if _settings.counters:
            record_launch("moe_sum")  # the Triton path's fixed-order combine (the reference's is part of its loop)
    return impl.fp8_grouped_linear(x_q, x_scale, w_q, w_scale, routing, deterministic=deterministic, **kw)


def fp8_grouped_block_linear(x_q, x_scale, w_q, w_scale, routing: MoeRouting, *, block, x_sorted=False, bias=None,
                             activation=None, out_dtype=torch.float32, topk_weights=None) -> torch.Tensor:
    """Block-scaled MoE experts: every expert's rows (per-token-group scales ``x_scale`` [rows, ⌈K/bk⌉])
    against its weight ``w_q[e]`` with block scales ``w_scale[e]`` (see
    reference_grouped.fp8_grouped_block_linear). Reference path only: one block GEMM per expert hit."""
    kw = dict(block=block, x_sorted=x_sorted, bias=bias, activation=activation, out_dtype=out_dtype,
              topk_weights=topk_weights)
    if (ops := _settings.graph_ops) is not None:
        return _graph_op(ops, "fp8_grouped_block_linear")(x_q, x_scale, w_q, w_scale, routing, **kw)
    impl = _impl(x_q, reference_grouped)
    if impl not in (reference_grouped, cpu_backend):
        raise NotImplementedError(
            "fp8_grouped_block_linear: the Triton grouped GEMM has no block scales yet; run block-scaled MoE "
            "experts on the CPU or reference backend (kernels.use_backend('cpu'), or DBR_QUANT_BACKEND=cpu), "
            "or convert the experts with per-channel weights (QConfig override on '.*experts')")
    if _settings.counters:
        record_launch("fp8_grouped_block_linear")
    return impl.fp8_grouped_block_linear(x_q, x_scale, w_q, w_scale, routing, **kw)


def fp8_moe_block(x: torch.Tensor, routing: MoeRouting, topk_weights: torch.Tensor, w13_q: torch.Tensor,
                  w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor, h_scale: torch.Tensor, *,
                  x_scale: torch.Tensor | None = None, activation: str = "swiglu", fmt: FP8Format = FP8Format.E4M3,
                  bias13: torch.Tensor | None = None, bias2: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.float32, deterministic: bool = False) -> torch.Tensor:
    """An MoE block's experts after routing, ``Σ_j w[t, j]·down_e(act(gate_up_e(x_t)))``, in three launches:

    1. quantize x: ``x_scale`` None → dynamic per-token scales; one value → static; [E] → per-expert static
       scales (``moe_quantize``: rows gathered and sorted by expert while quantizing);
    2. gate_up grouped GEMM (``w13_q`` [E, 2I, H] stacked [gate; up] for gated activations), epilogue
       ``act(gate)·up`` quantized with the down projection's input scale ``h_scale`` (one value or [E]);
    3. down grouped GEMM (``w2_q`` [E, H, I]) with the routing-weighted scatter-add into [T, H].
    """
    if x.dim() != 2:
        raise ValueError(f"fp8_moe_block: x must be [tokens, hidden], got {tuple(x.shape)}")
    if x_scale is None:
        x_q, xs = dynamic_quantize(x, fmt, per_token=True)
        x_sorted = False
    elif x_scale.numel() == 1:
        x_q, xs, x_sorted = quantize(x, x_scale, fmt), x_scale, False
    else:
        x_q, xs, x_sorted = moe_quantize(x, x_scale, routing, fmt), x_scale, True
    h_q = fp8_grouped_linear(x_q, xs, w13_q, w13_scale, routing, x_sorted=x_sorted, bias=bias13,
                             activation=activation, out_scale=h_scale, out_fmt=fmt)
    return fp8_grouped_linear(h_q, h_scale, w2_q, w2_scale, routing, x_sorted=True, bias=bias2,
                              topk_weights=topk_weights, out_dtype=out_dtype, deterministic=deterministic)
# ---------------------------------------------------------------------------------------------------
# Block-scaled FP8 (reference_block: 128×128 weight blocks, 1×128 per-token activation groups)


def block_quantize_weight(w: torch.Tensor, block: tuple[int, int] = reference_block.DEFAULT_BLOCK,
                          fmt: FP8Format = FP8Format.E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], scale [⌈N/bn⌉, ⌈K/bk⌉]): the compressed-tensors FP8_BLOCK / FineGrainedFP8 layout.
    Convert-time work: plain torch on every backend and device."""
    if (ops := _settings.graph_ops) is not None:
        return _graph_op(ops, "block_quantize_weight")(w, block, fmt)
    if _settings.counters:
        record_launch("block_quantize_weight")
    return reference_block.block_quantize_weight(w, block, fmt)


def group_quantize(x: torch.Tensor, group: int = reference_block.DEFAULT_GROUP,
                   fmt: FP8Format = FP8Format.E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group quantization in one launch: (fp8 like x, scale [..., ⌈K/group⌉])."""
    if (ops := _settings.graph_ops) is not None:
        return _graph_op(ops, "group_quantize")(x, group, fmt)
    if _settings.counters:
        record_launch("group_quantize")
    return _impl(x, reference_block).group_quantize(x, group, fmt)


def layer_norm_group_quantize(x, weight, bias, eps, group: int = reference_block.DEFAULT_GROUP,
                              fmt: FP8Format = FP8Format.E4M3, *,
                              rms: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm / RMSNorm then per-token-group FP8 in one kernel: (normalized, fp8, scale [..., ⌈K/group⌉])."""
    if (ops := _settings.graph_ops) is not None:
        return _graph_op(ops, "layer_norm_group_quantize")(x, weight, bias, eps, group, fmt, rms=rms)
    if _settings.counters:
        record_launch("norm_group_quantize")
    return _impl(x, reference_block).layer_norm_group_quantize(x, weight, bias, eps, group, fmt, rms=rms)


def fp8_block_linear(x_q, x_scale, w_q, w_scale, *, block=reference_block.DEFAULT_BLOCK, bias=None, activation=None,
                     residual=None, out_dtype=torch.float32, out_scale=None, out_fmt=FP8Format.E4M3) -> torch.Tensor:
    """Block-scaled ``act(x·Wᵀ + bias) + residual``: x_scale [..., ⌈K/bk⌉] per token-group, w_scale
    [⌈N/bn⌉, ⌈K/bk⌉] per block, applied per K block in fp32 (see reference_block.fp8_block_linear)."""
    if (ops := _settings.graph_ops) is not None:
        return _graph_op(ops, "fp8_block_linear")(x_q, x_scale, w_q, w_scale, block=block, bias=bias,
                                                  activation=activation, residual=residual, out_dtype=out_dtype,
                                                  out_scale=out_scale, out_fmt=out_fmt)
    if _settings.counters:
        record_launch("fp8_block_linear")
    return _impl(x_q, reference_block).fp8_block_linear(x_q, x_scale, w_q, w_scale, block=block, bias=bias,
                                                        activation=activation, residual=residual,
                                                        out_dtype=out_dtype, out_scale=out_scale, out_fmt=out_fmt)
