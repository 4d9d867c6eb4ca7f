"""How ``torch.compile`` (inductor) sees the ``dbr_quant`` custom ops on the CPU backend (kernels.cpu.backend).

Opaque, the custom ops cost what eager costs: every quantize, weight upcast and epilogue is its own
pass over memory, and inductor cannot fuse across them. So for tensors that run on the CPU
backend we register a *decomposition* of each op with inductor: the same math in plain aten ops that
inductor fuses into the neighbouring LayerNorm / GELU / residual kernels and vectorizes.

The one trick: CPU code has no vector FP8 conversion (inductor emits a scalar loop for
``.to(float8_e4m3fn)``, slower than eager). Here FP8 is rounded and encoded with fp32 and integer
arithmetic only — round to the FP8 grid with ``torch.round`` (half to even) at the spacing of the
value's binade, then build the byte from the fp32 bits — and decoded back the same way. Both are
bit-identical to ``Tensor.to(float8)`` / the reference upcast (tests compare every byte value).

Numerics under compile: the GEMMs are the CPU backend's, in the dtype of the CPU GEMM path
(``kernels.cpu``: exact FP8 operands in bf16 or fp32, fp32 accumulate, a bf16 or fp32 result) that is
current when inductor compiles the graph (at the first call: the choice is baked into the compiled code,
dynamo does not guard on it). inductor may contract ``acc·scale + bias`` into an FMA and reorders
LayerNorm's sums, so the compiled model is close to eager, not bit-equal — the same contract as compiling any model.
On CUDA (the Triton backend) and under ``use_backend("reference")`` nothing is decomposed: the ops stay calls to
that backend's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3
from dbr_quant.kernels.dispatch import resolve_backend
from dbr_quant.kernels.reference import dense as reference


def round_to_grid(y: Tensor, fmt: FP8Format) -> Tensor:
    """Round fp32 ``y`` (already within ±fmt.max) to the nearest FP8 value, ties to even, in fp32.

    Normal range: Veltkamp's split — ``c = y·(2**s + 1); hi = c − (c − y)`` leaves ``y`` rounded to
    24 − s significant bits, here 1 + mantissa_bits; pure float arithmetic, so inductor vectorizes it
    (bit casts cost a store/reload per vector in its C++). Ties are settled by fp32's own
    round-half-even: tests check every FP8 midpoint. Subnormal range (fixed spacing): adding and
    subtracting 1.5·2**23·spacing rounds to a multiple of the spacing. Both need the compiler to keep
    each fp32 operation as written: no FMA contraction, no unsafe-math reassociation — inductor's
    defaults; with either switched on we fall back to :func:`round_to_grid_bits`.
    """
    if not _float_ops_kept_as_written():
        return round_to_grid_bits(y, fmt)
    c = y * float(2 ** (23 - fmt.mantissa_bits) + 1)
    normal = c - (c - y)
    step = 2.0 ** (1 - fmt.exponent_bias - fmt.mantissa_bits)  # spacing of the subnormals
    magic = 1.5 * 2.0**23 * step
    subnormal = (y + magic) - magic
    return torch.where(y.abs() < 2.0 ** (1 - fmt.exponent_bias), subnormal, normal)


def _float_ops_kept_as_written() -> bool:
    from torch._inductor import config

    return (config.cpp.enable_floating_point_contract_flag == "off"
            and not config.cpp.enable_unsafe_math_opt_flag)


def round_to_grid_bits(y: Tensor, fmt: FP8Format) -> Tensor:
    """:func:`round_to_grid` from the exponent bits: the spacing of FP8 values in y's binade is
    2**(exponent − mantissa_bits), constant below the smallest normal; dividing by a power of two is
    exact, so ``round(y / ulp) · ulp`` is correctly rounded whatever the compiler contracts."""
    exponent = (y.view(torch.int32) >> 23) & 0xFF
    min_normal = 128 - fmt.exponent_bias  # fp32 biased exponent of fmt's smallest normal
    ulp = ((exponent.clamp(min=min_normal) - fmt.mantissa_bits) << 23).view(torch.float32)
    return torch.round(y / ulp) * ulp


def encode(q: Tensor, fmt: FP8Format, sign_of: Tensor | None = None) -> Tensor:
    """FP8 values held in fp32 (on the grid, NaN allowed) → the FP8 tensor, by integer ops on the bits.
    ``sign_of``: the unrounded values, whose sign a value rounded to zero keeps (−tiny → −0, as torch)."""
    bits = q.view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    m, rebias = fmt.mantissa_bits, 127 - fmt.exponent_bias
    normal = (magnitude >> (23 - m)) - (rebias << m)  # exponent and top mantissa bits, re-biased
    subnormal = (q.abs() * 2.0 ** (fmt.exponent_bias - 1 + m)).to(torch.int32)  # whole multiples of the step
    code = torch.where(magnitude >= ((rebias + 1) << 23), normal, subnormal)
    sign_bits = bits if sign_of is None else sign_of.view(torch.int32)
    code = code | ((sign_bits >> 24) & 0x80)  # the sign (the shift is arithmetic: 0xFF… for negative q)
    code = code.masked_fill(q != q, 0x7F)  # NaN as torch's cast writes it (the sign of a NaN is not kept)
    return code.to(torch.uint8).view(fmt.dtype)


def decode(q: Tensor) -> Tensor:
    """FP8 → fp32 values by integer ops (E4M3's NaN code comes out as ±480, as in reference.e4m3_to_bf16)."""
    fmt = FP8Format.of(q.dtype)
    code = q.view(torch.uint8).to(torch.int32)
    magnitude = code & 0x7F
    m, rebias = fmt.mantissa_bits, 127 - fmt.exponent_bias
    normal = ((magnitude << (23 - m)) + (rebias << 23)).view(torch.float32)
    subnormal = magnitude.float() * 2.0 ** (1 - fmt.exponent_bias - m)
    value = torch.where(magnitude < (1 << m), subnormal, normal)
    return torch.where(code >= 0x80, -value, value)


# FP8 tensor made by a lowering below → its values in fp32. A GEMM lowering that consumes it reads these
# instead of decoding the bytes again (decode(encode(v)) == v), so inside inductor's fused kernels an
# activation is rounded onto the FP8 grid and never packed into bytes at all unless something else
# needs the bytes. Keyed by the identity of the traced (fake) tensor; an entry dies with its tensor.
# (Not a WeakKeyDictionary: that compares keys with ==, which on tensors is elementwise.)
_GRID_VALUES: dict[int, tuple[weakref.ref, Tensor]] = {}


def _remember_grid_values(q: Tensor, values: Tensor) -> None:
    _GRID_VALUES[id(q)] = (weakref.ref(q), values)
    weakref.finalize(q, _GRID_VALUES.pop, id(q), None)


def _grid_values(q: Tensor) -> Tensor | None:
    entry = _GRID_VALUES.get(id(q))
    return entry[1] if entry is not None and entry[0]() is q else None


def quantize(x: Tensor, scale: Tensor, fmt: FP8Format) -> Tensor:
    """reference.quantize without the FP8 cast: saturate ``x · (1/scale)``, round on the grid, encode."""
    y = (x.float() * torch.reciprocal(scale.float())).clamp(-fmt.max, fmt.max)
    values = round_to_grid(y, fmt)
    q = encode(values, fmt, sign_of=y)
    # the cache serves inductor's lowering; under Dynamo (this function compiled on its own) tracing
    # weakref.finalize can meet a finalizer the GC runs meanwhile ("dictionary changed size during iteration")
    if not torch.compiler.is_dynamo_compiling():
        _remember_grid_values(q, values)
    return q


_UPCAST_OPS = {torch.bfloat16: "fp8_to_bf16", torch.float32: "fp8_to_fp32"}


def _gemm_operand(q: Tensor, dtype: torch.dtype) -> Tensor:
    """The exact GEMM operand in ``dtype`` (the CPU GEMM path's): the grid values if a lowering made ``q``,
    else the fast upcast (weights: graph inputs, which inductor would decode an order of magnitude slower
    than eager)."""
    values = _grid_values(q)
    if values is not None:
        return values.to(dtype)  # exact: every FP8 value is a bf16 and an fp32 value
    return getattr(torch.ops.dbr_quant, _UPCAST_OPS[dtype])(q)


def fp8_linear(x_q, x_scale, w_q, w_scale, bias, activation, residual, out_dtype, out_scale, out_fmt) -> Tensor:
    dtype = cpu_backend.gemm_dtype(x_q, w_q)
    if dtype == torch.float32:  # operands dequantized first, as cpu_backend.dequantize_operand
        w_rows = w_scale.reshape(-1, 1) if w_scale.dim() else w_scale
        y = F.linear(_gemm_operand(x_q, dtype) * x_scale.float(), _gemm_operand(w_q, dtype) * w_rows.float(),
                     None if bias is None else bias.float())
    else:
        acc = F.linear(_gemm_operand(x_q, dtype), _gemm_operand(w_q, dtype))  # fp32 accumulation, as the reference
        y = reference.dequantize_accumulator(acc, x_scale * w_scale, bias)
    return reference.linear_epilogue(y, activation or None, residual, out_dtype, out_scale,
                                     FP8Format.parse(out_fmt), quantize=quantize, inplace=False)


def fp8_mlp(x_q, x_scale, w1_q, w1_scale, b1, activation, h_scale, h_fmt, w2_q, w2_scale, b2, residual,
            out_dtype) -> Tensor:
    h = fp8_linear(x_q, x_scale, w1_q, w1_scale, b1, activation, None, out_dtype, h_scale, h_fmt)
    return fp8_linear(h, h_scale, w2_q, w2_scale, b2, "", residual, out_dtype, None, h_fmt)


def fp8_matmul(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor) -> Tensor:
    dtype = cpu_backend.gemm_dtype(a_q, b_q)
    return torch.matmul(_gemm_operand(a_q, dtype), _gemm_operand(b_q, dtype)).float() * (a_scale * b_scale)


def layer_norm_quantize(x, weight, bias, eps, scale, fmt, rms) -> tuple[Tensor, Tensor]:
    return reference.layer_norm_quantize(x, weight, bias, eps, scale, FP8Format.parse(fmt), rms=rms,
                                         quantize=quantize)


def fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, attn_mask, is_causal, softmax_scale, p_scale,
                  fmt) -> Tensor:
    return reference.fp8_attention(q_q, q_scale, k_q, k_scale, v_q, v_scale, attn_mask=attn_mask,
                                   is_causal=is_causal, softmax_scale=softmax_scale, p_scale=p_scale,
                                   fmt=FP8Format.parse(fmt), matmul=fp8_matmul, quantize=quantize)


def dynamic_quantize(x: Tensor, fmt: str, per_token: bool) -> tuple[Tensor, Tensor]:
    scale = reference.dynamic_scale(x, FP8Format.parse(fmt), per_token)
    return quantize(x, scale, FP8Format.parse(fmt)), scale


def _quantize_op(x: Tensor, scale: Tensor, fmt: str) -> Tensor:
    return quantize(x, scale, FP8Format.parse(fmt))


def _dequantize_op(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (decode(q) * scale.float()).to(dtype)


def _dynamic_scale_op(x: Tensor, fmt: str, per_token: bool) -> Tensor:
    return reference.dynamic_scale(x, FP8Format.parse(fmt), per_token)


def _on_cpu_backend(fn):
    """Decompose only where eager would run the CPU backend; elsewhere (CUDA → Triton; the plain reference, forced
    by use_backend("reference")) the op stays a call to that backend's kernel."""
    @functools.wraps(fn)
    def maybe(*args, **kwargs):
        if resolve_backend(args[0].device) != "cpu":
            return NotImplemented
        return fn(*args, **kwargs)
    return maybe


def _small_gemm(a: Tensor, b: Tensor) -> bool:
    """Both operands small (static sizes): eager runs such a GEMM as one C call (cpu_e4m3.small_linear), whose
    sum order inductor's GEMM would not reproduce, so the op stays as it is in the graph (the same kernel)."""
    return cpu_backend.small(a) and cpu_backend.small(b)


def _kept_as_call(x_q: Tensor, w_q: Tensor) -> bool:
    """Eager runs this linear's GEMM in a C kernel inductor's GEMM would not reproduce (the small-operand call, or
    the fused FP8 GEMM: fp32 sums of exact products, where the decomposition's bf16 GEMM would round the result):
    the op stays a call in the graph, the same kernel as eager. Except the fused GEMM under freezing
    (``compile_frozen``): there the weights are constants, inductor folds their upcast and hands oneDNN packed
    bf16 weights, the fastest CPU path that wrapper exists for (measured: keeping the call made frozen MiniLM 1.1-1.6×
    bf16's frozen compile), at the price it documents (bf16 weight copies, the GEMM result rounded to bf16)."""
    from torch._inductor import config as inductor_config  # loaded by now: this runs inside inductor's lowering

    if _small_gemm(x_q, w_q):
        return True
    return not inductor_config.freezing and cpu_backend.runs_fused_gemm(x_q, w_q)


def _fp8_linear_op(x_q, x_scale, w_q, w_scale, *args):
    if _kept_as_call(x_q, w_q):
        return NotImplemented
    return fp8_linear(x_q, x_scale, w_q, w_scale, *args)


def _fp8_mlp_op(x_q, x_scale, w1_q, w1_scale, b1, activation, h_scale, h_fmt, w2_q, *args):
    hidden = x_q.numel() // x_q.shape[-1] * w2_q.shape[-1]  # fc2's input size
    # fc2 has fc1's rows, so the fused GEMM takes both or neither (what decides is the row count and the path)
    if _kept_as_call(x_q, w1_q) or (cpu_backend.small_count(hidden) and cpu_backend.small(w2_q)):
        return NotImplemented
    return fp8_mlp(x_q, x_scale, w1_q, w1_scale, b1, activation, h_scale, h_fmt, w2_q, *args)


LOWERINGS = {
    "quantize": _quantize_op,
    "dequantize": _dequantize_op,
    "dynamic_scale": _dynamic_scale_op,
    "dynamic_quantize": dynamic_quantize,
    "fp8_linear": _fp8_linear_op,
    "fp8_mlp": _fp8_mlp_op,
    "layer_norm_quantize": layer_norm_quantize,
    "fp8_matmul": fp8_matmul,
    "fp8_attention": fp8_attention,
}


@functools.cache
def _package_digest() -> str:
    """A digest of this package's source (Python and C), read once per process: a compile cached on disk by
    another dbr_quant (whose lowering decided differently) is not handed back."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def lowering_cache_key(path: str) -> str:
    """What the lowerings decide with, besides the graph (which torch.compile's caches key on): the CPU GEMM
    ``path``; whether the C kernels run and the fused GEMM's code path and row limits (which linears stay calls,
    :func:`_kept_as_call`); the small-operand threshold; this package's source."""
    active, _ = cpu_e4m3.status()
    return (f"dbr_quant_cpu_gemm={path}|c={int(active)}|fused={cpu_e4m3.gemm_isa()}:"
            f"{cpu_e4m3.fused_rows(True)}:{cpu_e4m3.fused_rows(False)}|small={cpu_backend.SMALL_OPERAND}|"
            f"src={_package_digest()}")


_registered = False


def ensure_lowerings() -> None:
    """Register the inductor lowerings the first time any ``dbr_quant::`` op is traced (every fake calls this).

    Not at import: importing inductor's decomposition table costs ~1.5 s, and ``import dbr_quant`` defines
    the ops (so a saved ExportedProgram loads). Every path to inductor traces the ops with fake tensors
    (dynamo, export) before inductor picks its decomposition table, so registering here is in time."""
    global _registered
    if not _registered:
        _registered = True
        register_inductor_lowerings()


def register_inductor_lowerings() -> None:
    """Add the decompositions to inductor's table (idempotent); see :func:`ensure_lowerings`."""
    from torch._inductor import decomposition
    from torch._inductor import lowering as inductor_lowering

    for name, fn in LOWERINGS.items():
        op = getattr(torch.ops.dbr_quant, name).default
        if op not in decomposition.decompositions:
            decomposition.register_decomposition(op)(_on_cpu_backend(fn))
        # where a decomposition declines (returns NotImplemented: small GEMMs, CUDA), inductor calls the op
        # itself; it refuses to create that fallback on the fly for an op that has a decomposition, so it
        # is registered here, explicitly allowed to coexist with the decomposition
        if op not in inductor_lowering.lowerings:
            inductor_lowering.make_fallback(op, warn=False, override_decomp=True)
    # inductor caches a copy of its table on first use; a model compiled before this import would keep
    # the stale copy, so drop it (a private cache: guarded, as its name may move between releases)
    clear = getattr(getattr(decomposition, "fast_random_decomps", None), "cache_clear", None)
    if clear is not None:
        clear()
