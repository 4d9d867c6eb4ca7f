"""Block-scaled FP8 reference (kernels.reference.block) and the CPU backend's block kernels against independent
computations.

* Scales: per block / per token-group amax found by explicit loops over the blocks (ragged edges, all-zero
  and non-finite blocks), divided by fmt.max as the per-tensor/channel observers do.
* Quantization bit for bit against torch's own cast of ``x · (1/scale)`` with each element's scale looked up
  by index (the project's rounding rule, reference.quantize); against ``x / scale`` (compressed-tensors'
  rule) at most one FP8 step apart, rarely.
* Layouts against the third-party code that reads them: transformers' FineGrainedFP8 quantizer/dequantizer.
* The GEMM against an fp64 dequantize-then-matmul: the reference is fp32-accurate, the CPU backend's bf16 path
  within bf16 rounding of each K block's partial product, its fp32 path the reference's bits.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.cpu.features import use_cpu_gemm
from dbr_quant.kernels.reference import block as RB

FORMATS = list(FP8Format)


def loop_block_scale(w: torch.Tensor, bn: int, bk: int, fmt: FP8Format) -> torch.Tensor:
    """Block scales by looping over the blocks: amax of the finite real elements / fmt.max, 1 if zero."""
    n, k = w.shape
    out = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].double()
            finite = blk[torch.isfinite(blk)].abs()
            amax = finite.max().item() if finite.numel() else 0.0
            out[i, j] = torch.tensor(amax, dtype=torch.float32) / fmt.max if amax > 0 else 1.0
    return out


def element_scale(scale: torch.Tensor, n: int, k: int, bn: int, bk: int) -> torch.Tensor:
    """scale[n // bn, k // bk] for every element, by index arithmetic."""
    rows = torch.arange(n)[:, None] // bn
    cols = torch.arange(k)[None, :] // bk
    return scale[rows, cols]


def torch_cast(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, divide: bool = False) -> torch.Tensor:
    y = x.float() / scale if divide else x.float() * torch.reciprocal(scale)
    return y.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def ordinal(q: torch.Tensor) -> torch.Tensor:
    b = q.view(torch.uint8).to(torch.int32)
    return torch.where(b >= 128, -(b - 128), b)


@st.composite
def weights(draw):
    bn, bk = draw(st.sampled_from([(128, 128), (16, 32), (24, 40), (1, 8), (7, 5)]))
    n = draw(st.integers(1, 3 * bn + 3))
    k = draw(st.integers(1, 3 * bk + 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    # rows and columns of very different magnitude: what block scales are for
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen) * 2) * 10.0 ** draw(
        st.integers(-3, 3))
    if draw(st.booleans()):
        w[: min(n, bn), : min(k, bk)] = 0.0  # an all-zero block
    if draw(st.booleans()):
        w[n - 1, k - 1] = draw(st.sampled_from([float("inf"), float("-inf"), float("nan")]))
    return w, (bn, bk)


@settings(max_examples=60, deadline=None)
@given(case=weights(), fmt=st.sampled_from(FORMATS))
def test_block_quantize_weight_scales_and_bytes(case, fmt):
    w, (bn, bk) = case
    q, scale = RB.block_quantize_weight(w, (bn, bk), fmt)
    n, k = w.shape
    assert q.shape == w.shape and q.dtype == fmt.dtype
    assert scale.shape == (math.ceil(n / bn), math.ceil(k / bk)) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, loop_block_scale(w, bn, bk, fmt), rtol=0, atol=0)
    per_elem = element_scale(scale, n, k, bn, bk)
    want = torch_cast(w, per_elem, fmt)
    finite = torch.isfinite(w)
    assert torch.equal(q.view(torch.uint8)[finite], want.view(torch.uint8)[finite])
    # dequantized: every finite weight within half an FP8 step (relative 2**-(m+1)) or a subnormal step
    dq = RB.block_dequantize(q, scale, (bn, bk))
    sub = 2.0 ** (1 - fmt.exponent_bias - fmt.mantissa_bits)
    bound = torch.maximum(w.abs() * 2.0 ** -(fmt.mantissa_bits + 1), per_elem * sub / 2)
    assert torch.all((dq - w).abs()[finite] <= bound[finite] * (1 + 1e-6))


def test_division_rule_is_at_most_one_step_away():
    """compressed-tensors and vLLM quantize as x / scale, we as x · (1/scale) (as every dbr_quant quantize):
    the fp32 quotients differ by an ulp at most, so a byte moves by at most one FP8 step, rarely."""
    w = torch.randn(1024, 1024) * 3
    q, scale = RB.block_quantize_weight(w)
    other = torch_cast(w, element_scale(scale, 1024, 1024, 128, 128), FP8Format.E4M3, divide=True)
    steps = (ordinal(q) - ordinal(other)).abs()
    assert steps.max() <= 1 and steps.float().mean() < 1e-4


@settings(max_examples=60, deadline=None)
@given(lead=st.sampled_from([(), (1,), (3,), (2, 3)]), k=st.integers(1, 300), group=st.sampled_from([128, 32, 48, 1]),
       fmt=st.sampled_from(FORMATS), seed=st.integers(0, 2**16))
def test_group_quantize_scales_and_bytes(lead, k, group, fmt, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=gen) * torch.exp(torch.randn(k, generator=gen) * 2)  # outlier channels
    x.view(-1, k)[0, : min(k, group)] = 0.0  # token 0's first group is all zero → scale 1
    q, scale = RB.group_quantize(x, group, fmt)
    assert q.shape == x.shape and scale.shape == (*lead, math.ceil(k / group))
    rows, flat_scale = x.reshape(-1, k), scale.reshape(-1, scale.shape[-1])
    for r in range(rows.shape[0]):  # each token is a 1 × group block grid
        torch.testing.assert_close(flat_scale[r:r + 1], loop_block_scale(rows[r:r + 1], 1, group, fmt), rtol=0, atol=0)
    assert flat_scale[0, 0] == 1.0
    per_elem = scale.repeat_interleave(group, -1)[..., :k]
    assert torch.equal(q.view(torch.uint8), torch_cast(x, per_elem, fmt).view(torch.uint8))
    assert torch.equal(RB.group_dequantize(q, scale, group), q.float() * per_elem)


def test_layouts_match_transformers_finegrained_fp8():
    """transformers' own FineGrainedFP8 quantizer produces (weight, weight_scale_inv) of our shapes and values
    (its scale is 1/(448/amax): within 2 fp32 ulps of amax/448), and its dequantizer reads ours."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    cfg = types.SimpleNamespace(weight_block_size=[128, 128], scale_fmt="float")
    w = torch.randn(256, 384) * torch.exp(torch.randn(256, 1))
    w[:128, 128:256] = 0.0
    theirs = fp8.Fp8Quantize(types.SimpleNamespace(quantization_config=cfg))._quantize_one("fc.weight", w)
    q, scale = RB.block_quantize_weight(w)
    assert theirs["fc.weight_scale_inv"].shape == scale.shape == (2, 3)
    torch.testing.assert_close(theirs["fc.weight_scale_inv"], scale, rtol=2.5e-7, atol=0)
    assert (ordinal(theirs["fc.weight"]) - ordinal(q)).abs().max() <= 1
    assert torch.equal(fp8.Fp8Dequantize(None)._dequantize_one(q, scale, torch.float32), RB.block_dequantize(q, scale))


def fp64_block_linear(x_q, x_scale, w_q, w_scale, block, group):
    """Dequantize both operands in fp64 (exact) by index arithmetic, then one fp64 matmul."""
    n, k = w_q.shape
    w = w_q.double() * element_scale(w_scale.double(), n, k, *block)
    x = x_q.double() * x_scale.double()[..., torch.arange(k) // group]
    return x @ w.T


@st.composite
def linear_case(draw, gated=False):
    bn, bk = draw(st.sampled_from([(128, 128), (16, 32), (24, 40), (3, 8)]))
    m = draw(st.sampled_from([1, 2, 7]))
    n = draw(st.integers(1, 2 * bn + 5))
    k = draw(st.integers(1, 3 * bk + 5))
    lead = draw(st.sampled_from([(), (2,)]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    fmt_x, fmt_w = draw(st.sampled_from(FORMATS)), draw(st.sampled_from(FORMATS))
    x = torch.randn(*lead, m, k, generator=gen) * torch.exp(torch.randn(k, generator=gen))
    x_q, x_s = RB.group_quantize(x, bk, fmt_x)
    halves = [RB.block_quantize_weight(torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen)),
                                       (bn, bk), fmt_w) for _ in range(2 if gated else 1)]
    w_q, w_s = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    return x_q, x_s, w_q, w_s, (bn, bk), gen


@settings(max_examples=50, deadline=None)
@given(case=linear_case())
def test_block_gemm_against_fp64_dequantized_matmul(case):
    x_q, x_s, w_q, w_s, block, _ = case
    want = fp64_block_linear(x_q, x_s, w_q, w_s, block, block[1])
    # Σ|products| bounds what any fp32 summation order can lose
    mag = (x_q.double().abs() * x_s.double()[..., torch.arange(x_q.shape[-1]) // block[1]]) @ (
        w_q.double().abs() * element_scale(w_s.double(), *w_q.shape, *block)).T
    exact = RB.fp8_block_linear(x_q, x_s, w_q, w_s, block=block)
    assert exact.dtype == torch.float32 and exact.shape == want.shape
    assert torch.all((exact.double() - want).abs() <= 1e-6 * mag + 1e-30)
    with use_cpu_gemm("bf16"):  # bf16 partial products (2**-9 each) where the operands are not small
        fast = cpu_backend.fp8_block_linear(x_q, x_s, w_q, w_s, block=block)
    assert torch.all((fast.double() - want).abs() <= 2.0**-8 * mag + 1e-30)
    with use_cpu_gemm("fp32"):  # the exact FP8 values in an fp32 GEMM, as the reference
        assert torch.equal(cpu_backend.fp8_block_linear(x_q, x_s, w_q, w_s, block=block), exact)


@settings(max_examples=30, deadline=None)
@given(case=linear_case(gated=True), activation=st.sampled_from(["swiglu", "geglu"]), has_bias=st.booleans())
def test_gated_block_linear_halves_are_blocked_on_their_own(case, activation, has_bias):
    x_q, x_s, w_q, w_s, block, gen = case
    n, rows = w_q.shape[0] // 2, w_s.shape[0] // 2
    bias = torch.randn(2 * n, generator=gen) if has_bias else torch.zeros(2 * n)
    gate = fp64_block_linear(x_q, x_s, w_q[:n], w_s[:rows], block, block[1]) + bias[:n].double()
    up = fp64_block_linear(x_q, x_s, w_q[n:], w_s[rows:], block, block[1]) + bias[n:].double()
    act = F.silu if activation == "swiglu" else F.gelu
    want = act(gate) * up
    got = RB.fp8_block_linear(x_q, x_s, w_q, w_s, block=block, activation=activation,
                              bias=bias if has_bias else None)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * (gate.abs().max() * up.abs().max()).item())


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16, FP8Format.E4M3])
def test_epilogue_bias_activation_residual_and_output(activation, out):
    gen = torch.Generator().manual_seed(1)
    x_q, x_s = RB.group_quantize(torch.randn(2, 5, 200, generator=gen), 128)
    w_q, w_s = RB.block_quantize_weight(torch.randn(130, 200, generator=gen))
    bias, res = torch.randn(130, generator=gen), torch.randn(2, 5, 130, generator=gen)
    pre = fp64_block_linear(x_q, x_s, w_q, w_s, (128, 128), 128) + bias.double()
    acts = {None: lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
    want = (acts[activation](pre) + res.double()).float()
    kw = dict(bias=bias, activation=activation, residual=res)
    if isinstance(out, FP8Format):
        scale = want.abs().max() / out.max * 0.75  # some values saturate
        got = RB.fp8_block_linear(x_q, x_s, w_q, w_s, out_scale=scale, out_fmt=out, **kw)
        assert (ordinal(got) - ordinal(torch_cast(want, scale, out))).abs().max() <= 1
    else:
        got = RB.fp8_block_linear(x_q, x_s, w_q, w_s, out_dtype=out, **kw)
        assert got.dtype == out
        torch.testing.assert_close(got.float(), want.to(out).float(), rtol=1e-2 if out == torch.bfloat16 else 1e-5,
                                   atol=1e-4)


def test_layer_norm_group_quantize_is_norm_then_group_quantize():
    x = torch.randn(3, 4, 300) * 5 + 2
    weight, bias = torch.randn(300), torch.randn(300)
    for rms in (False, True):
        y, q, scale = RB.layer_norm_group_quantize(x, weight, bias, 1e-5, 128, rms=rms)
        want = F.rms_norm(x, (300,), weight, 1e-5) if rms else F.layer_norm(x, (300,), weight, bias, 1e-5)
        assert torch.equal(y, want) and scale.shape == (3, 4, 3)
        q_want, s_want = RB.group_quantize(want, 128)
        assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(scale, s_want)


def test_errors_name_the_tensor_and_expected_shape():
    x_q, x_s = RB.group_quantize(torch.randn(4, 300), 128)
    w_q, w_s = RB.block_quantize_weight(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"w_scale .* must have shape \(2, 3\)"):
        RB.fp8_block_linear(x_q, x_s, w_q, w_s[:1])
    with pytest.raises(ValueError, match=r"x_scale must have shape \(4, 3\)"):
        RB.fp8_block_linear(x_q, x_s[:, :2], w_q, w_s)
    with pytest.raises(ValueError, match=r"w_q must be N×K with K = 300"):
        RB.fp8_block_linear(x_q, x_s, w_q[:, :100], w_s)
    w3_q, w3_s = RB.block_quantize_weight(torch.randn(300, 300))  # one block grid over 300 rows: 3 rows of scales
    with pytest.raises(ValueError, match=r"\(4, 3\) \(gate and up each blocked"):  # 2 halves of ⌈150/128⌉ rows
        RB.fp8_block_linear(x_q, x_s, w3_q, w3_s, activation="swiglu")
    with pytest.raises(ValueError, match="block must be two positive ints"):
        RB.block_quantize_weight(torch.randn(4, 4), (128, 0))
    with pytest.raises(ValueError, match="2-d weights"):
        RB.block_quantize_weight(torch.randn(4))


def test_dispatch_counts_launches_and_runs_the_cpu_backend_on_cpu():
    x = torch.randn(3, 200)
    w_q, w_s = kernels.block_quantize_weight(torch.randn(64, 200))
    with kernels.count_launches() as counts:
        x_q, x_s = kernels.group_quantize(x)
        y = kernels.fp8_block_linear(x_q, x_s, w_q, w_s, bias=torch.zeros(64))
        kernels.layer_norm_group_quantize(x, None, None, 1e-5, rms=True)
    assert counts == {"group_quantize": 1, "fp8_block_linear": 1, "norm_group_quantize": 1}
    assert torch.equal(y, cpu_backend.fp8_block_linear(x_q, x_s, w_q, w_s, bias=torch.zeros(64)))


def test_capture_without_a_graph_op_says_so():
    from dbr_quant.kernels.dispatch import capture_with

    x_q, x_s = RB.group_quantize(torch.randn(2, 128))
    w_q, w_s = RB.block_quantize_weight(torch.randn(8, 128))
    with capture_with(object()), pytest.raises(NotImplementedError, match="has no fp8_block_linear op yet"):
        kernels.fp8_block_linear(x_q, x_s, w_q, w_s)
