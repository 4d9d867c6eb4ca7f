"""MXFP8 reference (kernels.reference.mx) and the CPU backend's MX GEMM against independent computations.

* Scale codes: per 32-element block, from ``math.frexp`` of the block's amax (Python floats, one block at a time):
  ``floor(log2(amax)) = frexp exponent - 1``, minus 8 for E4M3 (15 for E5M2), clamped to [-127, 127], +127; zero
  blocks 127. Also the OCP floor rule through ``torch.log2`` where that is exact (amax a normal fp32).
* Quantization bit for bit against torch's cast of ``(x · 2^-e).clamp(±max)`` with each element's exponent looked
  up by index; values between 448·scale and 512·scale saturate (the documented choice).
* The E8M0 decode against ``2.0 ** (code - 127)`` in fp64, for all 255 finite codes.
* The GEMM against an fp64 dequantize-then-matmul; the CPU backend's fp32 path equals the reference bit for bit.
* compressed-tensors' own decoder (``decompress_mx_scale``) reads our codes as the same scales.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.cpu.features import use_cpu_gemm
from dbr_quant.kernels.reference import mx as RM

FORMATS = list(FP8Format)


def loop_codes(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """E8M0 codes block by block with Python's frexp (independent of the bit extraction under test)."""
    emax = {FP8Format.E4M3: 8, FP8Format.E5M2: 15}[fmt]
    rows = x.reshape(-1, x.shape[-1]).double()
    kb = math.ceil(x.shape[-1] / 32)
    out = torch.empty(rows.shape[0], kb, dtype=torch.uint8)
    for r in range(rows.shape[0]):
        for b in range(kb):
            blk = rows[r, b * 32:(b + 1) * 32]
            blk = blk[torch.isfinite(blk)]
            amax = float(blk.abs().max()) if blk.numel() else 0.0
            if amax == 0.0:
                out[r, b] = 127
                continue
            _, e = math.frexp(amax)  # amax = m·2^e, m in [0.5, 1): floor(log2 amax) = e - 1
            out[r, b] = min(max(e - 1 - emax, -127), 127) + 127
    return out.reshape(*x.shape[:-1], kb)


def values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(3, 64), (5, 70), (2, 3, 33), (1, 31)])
def test_codes_match_frexp_per_block(fmt, shape):
    x = values(shape, 0)
    if x.numel():
        x.view(-1)[::17] = 0.0
    _, code = RM.mx_quantize(x, fmt)
    assert code.dtype == torch.uint8 and code.shape == (*shape[:-1], math.ceil(shape[-1] / 32))
    assert torch.equal(code, loop_codes(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_bit_for_bit_with_torch_cast(fmt):
    x = values((6, 100), 1)
    x[0, :32] = 0.0  # an all-zero block: scale 1
    x[1, 3], x[2, 40], x[3, 70] = float("inf"), float("-inf"), float("nan")  # ignored by the amax
    q, code = RM.mx_quantize(x, fmt)
    e = code.to(torch.int32).repeat_interleave(32, -1)[:, :100] - 127
    want = (x.double() * torch.exp2(-e.double())).clamp(-fmt.max, fmt.max).float().to(fmt.dtype)
    same = (q.view(torch.uint8) == want.view(torch.uint8)) | (torch.isnan(q.float()) & torch.isnan(want.float()))
    assert bool(same.all())
    assert code[0, 0] == 127 and torch.equal(q[0, :32].float(), torch.zeros(32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_ceil_rule_is_the_smallest_scale_that_saturates_nothing(fmt):
    x = values((6, 96), 3)
    x[0, :32] = 0.0
    x[1, :32] = torch.rand(32) * 0.01
    x[1, 0] = fmt.max * 2.0**-3  # exactly fmt.max·2^e: stays on the floor rule's code
    x[2, 32:64] = torch.rand(32) * 0.01
    x[2, 32] = torch.nextafter(torch.tensor(fmt.max), torch.tensor(math.inf)) * 2.0**-3  # just above: one code up
    q, code = RM.mx_quantize(x, fmt, round_up=True)
    floor_code = loop_codes(x, fmt)
    amax = x.abs().reshape(6, 3, 32).amax(-1).double()
    scale = torch.exp2(floor_code.double() - 127)
    want = floor_code + ((amax > fmt.max * scale) & (amax > 0)).to(torch.uint8)  # one binade up where floor saturates
    assert torch.equal(code, want)
    assert code[1, 0] == floor_code[1, 0] and code[2, 1] == floor_code[2, 1] + 1
    e = code.to(torch.int32).repeat_interleave(32, -1) - 127
    assert bool(((x.double() * torch.exp2(-e.double())).abs() <= fmt.max).all())  # nothing saturates
    want_q = (x.double() * torch.exp2(-e.double())).float().to(fmt.dtype)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_floor_rule_saturates_above_448_times_scale():
    """amax = 1.9·2^k: scale 2^(k-8), amax/scale = 486.4 > 448 saturates to 448 (OCP floor, torchao FLOOR)."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 1.9 * 2.0**5, 1.0 * 2.0**5
    q, code = RM.mx_quantize(x)
    assert code.item() == 127 + 5 - 8
    assert q[0, 0].float().item() == 448.0 and q[0, 1].float().item() == 256.0
    # the torch.log2 form of the rule (exact for normal fp32 amax)
    amax = x.abs().amax()
    assert code.item() == int(torch.floor(torch.log2(amax)).item()) - 8 + 127


def test_scale_exponent_clamps_to_e8m0_range():
    x = torch.tensor([[2.0**-140, 0.0], [3.0e38, 1.0]]).repeat_interleave(16, -1)
    _, code = RM.mx_quantize(x)
    assert code.tolist() == [[0], [127 + 127 - 8]]


def test_e8m0_decode_is_exact():
    codes = torch.arange(0, 255, dtype=torch.uint8)
    got = RM.e8m0_to_float(codes).double()
    assert torch.equal(got, torch.exp2(codes.double() - 127))
    assert torch.isnan(RM.e8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()


def test_compressed_tensors_decodes_our_codes_as_the_same_scales():
    mx_utils = pytest.importorskip("compressed_tensors.compressors.mx_utils")
    codes = torch.arange(100, 160, dtype=torch.uint8)  # bf16 (their decode dtype) holds these powers of two
    assert torch.equal(mx_utils.decompress_mx_scale(codes).float(), RM.e8m0_to_float(codes))
    scales = RM.e8m0_to_float(codes)
    assert torch.equal(mx_utils.compress_mx_scale(scales, torch.uint8), codes)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), n=st.integers(1, 40), k=st.integers(1, 130), seed=st.integers(0, 2**16),
       fmt=st.sampled_from(FORMATS))
def test_quantize_properties(rows, n, k, seed, fmt):
    x = values((rows, k), seed)
    q, code = RM.mx_quantize(x, fmt)
    assert torch.equal(code, loop_codes(x, fmt))
    deq = RM.mx_dequantize(q, code)
    scale = RM.e8m0_to_float(code).repeat_interleave(32, -1)[:, :k]
    # |error| ≤ half a step of the element grid, or the saturation of values above fmt.max·scale
    step = scale * 2.0 ** -fmt.mantissa_bits * torch.exp2(torch.floor(torch.log2((x / scale).abs().clamp(min=2**-6))))
    err = (deq - x).abs()
    assert bool(((err <= step / 2 * 1.0001) | ((x / scale).abs() > fmt.max)).all())


def dequantized(q: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    return q.double() * RM.e8m0_to_float(code).double().repeat_interleave(32, -1)[..., :q.shape[-1]]


@pytest.mark.parametrize("activation", [None, "gelu", "swiglu"])
def test_mx_linear_against_fp64(activation):
    x = torch.randn(2, 5, 96)
    w = torch.randn(2 * 24 if activation == "swiglu" else 24, 96)
    bias, residual = torch.randn(w.shape[0]), torch.randn(2, 5, 24)
    x_q, xs = kernels.mx_quantize(x)
    w_q, ws = kernels.mx_quantize(w)
    got = RM.fp8_mx_linear(x_q, xs, w_q, ws, bias=bias, activation=activation, residual=residual)
    y = (dequantized(x_q, xs) @ dequantized(w_q, ws).T + bias.double()).float()
    if activation == "swiglu":
        g, u = y.chunk(2, -1)
        y = F.silu(g) * u
    elif activation == "gelu":
        y = F.gelu(y)
    torch.testing.assert_close(got, y + residual, rtol=1e-5, atol=1e-4)


def test_cpu_backend_fp32_path_is_the_reference_bit_for_bit():
    x_q, xs = kernels.mx_quantize(torch.randn(7, 160))
    w_q, ws = kernels.mx_quantize(torch.randn(48, 160))
    with use_cpu_gemm("fp32"):
        got = cpu_backend.fp8_mx_linear(x_q, xs, w_q, ws, activation="relu")
    assert torch.equal(got, RM.fp8_mx_linear(x_q, xs, w_q, ws, activation="relu"))
    with use_cpu_gemm("bf16"):  # each 32-wide partial rounded once to bf16: ≤ 2⁻⁸ of it, summed over the blocks
        got = cpu_backend.fp8_mx_linear(x_q, xs, w_q, ws)
    bound = RM.fp8_mx_linear(x_q.float().abs().to(x_q.dtype), xs, w_q.float().abs().to(w_q.dtype), ws) * 2**-8
    err = (got - RM.fp8_mx_linear(x_q, xs, w_q, ws)).abs()
    assert bool((err <= bound * 1.001 + 1e-6).all()) and bool((err > 0).any())


def test_mx_linear_refuses_float_scales():
    x_q, xs = kernels.mx_quantize(torch.randn(2, 64))
    with pytest.raises(TypeError, match="E8M0"):
        RM.fp8_mx_linear(x_q, xs.float(), x_q, xs)
