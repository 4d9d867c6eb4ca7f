"""The reference FP8 kernels: the FP8 semantics in plain torch, the ground truth every backend is tested against.

"Exact" here (DESIGN.md, "Ground rules for numerics") means:

* quantize: ``q = saturate(x · (1/scale))`` cast to FP8 with round-to-nearest-even: ``torch.reciprocal`` of the
  scale (rounded once), one fp32 multiply, a clamp to ±fmt.max and torch's own cast ``.to(float8)``, nothing
  else. Scales are dequantization scales (x ≈ q·scale). NaN stays NaN (torch's cast).
* GEMMs: the operands are the exact FP8 values (torch's cast to fp32), products accumulate in an fp32 GEMM
  (``F.linear`` / ``torch.matmul``), and the combined scale ``sx·sw`` multiplies the accumulator in the epilogue
  (with the bias in the same rounding step), then activation, residual, output dtype, or FP8 out with the next
  op's scale. That is the order of the GPU kernels, vLLM and ``torch._scaled_mm``; the Triton kernels match it up
  to the order of fp32 additions.
* attention, norms, dynamic scales: fp32 as written below (softmax in fp32, P quantized with the fixed scale
  1/fmt.max).

Nothing here is tuned for speed: no C kernels, no bf16 GEMMs, no scratch buffers, no shape-dependent paths. The
fast CPU path is its own backend, :mod:`dbr_quant.kernels.cpu.backend` (the default for CPU tensors;
``use_backend("reference")`` / ``DBR_QUANT_BACKEND=reference`` runs this module instead). Its tolerance against
this one, tested in tests/kernels/test_cpu_backend.py:

* quantize, dequantize, dynamic scales, norms: the same bits (NaN input aside: the fast upcast reads E4M3's NaN
  code as ±480);
* fp32 GEMMs (the fp32 CPU GEMM path, and small operands on either path): the operands are dequantized first,
  ``F.linear(q_x·s_x, q_w·s_w, b)`` (compressed-tensors' order), so the result differs from this module's by the
  fp32 rounding of the scaled products and sums, about an ulp of |x|·|w| per term (bit for bit with power-of-two
  scales and sums fp32 holds exactly);
* bf16 GEMMs (the bf16 CPU GEMM path): additionally the GEMM result rounded once to bf16, relative ≤ 2⁻⁸ (16× below
  E4M3's own 2⁻⁴);
* an FP8 output may therefore land one FP8 code away where the value sits at a rounding midpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dbr_quant.formats import FP8Format, safe_scale

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
GATED_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}  # gated kind → act(gate)
GATED = tuple(GATED_ACTIVATIONS)

Quantize = Callable[[torch.Tensor, torch.Tensor, FP8Format], torch.Tensor]
Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Saturating cast of ``x · (1/scale)`` onto the FP8 grid (scale broadcasts against x): the reciprocal rounded
    once, then one multiply, as vLLM's static quantize (not the correctly rounded ``x / scale``: see README)."""
    y = x.float() * torch.reciprocal(scale.float())
    return y.clamp_(-fmt.max, fmt.max).to(fmt.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # scaled in place on the one float32 copy of q: a weight-sized temporary less when an FP8 weight is used as a
    # tensor (load_pretrained's trace runs every FP8 linear so: its peak memory, benchmarks/checkpoint_memory.py)
    s, y = scale.float(), q.to(torch.float32, copy=True)
    return (y.mul_(s) if torch.broadcast_shapes(y.shape, s.shape) == y.shape else y * s).to(dtype)


def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Absolute max per tensor (dim None) or along ``dim`` kept; non-finite values ignored."""
    a = x.detach().float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
    if dim is None:
        return a.amax()
    return a.amax(dim=dim, keepdim=True)


def dynamic_scale(x: torch.Tensor, fmt: FP8Format, per_token: bool) -> torch.Tensor:
    """Scale computed from the tensor itself: one per tensor, or one per row (token) of the last dim."""
    return safe_scale(amax(x, dim=-1 if per_token else None), fmt)


def dynamic_quantize(x: torch.Tensor, fmt: FP8Format, per_token: bool,
                     quantize: Quantize = quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """(``quantize(x, scale)``, scale) with :func:`dynamic_scale`'s scale. ``quantize`` is swappable (the CPU
    backend passes its one-pass C quantize: the same bits)."""
    scale = dynamic_scale(x, fmt, per_token)
    return quantize(x, scale, fmt), scale


def apply_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "relu":
        return F.relu(y)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"unknown activation {activation!r}; use one of {ACTIVATIONS}")


def fp8_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    out_scale: torch.Tensor | None = None,
    out_fmt: FP8Format = FP8Format.E4M3,
) -> torch.Tensor:
    """FP8 GEMM with epilogue: ``act(x·Wᵀ·sx·sw + bias) + residual``.

    ``x_scale`` is a scalar or one value per row (…×1); ``w_scale`` a scalar or one per output
    channel (N,). Gated activations take W stacked as [gate; up] (2N×K) and return N columns.
    With ``out_scale`` (the next op's input scale) the result is returned quantized to ``out_fmt``,
    so an MLP hands FP8 from fc1 to fc2 without a high-precision round trip.
    """
    acc = F.linear(x_q.float(), w_q.float())
    y = dequantize_accumulator(acc, x_scale * w_scale, bias)  # (…×1)·(N,) broadcasts to the output's scale grid
    return linear_epilogue(y, activation, residual, out_dtype, out_scale, out_fmt)


def dequantize_accumulator(acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``bias + acc·scale`` in fp32, one pass (the GEMM result times the combined x·w scale)."""
    base = bias.float() if bias is not None else torch.zeros((), device=acc.device)
    return torch.addcmul(base, acc, scale.float() if scale.dim() else scale.float().expand(1))


def linear_epilogue(y: torch.Tensor, activation: str | None, residual: torch.Tensor | None, out_dtype: torch.dtype,
                    out_scale: torch.Tensor | None, out_fmt: FP8Format, quantize: Quantize = quantize,
                    inplace: bool = True) -> torch.Tensor:
    """What follows the scaled fp32 GEMM result ``y``: activation (gated ones halve the columns), residual,
    the output dtype, and FP8 output when ``out_scale`` is given. ``quantize`` is swappable (the CPU backend passes
    its C quantize; the inductor lowering, fx_rewriter.lowering, its own compilable one, with ``inplace=False``:
    its decompositions run below functionalization, where in-place ops are refused)."""
    if activation in GATED:
        gate, up = y.chunk(2, dim=-1)
        y = apply_activation(gate, GATED_ACTIVATIONS[activation]) * up
    else:
        y = apply_activation(y, activation)
    if residual is not None:
        y = y.add_(residual.float()) if inplace and activation is None else y + residual.float()
    y = y.to(out_dtype)
    return y if out_scale is None else quantize(y, out_scale, out_fmt)


def fp8_matmul(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """Batched ``a @ b`` between two FP8 activations (broadcasting like torch.matmul), fp32 result."""
    return torch.matmul(a_q.float(), b_q.float()).mul_(a_scale * b_scale)


def head_view(scale: torch.Tensor) -> torch.Tensor:
    """A per-head scale ([H]: 1-D) as [H, 1, 1], broadcasting over an attention operand's (…, H, L, D); other
    scales (0-d per tensor, per token …×L×1) as they are."""
    return scale.reshape(-1, 1, 1) if scale.dim() == 1 else scale


def fp8_attention(
    q_q: torch.Tensor,
    q_scale: torch.Tensor,
    k_q: torch.Tensor,
    k_scale: torch.Tensor,
    v_q: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    softmax_scale: float | None = None,
    p_scale: torch.Tensor | None = None,
    fmt: FP8Format = FP8Format.E4M3,
    matmul: Matmul = fp8_matmul,
    quantize: Quantize = quantize,
) -> torch.Tensor:
    """FP8 attention: S = Q·Kᵀ in FP8 (fp32 accumulate), fp32 softmax, P quantized to FP8 with ``p_scale``
    (default the fixed 1/fmt.max: P ∈ [0, 1]), O = P·V in FP8. K/V with fewer heads are repeated (GQA).

    Scales: one element (per tensor: 0-d or [1]), one per head (1-D: ``q_scale`` / ``p_scale`` [Hq], ``k_scale``
    / ``v_scale`` [Hkv], the heads of k and v, dim -3), or per token (``q_scale`` / ``k_scale`` shaped like the
    operand with a last dim of 1). Per-head attention is per-tensor attention run on each head.
    Masks follow F.scaled_dot_product_attention: a bool mask keeps True, a float mask is added.
    ``matmul``/``quantize`` are swappable (the CPU backend passes its fast ones, the inductor lowering compilable
    ones).
    """
    head_dim = q_q.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if p_scale is None:
        p_scale = torch.tensor(1.0 / fmt.max, device=q_q.device)
    q_scale, k_scale, v_scale, p_scale = (head_view(s) for s in (q_scale, k_scale, v_scale, p_scale))
    if k_q.dim() == 4 and k_q.shape[-3] != q_q.shape[-3]:
        rep = q_q.shape[-3] // k_q.shape[-3]
        k_q = k_q.repeat_interleave(rep, dim=-3)
        v_q = v_q.repeat_interleave(rep, dim=-3)
        # per-token and per-head k / v scales follow their kv head
        k_scale, v_scale = (s.repeat_interleave(rep, dim=-3) if s.dim() >= 3 and s.shape[-3] > 1 else s
                            for s in (k_scale, v_scale))
    k_scale = k_scale.transpose(-1, -2) if k_scale.dim() else k_scale  # per-token k scales index columns of S
    s = matmul(q_q, q_scale, k_q.transpose(-1, -2), k_scale) * softmax_scale
    if is_causal:
        lq, lk = s.shape[-2], s.shape[-1]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()  # top-left, as in SDPA
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.float()
    # a row whose keys are all masked gives 0/0; SDPA returns zeros there, and so do we
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    p_q = quantize(p, p_scale, fmt)
    return matmul(p_q, p_scale, v_q, v_scale)


def layer_norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor,
    fmt: FP8Format,
    *,
    rms: bool = False,
    quantize: Quantize = quantize,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm (or RMSNorm) over the last dim in fp32, then FP8 quantization; returns (normalized in
    x's dtype, fp8). For fp32 inputs ``normalized`` equals F.layer_norm / F.rms_norm bit for bit."""
    xf = x.float()
    if rms:
        y = F.rms_norm(xf, xf.shape[-1:], None if weight is None else weight.float(), eps)
    else:
        y = F.layer_norm(xf, xf.shape[-1:], None if weight is None else weight.float(),
                         None if bias is None else bias.float(), eps)
    return y.to(x.dtype), quantize(y, scale, fmt)
