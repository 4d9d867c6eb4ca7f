"""The Triton FP8 rounding helpers, in the interpreter, against torch's cast bit for bit, and compiled
ahead of time for Hopper and Ada (no GPU needed)."""

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.triton.common import Kernel, fp8_bits, fp8_constants, reciprocal_rn, round_to_fp8


def _quantize_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                     MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask)
    r = round_to_fp8(x, FP8_MAX, MANTISSA_BITS, MIN_NORMAL)
    tl.store(y_ptr + offs, fp8_bits(r, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS), mask=mask)


KERNEL = Kernel(_quantize_kernel)
SPECIAL = [126.7, 448, 449, 463.99, 464, 465, 1e9, -1e9, 0.0, -0.0, 2**-7, 2**-10, 3 * 2**-10, 1.5 * 2**-16,
           57344, 61440, 1e6, float("inf"), float("-inf"), 2**-9 * 0.5, 2**-9 * 1.5, -(2**-9) * 2.5]


@pytest.mark.parametrize("fmt", [FP8Format.E4M3, FP8Format.E5M2])
def test_round_to_fp8_matches_torch_cast_bit_for_bit(fmt):
    torch.manual_seed(0)
    x = torch.cat([torch.randn(4096) * 10, torch.randn(4096) * 1e-3, torch.randn(4096) * 1e-6,
                   torch.rand(4096) * fmt.max * 1.2, torch.tensor(SPECIAL)])
    # every fp32 bit pattern class: also a sweep of raw bit patterns over the whole finite range
    raw = torch.randint(0, 2**31 - 2**23, (8192,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([x, raw, -raw])
    y = torch.empty(x.numel(), dtype=fmt.dtype)
    with use_backend("triton-interpret"):
        KERNEL[(triton.cdiv(x.numel(), 1024),)](x, y.view(torch.uint8), x.numel(), BLOCK=1024,
                                                 **fp8_constants(fmt))
    want = x.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    assert torch.equal(y.view(torch.uint8), want.view(torch.uint8))
    carry = x.numel() - len(SPECIAL) - 2 * raw.numel()  # 126.7: the case Triton's own cast gets wrong
    assert x[carry].item() == pytest.approx(126.7) and y[carry].float().item() == 128.0


@pytest.mark.parametrize("arch", [90, 89])
def test_rounding_kernel_compiles_for_hopper_and_ada(arch):
    sig = {"x_ptr": "*fp32", "y_ptr": "*u8", "N": "i32", "BLOCK": "constexpr", "FP8_MAX": "constexpr",
           "MANTISSA_BITS": "constexpr", "MIN_NORMAL": "constexpr", "EXP_BIAS": "constexpr"}
    src = triton.compiler.ASTSource(fn=KERNEL.jit, signature=sig,
                                    constexprs={"BLOCK": 1024, **fp8_constants(FP8Format.E4M3)})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    assert f".target sm_{arch}" in compiled.asm["ptx"]


def _reciprocal_kernel(s_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(y_ptr + offs, reciprocal_rn(tl.load(s_ptr + offs, mask=mask, other=1.0)), mask=mask)


RECIPROCAL = Kernel(_reciprocal_kernel)


def test_reciprocal_rn_is_torch_reciprocal_bit_for_bit():
    """The kernels multiply by reciprocal_rn(scale) where the reference multiplies by torch.reciprocal(scale)."""
    torch.manual_seed(0)
    # raw bit patterns over the positive normal range, plus scales as observers make them
    raw = torch.randint(2**23, 2**31 - 2**23, (16384,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    s = torch.cat([raw, torch.rand(4096) * 10, torch.tensor([1.0, 3.0, 448.0, 1 / 448, 2.0**-126, 2.0**126])])
    y = torch.empty_like(s)
    with use_backend("triton-interpret"):
        RECIPROCAL[(triton.cdiv(s.numel(), 1024),)](s, y, s.numel(), BLOCK=1024)
    assert torch.equal(y.view(torch.int32), torch.reciprocal(s).view(torch.int32))


def test_reciprocal_rn_compiles_to_ieee_division():
    """On the GPU the same bits need IEEE division: PTX div.rn.f32, not the approximate div.full.f32 that
    Triton emits for ``/`` (tests/gpu checks the bits on a device)."""
    src = triton.compiler.ASTSource(fn=RECIPROCAL.jit, signature={"s_ptr": "*fp32", "y_ptr": "*fp32", "N": "i32",
                                                                  "BLOCK": "constexpr"}, constexprs={"BLOCK": 1024})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
