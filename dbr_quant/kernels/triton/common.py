"""Shared pieces of the Triton kernels: exact FP8 rounding and launching compiled or interpreted.

Triton's own float→fp8 cast is not trusted: in the interpreter it drops a carry (126.7 → 64, not
128) and on sm_89 it rounds twice (via fp16). :func:`round_to_fp8` rounds onto the FP8 grid in fp32
(round-to-nearest-even, saturating), after which the cast only converts exactly representable values.
The result matches ``torch.Tensor.to(torch.float8_e4m3fn / e5m2)`` after clamping, bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.dispatch import current_backend


class device_function(triton.runtime.JITFunction):  # noqa: N801 - used as a decorator, like triton.jit
    """``@triton.jit`` for helpers called from kernels that must also run in the interpreter.

    Compiled, the kernel's code generator inlines it like any jit function. Interpreted without the
    TRITON_INTERPRET variable, a plain JITFunction refuses to be called; this one runs its Python body
    (the interpreter has patched ``tl`` by then).
    """

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


@device_function
def reciprocal_rn(scale):
    """``1 / scale`` rounded to nearest (IEEE ``div.rn``; a GPU's fp32 ``/`` is the approximate ``div.full``):
    torch.reciprocal's bits, the factor reference.quantize multiplies by. Computed in the kernel from the
    scale itself, so a wrapper launches no reciprocal of its own per call."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@device_function
def round_to_fp8(x, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """fp32 ``x`` → the nearest FP8 value (ties to even), saturated to ±FP8_MAX, still as fp32.

    Normal range: round the fp32 mantissa to MANTISSA_BITS bits with integer arithmetic (a carry into
    the exponent is the correct result). Subnormal range (|x| < MIN_NORMAL): the grid is uniform with
    step MIN_NORMAL / 2**MANTISSA_BITS; adding and subtracting 1.5·2**23 rounds to it (ties to even).
    """
    x = tl.clamp(x, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    drop: tl.constexpr = 23 - MANTISSA_BITS
    bits = x.to(tl.uint32, bitcast=True)
    half: tl.constexpr = (1 << (drop - 1)) - 1
    keep: tl.constexpr = 0xFFFFFFFF ^ ((1 << drop) - 1)  # clears the dropped mantissa bits
    lsb = (bits >> drop) & 1
    normal = ((bits + half + lsb) & keep).to(tl.float32, bitcast=True)
    step_inv: tl.constexpr = (2**MANTISSA_BITS) / MIN_NORMAL
    step: tl.constexpr = MIN_NORMAL / (2**MANTISSA_BITS)  # powers of two: both multiplies are exact
    magic: tl.constexpr = 12582912.0  # 1.5 * 2**23: fp32 spacing 1 around it
    a = tl.abs(x)
    sub = ((a * step_inv + magic) - magic) * step  # (a GPU fp32 "/" would be the approximate div.full)
    # put the sign bit back with integer ops: Triton's unary minus is 0 - x, which turns -0.0 into +0.0
    sub = (sub.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(a < MIN_NORMAL, sub, normal)


@device_function
def fp8_bits(v, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    """The FP8 byte (uint8) of an fp32 value already on the FP8 grid (from :func:`round_to_fp8`).

    Built with integer ops so no float→fp8 conversion is involved at all: kernels store it through a
    uint8 view of the FP8 output. (The interpreter's cast also loses the sign of -0.0.)
    """
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127 + EXP_BIAS
    mantissa = ((bits >> (23 - MANTISSA_BITS)) & ((1 << MANTISSA_BITS) - 1)).to(tl.int32)
    normal = (tl.maximum(exponent, 0) << MANTISSA_BITS) | mantissa
    a = tl.abs(v)
    steps: tl.constexpr = (2**MANTISSA_BITS) / MIN_NORMAL
    subnormal = (tl.minimum(a, MIN_NORMAL) * steps).to(tl.int32)  # exact below MIN_NORMAL; no int overflow
    code = tl.where(a < MIN_NORMAL, subnormal, normal)
    return (code.to(tl.uint32) | sign).to(tl.uint8)


_FP8_CONSTANTS: dict[FP8Format, Mapping[str, float | int]] = {
    FP8Format.E4M3: MappingProxyType({"FP8_MAX": 448.0, "MANTISSA_BITS": 3, "MIN_NORMAL": 2.0**-6, "EXP_BIAS": 7}),
    FP8Format.E5M2: MappingProxyType({"FP8_MAX": 57344.0, "MANTISSA_BITS": 2, "MIN_NORMAL": 2.0**-14, "EXP_BIAS": 15}),
}


def fp8_constants(fmt: FP8Format) -> Mapping[str, float | int]:
    """The constexpr arguments of :func:`round_to_fp8` / :func:`fp8_bits` for a format (read-only: shared by
    every launch)."""
    return _FP8_CONSTANTS[FP8Format.E4M3] if fmt is FP8Format.E4M3 else _FP8_CONSTANTS[FP8Format.E5M2]


def on_interpreter() -> bool:
    return current_backend() == "triton-interpret"


class Kernel:
    """One Triton kernel, launchable compiled (``triton``) or in the CPU interpreter (``triton-interpret``).

    The interpreter is chosen per launch from the current backend, so one process can run both (the
    environment variable TRITON_INTERPRET is not needed).

    ``do_not_specialize`` names int arguments the JIT is not to specialize. Triton compiles a separate
    variant for every int argument equal to 1 (it becomes a constexpr). For unit strides along K and N that
    is wanted (contiguous → vector loads and cp.async pipelining), and the GEMM wrappers guarantee them; for
    M (= 1 when decoding) or scale strides (0 or 1: per-tensor or per-row) it would only multiply the
    variants, so the GEMMs list those and the modules' ``AOT_CONFIGS`` hold exactly the variants launched.
    """

    def __init__(self, fn: Callable[..., None], do_not_specialize: tuple[str, ...] = ()) -> None:
        self.fn = fn
        self.jit = triton.jit(fn, do_not_specialize=do_not_specialize)

    @functools.cached_property
    def interpreted(self) -> InterpretedFunction:
        return InterpretedFunction(self.fn)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]:
        return (self.interpreted if on_interpreter() else self.jit)[grid]


# one row of a kernel module's AOT_CONFIGS (read by kernels.triton.aot): (kernel name, description, kernel,
# ASTSource signature, constexprs)
AotEntry = tuple[str, str, Kernel, dict[str, str], dict[str, object]]


def check_device(*tensors: torch.Tensor | None) -> None:
    """The interpreter runs on CPU tensors, the compiled kernels on CUDA ones. (``is_cpu``/``is_cuda`` rather
    than ``t.device.type``: a ``torch.device`` object per tensor per launch is host time.)"""
    interpreted = on_interpreter()
    for t in tensors:
        if t is not None and not (t.is_cpu if interpreted else t.is_cuda):
            want = "cpu" if interpreted else "cuda"
            raise RuntimeError(f"backend {current_backend()!r} needs {want} tensors, got one on {t.device}")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints: ``triton.cdiv`` is a constexpr function, which costs microseconds per host call."""
    return -(-a // b)
