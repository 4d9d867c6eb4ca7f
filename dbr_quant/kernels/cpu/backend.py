"""The CPU backend: the reference's FP8 semantics (:mod:`dbr_quant.kernels.reference`), computed fast on a CPU.

It implements every kernel of :mod:`dbr_quant.kernels` (dense, block-scaled, grouped) and runs for CPU tensors
under the default backend choice ("auto"; also for CUDA devices without FP8 tensor cores, where its GEMMs run in
bf16). ``use_backend("reference")`` / ``DBR_QUANT_BACKEND=reference`` runs the plain reference instead; what this
backend may differ from it by is stated in the reference's docstring and tested in tests/kernels/test_cpu_backend.py.

Where the time goes, and what is done about it:

* **Upcasts.** torch's FP8 → bf16/fp32 casts are scalar code and dominated a naive path; the upcasts here are bit
  moves (:mod:`dbr_quant.kernels.cpu.upcast`: one pass of C where it is built, a few torch ops otherwise) into a
  reused per-shape scratch buffer for weights. Exact: every FP8 value is a bf16 and an fp32 value.
* **The GEMM dtype** (:mod:`dbr_quant.kernels.cpu.features`): bf16 where the CPU has BF16 dot products (the GEMM
  result rounded once to bf16, relative ≤ 2⁻⁸, 16× below E4M3's own 2⁻⁴; gated activations as two GEMMs, so
  each half rounds as its own linear would), else fp32. Both accumulate in fp32.
* **fp32 GEMMs dequantize their operands first** (:func:`dequantize_operand`, scale on the upcast pass, bias in the
  GEMM): compressed-tensors' order, so transformers reproduces a saved checkpoint's linears bit for bit from the
  same FP8 input codes (its quantize divides, ``x / s``: one code apart at rare ties, see README). The reference's
  order (the accumulator scaled in the epilogue) differs from it by ~1 fp32 ulp.
* **Small operands** (both ≤ :data:`SMALL_OPERAND` elements): the bit moves' fixed cost (≈10 µs, five torch ops)
  loses to torch's scalar cast there, and the per-op cost of torch to one C call (:func:`cpu_e4m3.small_linear`,
  the sum in k order): such GEMMs run in fp32 with operands dequantized first, on either GEMM path.
* **Quantize**: one pass of C (:func:`cpu_e4m3.quantize_e4m3`), the same bits as the reference's torch ops.

Without the C kernels (no compiler, ``DBR_QUANT_CPU_DECODE=torch``) every step takes its torch ops, with the same
bits except a small linear's sum order. NaN inputs are unsupported here: the upcasts read E4M3's NaN code as ±480.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_false

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3
from dbr_quant.kernels.cpu import features
from dbr_quant.kernels.cpu.upcast import fp8_to_fp32, fp8_upcast, scratch
from dbr_quant.kernels.reference import block as reference_block
from dbr_quant.kernels.reference import dense as reference
from dbr_quant.kernels.reference import grouped as reference_grouped
from dbr_quant.kernels.reference import mx as reference_mx
from dbr_quant.kernels.reference import weight_only as reference_weight_only
from dbr_quant.kernels.reference.dense import GATED, dequantize_accumulator, linear_epilogue

# Operands up to this many elements take torch's own FP8 casts and an fp32 GEMM: the bit-move upcasts cost ≈10 µs
# of fixed per-call overhead each (five torch ops), torch's scalar cast ≈1.7 ns per element, so below ≈6 k
# elements the plain casts win (a 16×16 linear: 36 → 10 µs here).
SMALL_OPERAND = cpu_e4m3.SMALL  # also the size of small_linear's C buffers: one constant for both

def small(t: torch.Tensor) -> bool:
    """Whether ``t`` has at most :data:`SMALL_OPERAND` elements."""
    return small_count(t.numel())


def small_count(n: int | torch.SymInt) -> bool:
    """``n`` (an int, or a symbolic size in a graph lowering: then only when provably) ≤ SMALL_OPERAND."""
    if isinstance(n, int):
        return n <= SMALL_OPERAND
    return guard_or_false(n <= SMALL_OPERAND)


def gemm_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """What an FP8 GEMM of ``a`` and ``b`` runs in: fp32 when both operands are small, else the CPU GEMM path's
    dtype (:func:`features.gemm_dtype`). The graph lowering (fx_rewriter.lowering) asks too."""
    return torch.float32 if small(a) and small(b) else features.gemm_dtype(a)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """:func:`reference.quantize`, bit for bit: one pass of C where it applies (E4M3, one scale or one per row)."""
    if fmt is FP8Format.E4M3:
        q = cpu_e4m3.quantize_e4m3(x, scale)
        if q is not None:
            return q
    return reference.quantize(x, scale, fmt)


dequantize = reference.dequantize
dynamic_scale = reference.dynamic_scale


def dynamic_quantize(x: torch.Tensor, fmt: FP8Format, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.dynamic_quantize`, bit for bit: amax, scale and quantize in one C call where it applies."""
    if fmt is FP8Format.E4M3:
        done = cpu_e4m3.dynamic_quantize_e4m3(x, per_token)
        if done is not None:
            return done
    return reference.dynamic_quantize(x, fmt, per_token, quantize)


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
    """:func:`reference.fp8_linear` (same arguments) in one of three regimes: small operands (one C call, fp32,
    operands dequantized first), the fp32 GEMM path (operands dequantized first) or the bf16 GEMM path (the
    accumulator scaled in the epilogue, as the reference)."""
    # the C paths read rows in place; a strided input (a transposed batch) would take the torch path, whose sum
    # order differs: the same values would give other bits depending on their layout. One byte per element.
    x_q = x_q if x_q.is_contiguous() else x_q.contiguous()
    residual = residual if residual is None or residual.is_contiguous() else residual.contiguous()
    is_small = small(x_q) and small(w_q)  # what gemm_dtype() decides on, computed once on this hot path
    dtype = torch.float32 if is_small else features.gemm_dtype(x_q)
    if not is_small and _fused_rows(x_q, dtype):
        order = cpu_e4m3.SCALES_FIRST if dtype == torch.bfloat16 else cpu_e4m3.DEQUANTIZE_FIRST
        y = cpu_e4m3.fp8_gemm(x_q, x_scale, w_q, w_scale, None if bias is None else bias.float(), order)
        if y is not None:
            if activation in _IN_PLACE:  # y is this call's own fp32 tensor, outside autograd: see _IN_PLACE
                y, activation = _IN_PLACE[activation](y), None
            return linear_epilogue(y, activation, residual, out_dtype, out_scale, out_fmt, quantize)
    if dtype == torch.float32:  # operands dequantized first (see dequantize_operand)
        if is_small:  # one C call instead of a dozen torch ops, where it applies
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
                    return linear_epilogue(y, activation, residual, out_dtype, out_scale, out_fmt, quantize)
        y = F.linear(dequantize_operand(x_q, x_scale),
                     dequantize_operand(w_q, w_scale.reshape(-1, 1) if w_scale.dim() else w_scale, reuse_buffer=True),
                     None if bias is None else bias.float())
        return linear_epilogue(y, activation, residual, out_dtype, out_scale, out_fmt, quantize)
    if activation in GATED and dtype == torch.bfloat16:  # two GEMMs: each half rounds as its own linear would
        n = w_q.shape[0] // 2
        x_u = fp8_upcast(x_q, dtype)
        acc = torch.cat([F.linear(x_u, fp8_upcast(w_q[:n], dtype, reuse_buffer=True)),
                         F.linear(x_u, fp8_upcast(w_q[n:], dtype, reuse_buffer=True))], dim=-1)
    else:
        acc = F.linear(fp8_upcast(x_q, dtype), fp8_upcast(w_q, dtype, reuse_buffer=True))
    y = dequantize_accumulator(acc, x_scale * w_scale, bias)  # (…×1)·(N,) broadcasts to the output's scale grid
    return linear_epilogue(y, activation, residual, out_dtype, out_scale, out_fmt, quantize)


# The fused GEMM's activations, applied in place: torch's own elementwise kernel on the same input, so the same
# bits as apply_activation's out-of-place call, without a second output-sized fp32 buffer (at 32 MiniLM sentences
# a 2.9 MB GELU output per layer, fresh pages from the allocator each time: page faults beside the pass itself).
_IN_PLACE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu_,
    "gelu": torch.ops.aten.gelu_,
    "gelu_tanh": functools.partial(torch.ops.aten.gelu_, approximate="tanh"),
    "silu": functools.partial(F.silu, inplace=True),
}


def _fused_rows(x_q: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a (not small) linear of input ``x_q`` has few enough rows for the fused C GEMM on this path."""
    rows = x_q.numel() // max(x_q.shape[-1], 1)
    return x_q.is_cpu and rows <= cpu_e4m3.fused_rows(dtype == torch.bfloat16)


def runs_fused_gemm(x_q: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` runs this linear's GEMM in the fused C kernel (E4M3 decoded in the K loop, fp32
    sums): the inductor lowering then keeps the op as a call (fx_rewriter.lowering), so compiled = eager."""
    if (small(x_q) and small(w_q)) or cpu_e4m3.gemm_isa() is None:
        return False
    return _fused_rows(x_q, features.gemm_dtype(x_q))


def dequantize_operand(q: torch.Tensor, scale: torch.Tensor, reuse_buffer: bool = False) -> torch.Tensor:
    """``q · scale`` in fp32 (``scale``: one value or one per row), each product rounded once: the operand of
    an fp32 GEMM that takes its operands dequantized. The fp32 GEMMs here (the fp32 CPU GEMM path, and small
    GEMMs on either path) work this way rather than scaling the accumulator: it is compressed-tensors' order
    (dequantize the weight, fake-quantize the input, ``F.linear``), so a checkpoint written by
    :func:`dbr_quant.save_pretrained` and reloaded by transformers on a CPU computes the same numbers bit for bit
    from the same FP8 input codes (a small linear's C sum runs in k order, not torch's); and it costs less (the
    scale rides on the upcast pass, the bias on the GEMM). The accumulator order (the reference, the bf16 path,
    the GPU kernels) differs from it by about an fp32 ulp before each FP8 re-quantization. ``reuse_buffer``: as in
    :func:`fp8_to_fp32`."""
    if small(q):  # torch's scalar cast beats the fixed cost of a C call or the bit moves here
        return q.float() * scale.float()
    out = scratch(q.shape, q.device, torch.float32) if reuse_buffer else None
    if q.dtype == torch.float8_e4m3fn:
        values = cpu_e4m3.decode_e4m3_scaled(q, scale, out)
        if values is not None:
            return values
    values = fp8_to_fp32(q, reuse_buffer)
    return values.mul_(scale.float()) if values.shape == torch.broadcast_shapes(values.shape, scale.shape) \
        else values * scale.float()


def fp8_matmul(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """:func:`reference.fp8_matmul`: small operands as the reference computes it, else a GEMM of the upcast
    operands in the CPU GEMM path's dtype (the accumulator scaled afterwards)."""
    if small(a_q) and small(b_q):
        return reference.fp8_matmul(a_q, a_scale, b_q, b_scale)
    dtype = features.gemm_dtype(a_q)
    return torch.matmul(fp8_upcast(a_q, dtype), fp8_upcast(b_q, dtype)).float().mul_(a_scale * b_scale)


def block_operands(x_q: torch.Tensor, w_q: torch.Tensor, whole_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block GEMM's operands (:data:`reference_block.Operands`) upcast to the dtype :func:`gemm_dtype` picks for
    the whole weight (both halves of a gated one run as the ungated GEMM of it would); the weight into scratch."""
    dtype = gemm_dtype(x_q, whole_w)
    return fp8_upcast(x_q, dtype), fp8_upcast(w_q, dtype, reuse_buffer=True)


# The reference's code with this backend's pieces plugged in (its GEMMs, upcasts and quantize); the rest of the
# block-scaled kernels (group quantize: a scale per element, which the C quantize does not index) are the
# reference's own.
layer_norm_quantize = functools.partial(reference.layer_norm_quantize, quantize=quantize)
fp8_attention = functools.partial(reference.fp8_attention, matmul=fp8_matmul, quantize=quantize)
fp8_block_linear = functools.partial(reference_block.fp8_block_linear, operands=block_operands, quantize=quantize)
group_quantize = reference_block.group_quantize
layer_norm_group_quantize = reference_block.layer_norm_group_quantize
moe_quantize = functools.partial(reference_grouped.moe_quantize, quantize=quantize)
fp8_grouped_linear = functools.partial(reference_grouped.fp8_grouped_linear, linear=fp8_linear)
fp8_grouped_block_linear = functools.partial(reference_grouped.fp8_grouped_block_linear,
                                             block_linear=fp8_block_linear)
mx_quantize = reference_mx.mx_quantize  # a scale per element, as group_quantize
fp8_mx_linear = functools.partial(reference_mx.fp8_mx_linear, operands=block_operands, quantize=quantize)



def weight_only_gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
                     ) -> torch.Tensor:
    """:data:`reference_weight_only.WeightOnlyGemm` here: bf16 x on the bf16 GEMM path multiplies W upcast exactly to
    bf16 (the accumulator scaled after, as the reference); anything else is an fp32 GEMM on W dequantized first
    (:func:`dequantize_operand`, compressed-tensors' order). x itself is never rounded."""
    if x.dtype == torch.bfloat16 and gemm_dtype(x, w_q) == torch.bfloat16:
        return dequantize_accumulator(F.linear(x, fp8_upcast(w_q, torch.bfloat16, reuse_buffer=True)), w_scale, bias)
    w = dequantize_operand(w_q, w_scale.reshape(-1, 1) if w_scale.numel() > 1 else w_scale.reshape(()),
                           reuse_buffer=True)
    return F.linear(x.float(), w, None if bias is None else bias.float())


fp8_weight_only_linear = functools.partial(reference_weight_only.fp8_weight_only_linear, gemm=weight_only_gemm,
                                           quantize=quantize)
fp8_grouped_weight_only_linear = functools.partial(reference_grouped.fp8_grouped_weight_only_linear,
                                                   linear=fp8_weight_only_linear)
fp8_grouped_mx_linear = functools.partial(reference_grouped.fp8_grouped_mx_linear, mx_linear=fp8_mx_linear)
