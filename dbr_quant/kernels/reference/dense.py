"""Reference FP8 kernels in plain torch: the CPU default and the ground truth for Triton kernels.

Semantics (DESIGN.md, "Ground rules for numerics"):
* quantize: ``q = saturate(x * (1 / scale))`` cast to FP8 with round-to-nearest-even, bit-identical to
  ``torch.Tensor.to(float8)`` after clamping to ±fmt.max. Scales are dequantization scales (x ≈ q·scale).
* GEMMs: operands are exact FP8 values, products accumulate in fp32, scales are applied afterwards in
  the epilogue (bias, activation, residual, optional FP8 output for the next op). That is what the GPU
  kernels and ``exact=True`` compute. The reference linear's fp32 GEMMs (the fp32 CPU GEMM path; small
  GEMMs) dequantize their operands first instead (:func:`dequantize_operand`): compressed-tensors' order,
  so transformers reproduces a saved checkpoint's linears bit for bit from the same FP8 input codes (its
  quantize divides, ``x / s``: one code apart at rare ties, see README); the two orders differ by ~1 fp32 ulp.

Speed on CPU: torch's FP8→bf16/fp32 casts are scalar code (≈1 ms per 0.6 M elements here), and they, not
the GEMM, dominated a naive path. Every FP8 value is exactly representable in bf16 and in fp32, so we
upcast with integer bit moves instead (:func:`fp8_upcast`) and run the GEMM in the dtype of the CPU GEMM
path (:mod:`.cpu`: bf16 where the CPU has BF16 dot products, else fp32). Both accumulate in fp32; the
bf16 path rounds the GEMM result once to bf16 (relative error ≤ 2⁻⁸, 16× below E4M3's own 2⁻⁴), the
fp32 path keeps it in fp32. Both upcasts turn E4M3's NaN code into ±480 (NaN input is unsupported on the
fast paths). ``exact=True`` is the slow ground truth other backends are tested against: torch's own
casts (NaN propagates) and an fp32 GEMM.
"""

from __future__ import annotations

import functools
import math
import threading

import torch
import torch.nn.functional as F

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3
from dbr_quant.kernels.cpu import features as cpu

# 2**120 re-biases the exponent after the bit move (bf16 bias 127 vs E4M3 bias 7). Multiplying in bf16
# is exact and lifts E4M3 subnormals out of bf16's subnormal range, which AVX512-BF16 dot products flush.
_E4M3_REBIAS = 2.0**120

# Operands up to this many elements take torch's own FP8 casts and an fp32 GEMM (exact, like ``exact=True``):
# the bit-move upcasts cost ≈10 µs of fixed per-call overhead each (five torch ops), torch's scalar cast
# ≈1.7 ns per element, so below ≈6 k elements the plain casts win (a 16×16 linear: 36 → 10 µs here).
SMALL_OPERAND = cpu_e4m3.SMALL  # also the size of small_linear's C buffers: one constant for both


def _small(t: torch.Tensor) -> bool:
    return small_count(t.numel())


def small_count(n) -> bool:
    """``n`` (an int, or a symbolic size in a graph lowering: then only when provably) ≤ SMALL_OPERAND."""
    if isinstance(n, int):
        return n <= SMALL_OPERAND
    from torch.fx.experimental.symbolic_shapes import guard_or_false  # a symbolic size (a graph lowering)

    return guard_or_false(n <= SMALL_OPERAND)


def gemm_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """What an FP8 GEMM of ``a`` and ``b`` runs in on the CPU: fp32 when both operands are small (exact, like
    ``exact=True``), else the CPU GEMM path's dtype (:func:`cpu.gemm_dtype`). The graph lowering asks too."""
    return torch.float32 if _small(a) and _small(b) else cpu.gemm_dtype(a)

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
GATED_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}  # gated kind → act(gate)
GATED = tuple(GATED_ACTIVATIONS)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Saturating cast of ``x · (1/scale)`` onto the FP8 grid (scale broadcasts against x): the reciprocal rounded
    once, then one multiply, as vLLM's static quantize (not the correctly rounded ``x / scale``: see README)."""
    if fmt is FP8Format.E4M3:
        q = cpu_e4m3.quantize_e4m3(x, scale)  # one pass of C, same bits, where it applies
        if q is not None:
            return q
    inv = torch.reciprocal(scale.float())
    y = x.float() * inv
    return y.clamp_(-fmt.max, fmt.max).to(fmt.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # scaled in place on the one float32 copy of q: a weight-sized temporary less when an FP8 weight is used as a
    # tensor (load_pretrained's trace runs every FP8 linear so: its peak memory, benchmarks/checkpoint_memory.py)
    s, y = scale.float(), q.to(torch.float32, copy=True)
    return (y.mul_(s) if torch.broadcast_shapes(y.shape, s.shape) == y.shape else y * s).to(dtype)


def e4m3_to_bf16(q: torch.Tensor, reuse_buffer: bool = False) -> torch.Tensor:
    """Exact E4M3 → bf16 by moving bits: sign to bit 15, exponent+mantissa up by 4, then ×2**120.

    NaN (0x7F/0xFF) is not representable this way and comes out as ±480; quantize() never produces
    NaN from finite input, and NaN input is documented as unsupported on the fast path.
    """
    # int8 × a 1-d int16 tensor promotes to int16: the sign-extending widen and the shift by 4 in one pass
    out = _scratch(q.shape, q.device, torch.int16) if reuse_buffer else None
    bits = torch.mul(q.view(torch.int8), _const(16, q.device), out=out)
    bits.bitwise_and_(0x87F0)  # sign bit to 15; clear the copies sign-extension left in bits 11..14
    return bits.view(torch.bfloat16).mul_(_E4M3_REBIAS)


# E4M3's bits moved up by 7 sit where fp16 keeps them (mantissa 7..9, exponent 10..13, sign 15 after the
# sign-extending widen): keep those, clear the copy of the sign in bit 14 (0xBF80 as a signed int16)
_E4M3_FP16_MASK = 0xBF80 - (1 << 16)


def e4m3_to_fp32(q: torch.Tensor, reuse_buffer: bool = False) -> torch.Tensor:
    """Exact E4M3 → fp32: bits moved into fp16 (a value 2⁻⁸ times too small: biases 15 vs 7), fp16 → fp32
    (a vectorized, exact hardware conversion), ×2**8. Via fp16, not straight into fp32 bits, so E4M3
    subnormals never become fp32 subnormals: the conversion takes fp16 subnormals in hardware, and the
    ×2**8 sees normal numbers only (no denormal-operand assists, no dependence on denormals-are-zero).
    NaN (0x7F/0xFF) comes out as ±480, as in :func:`e4m3_to_bf16`. ``reuse_buffer``: as fp8_to_bf16's."""
    bits = torch.mul(q.view(torch.int8), _const(128, q.device),  # widen and shift by 7 in one pass
                     out=_scratch(q.shape, q.device, torch.int16) if reuse_buffer else None)
    halves = bits.bitwise_and_(_E4M3_FP16_MASK).view(torch.float16)
    out = _scratch(q.shape, q.device, torch.float32) if reuse_buffer else None
    return (halves.float() if out is None else out.copy_(halves)).mul_(256.0)


_tls = threading.local()


def _scratch(shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
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
        out = _scratch(q.shape, q.device, torch.bfloat16) if reuse_buffer else None
        decoded = cpu_e4m3.decode_e4m3(q, torch.bfloat16, out)  # one pass of C where it could be built
        return decoded if decoded is not None else e4m3_to_bf16(q, reuse_buffer)
    return q.to(torch.bfloat16)  # E5M2 is the top byte of fp16; torch's cast is exact


def fp8_to_fp32(q: torch.Tensor, reuse_buffer: bool = False) -> torch.Tensor:
    """Exact upcast to fp32 (``reuse_buffer`` as in :func:`fp8_to_bf16`)."""
    if q.dtype == torch.float8_e4m3fn:
        out = _scratch(q.shape, q.device, torch.float32) if reuse_buffer else None
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
    raise ValueError(f"reference.fp8_upcast: no exact upcast to {dtype}; use torch.bfloat16 or torch.float32")


def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Absolute max per tensor (dim None) or along ``dim`` kept; non-finite values ignored."""
    a = x.detach().float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
    if dim is None:
        return a.amax()
    return a.amax(dim=dim, keepdim=True)


def dynamic_scale(x: torch.Tensor, fmt: FP8Format, per_token: bool) -> torch.Tensor:
    """Scale computed from the tensor itself: one per tensor, or one per row (token) of the last dim."""
    from dbr_quant.formats import safe_scale

    return safe_scale(amax(x, dim=-1 if per_token else None), fmt)


def dynamic_quantize(x: torch.Tensor, fmt: FP8Format, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
    exact: bool = False,
) -> torch.Tensor:
    """FP8 GEMM with epilogue: ``act(x·Wᵀ·sx·sw + bias) + residual``.

    ``x_scale`` is a scalar or one value per row (…×1); ``w_scale`` a scalar or one per output
    channel (N,). Gated activations take W stacked as [gate; up] (2N×K) and return N columns.
    With ``out_scale`` (the next op's input scale) the result is returned quantized to ``out_fmt``,
    so an MLP hands FP8 from fc1 to fc2 without a high-precision round trip.
    """
    small = _small(x_q) and _small(w_q)  # what gemm_dtype() decides on, computed once on this hot path
    dtype = torch.float32 if exact or small else cpu.gemm_dtype(x_q)
    if dtype == torch.float32 and not exact:  # operands dequantized first (see dequantize_operand)
        if small:  # one C call instead of a dozen torch ops, where it applies
            # the GEMM is the C one whatever the epilogue, so a fused subgraph equals its ops one by one; an
            # epilogue C does not compute (GELU: torch's erf is not C's) runs in torch on its fp32 result
            if cpu_e4m3.tail_in_c(x_q, w_q, activation, residual, out_dtype, out_scale, out_fmt is FP8Format.E4M3):
                y = cpu_e4m3.small_linear(x_q, x_scale, w_q, w_scale, bias, activation, residual, out_dtype,
                                          out_scale, out_fmt is FP8Format.E4M3)
                if y is not None:
                    return y
            else:
                y = cpu_e4m3.small_linear(x_q, x_scale, w_q, w_scale, bias, None, None, torch.float32, None, True)
                if y is not None:
                    return linear_epilogue(y, activation, residual, out_dtype, out_scale, out_fmt)
        y = F.linear(dequantize_operand(x_q, x_scale),
                     dequantize_operand(w_q, w_scale.reshape(-1, 1) if w_scale.dim() else w_scale, reuse_buffer=True),
                     None if bias is None else bias.float())
        return linear_epilogue(y, activation, residual, out_dtype, out_scale, out_fmt)
    scale = x_scale * w_scale  # (…×1)·(N,) broadcasts to the output's scale grid
    if exact:
        acc = F.linear(x_q.float(), w_q.float())
    elif activation in GATED and dtype == torch.bfloat16:  # two GEMMs: each half rounds as its own linear would
        n = w_q.shape[0] // 2
        x_u = fp8_upcast(x_q, dtype)
        acc = torch.cat([F.linear(x_u, fp8_upcast(w_q[:n], dtype, reuse_buffer=True)),
                         F.linear(x_u, fp8_upcast(w_q[n:], dtype, reuse_buffer=True))], dim=-1)
    else:
        acc = F.linear(fp8_upcast(x_q, dtype), fp8_upcast(w_q, dtype, reuse_buffer=True))
    y = dequantize_accumulator(acc, scale, bias)
    return linear_epilogue(y, activation, residual, out_dtype, out_scale, out_fmt)


def dequantize_operand(q: torch.Tensor, scale: torch.Tensor, reuse_buffer: bool = False) -> torch.Tensor:
    """``q · scale`` in fp32 (``scale``: one value or one per row), each product rounded once: the operand of
    an fp32 GEMM that takes its operands dequantized. The fp32 GEMMs of the reference backend (the fp32 CPU
    GEMM path, and small GEMMs on either path) work this way rather than scaling the accumulator: it is
    compressed-tensors' order (dequantize the weight, fake-quantize the input, ``F.linear``), so a checkpoint
    written by :func:`dbr_quant.save_pretrained` and reloaded by transformers on a CPU computes the same
    numbers bit for bit from the same FP8 input codes (a small linear's C sum runs in k order, not torch's); and
    it costs less (the scale rides on the upcast pass, the bias on the GEMM). The
    accumulator order (``exact=True``, the bf16 path, the GPU kernels) differs from it by about an fp32 ulp
    before each FP8 re-quantization. ``reuse_buffer``: as in :func:`fp8_to_fp32`."""
    if _small(q):  # torch's scalar cast beats the fixed cost of a C call or the bit moves here
        return q.float() * scale.float()
    out = _scratch(q.shape, q.device, torch.float32) if reuse_buffer else None
    if q.dtype == torch.float8_e4m3fn:
        values = cpu_e4m3.decode_e4m3_scaled(q, scale, out)
        if values is not None:
            return values
    values = fp8_to_fp32(q, reuse_buffer)
    return values.mul_(scale.float()) if values.shape == torch.broadcast_shapes(values.shape, scale.shape) \
        else values * scale.float()


def dequantize_accumulator(acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``bias + acc·scale`` in fp32, one pass (the GEMM result times the combined x·w scale)."""
    base = bias.float() if bias is not None else torch.zeros((), device=acc.device)
    return torch.addcmul(base, acc, scale.float() if scale.dim() else scale.float().expand(1))


def linear_epilogue(y: torch.Tensor, activation: str | None, residual: torch.Tensor | None, out_dtype: torch.dtype,
                    out_scale: torch.Tensor | None, out_fmt: FP8Format, quantize=quantize,
                    inplace: bool = True) -> torch.Tensor:
    """What follows the scaled fp32 GEMM result ``y``: activation (gated ones halve the columns), residual,
    the output dtype, and FP8 output when ``out_scale`` is given. ``quantize`` is swappable so the inductor
    lowering (fx_rewriter.lowering) shares this code with its own, compilable, quantize; it passes
    ``inplace=False`` (its decompositions run below functionalization, where in-place ops are refused)."""
    if activation in GATED:
        gate, up = y.chunk(2, dim=-1)
        y = apply_activation(gate, GATED_ACTIVATIONS[activation]) * up
    else:
        y = apply_activation(y, activation)
    if residual is not None:
        y = y.add_(residual.float()) if inplace and activation is None else y + residual.float()
    y = y.to(out_dtype)
    return y if out_scale is None else quantize(y, out_scale, out_fmt)


def fp8_matmul(
    a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor, *, exact: bool = False
) -> torch.Tensor:
    """Batched ``a @ b`` between two FP8 activations (broadcasting like torch.matmul), fp32 result."""
    dtype = torch.float32 if exact else gemm_dtype(a_q, b_q)
    if exact or (_small(a_q) and _small(b_q)):
        acc = torch.matmul(a_q.float(), b_q.float())
    else:
        acc = torch.matmul(fp8_upcast(a_q, dtype), fp8_upcast(b_q, dtype)).float()
    return acc.mul_(a_scale * b_scale)


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
    exact: bool = False,
    matmul=None,
    quantize=quantize,
) -> torch.Tensor:
    """FP8 attention: S = Q·Kᵀ in FP8 (fp32 accumulate), fp32 softmax, P quantized to FP8 with the
    fixed scale 1/fmt.max (P ∈ [0, 1]), O = P·V in FP8. K/V with fewer heads are repeated (GQA).

    Masks follow F.scaled_dot_product_attention: a bool mask keeps True, a float mask is added.
    ``matmul``/``quantize`` are swappable (the inductor lowering passes compilable ones).
    """
    if matmul is None:
        matmul = functools.partial(fp8_matmul, exact=exact)
    head_dim = q_q.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if k_q.dim() == 4 and k_q.shape[-3] != q_q.shape[-3]:
        rep = q_q.shape[-3] // k_q.shape[-3]
        k_q = k_q.repeat_interleave(rep, dim=-3)
        v_q = v_q.repeat_interleave(rep, dim=-3)
        if k_scale.dim() == 4 and k_scale.shape[-3] > 1:  # per-token k scales follow their kv head
            k_scale = k_scale.repeat_interleave(rep, dim=-3)
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
    if p_scale is None:
        p_scale = torch.tensor(1.0 / fmt.max, device=p.device)
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
    quantize=quantize,
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
