"""The fused LayerNorm/RMSNorm + FP8 Triton kernel in the CPU interpreter against the reference, and its
ahead-of-time configurations compiled for Hopper (sm_90) and Ada (sm_89).

Not bit-exact by design: the row statistics are fp32 sums in a different order than torch's, so the
normalized values agree to fp32 rounding and an FP8 byte may land one step away where that rounding
difference crosses an FP8 rounding boundary (rare: checked ≥ 99.9 % equal, the rest one step).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.backends.compiler import GPUTarget

from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.triton import norm as TN
from dbr_quant.kernels.triton.common import Kernel
from dbr_quant.kernels.triton.quantize import TRITON_DTYPES

FORMATS = [FP8Format.E4M3, FP8Format.E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fp8_ordinal(q: torch.Tensor) -> torch.Tensor:
    """FP8 bytes as signed positions on the grid (±0 → 0), so neighbouring values differ by 1."""
    b = q.view(torch.uint8).to(torch.int32)
    return torch.where(b >= 0x80, -(b - 0x80), b)


def assert_matches_reference(x, weight, bias, eps, scale, fmt, rms):
    with use_backend("triton-interpret"):
        y, q = TN.layer_norm_quantize(x, weight, bias, eps, scale, fmt, rms=rms)
    y_ref, q_ref = R.layer_norm_quantize(x, weight, bias, eps, scale, fmt, rms=rms)
    assert y.dtype == (x.dtype if x.dtype in DTYPES else torch.float32) and y.shape == x.shape
    assert q.dtype == fmt.dtype and q.shape == x.shape
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    else:  # our fp32 value and the reference's round to the same x.dtype value, or to a neighbour
        torch.testing.assert_close(y, y_ref.to(y.dtype), equal_nan=True)
    nan = torch.isnan(y_ref)
    assert torch.equal(nan, q.float().isnan()) and torch.equal(nan, torch.isnan(y))
    steps = (fp8_ordinal(q) - fp8_ordinal(q_ref))[~nan].abs()
    assert steps.max().item() <= 1 if steps.numel() else True
    assert (steps == 0).float().mean().item() >= 0.999 if steps.numel() else True
    return y, q


@st.composite
def norm_case(draw, max_rows: int = 16, max_n: int = 300):
    shape = (*[draw(st.integers(1, 4)) for _ in range(draw(st.integers(0, 2)))], draw(st.integers(1, max_n)))
    while torch.Size(shape[:-1]).numel() > max_rows:
        shape = shape[1:]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    dtype = draw(st.sampled_from(DTYPES))
    n = shape[-1]
    std = 10.0 ** draw(st.integers(-2, 3))
    # a mean within a few std: a mean ≫ std makes fp32 LayerNorm ill-conditioned (reference included),
    # see test_ill_conditioned_rows_are_as_accurate_as_the_reference
    x = ((torch.randn(shape, generator=gen) + draw(st.floats(-3, 3))) * std).to(dtype)
    if draw(st.booleans()):
        x = torch.empty(*shape[:-1], 2 * n, dtype=dtype)[..., ::2].copy_(x)  # non-contiguous
    param_dtype = draw(st.sampled_from([dtype, torch.float32]))
    weight = torch.randn(n, generator=gen).to(param_dtype) if draw(st.booleans()) else None
    bias = torch.randn(n, generator=gen).to(param_dtype) if draw(st.booleans()) else None
    scale = torch.tensor(2.0 ** draw(st.integers(-10, 0)) * 1.3)
    return x, weight, bias, draw(st.sampled_from([1e-5, 1e-6])), scale


@settings(max_examples=40, deadline=None)
@given(case=norm_case(), fmt=st.sampled_from(FORMATS), rms=st.booleans())
def test_layer_norm_quantize_matches_reference(case, fmt, rms):
    assert_matches_reference(*case, fmt, rms)


@settings(max_examples=10, deadline=None)
@given(case=norm_case(max_rows=4), fmt=st.sampled_from(FORMATS), rms=st.booleans(),
       block=st.sampled_from([16, 64]))
def test_rows_longer_than_the_block_are_looped(case, fmt, rms, block):
    with mock.patch.object(TN, "NORM_BLOCKS", (block,)):
        assert_matches_reference(*case, fmt, rms)


@pytest.mark.parametrize("rms", [False, True])
def test_ill_conditioned_rows_are_as_accurate_as_the_reference(rms):
    """|mean| ≫ std: the fp32 rounding of the mean alone moves y by ulp(mean)/std, beyond 1e-5, in both
    implementations. Against fp64, ours must be no less accurate than the reference (up to 2x)."""
    x = torch.randn(8, 300) * 1e-3 + 1.0
    with use_backend("triton-interpret"):
        y, _ = TN.layer_norm_quantize(x, None, None, 1e-6, torch.tensor(1.0), FP8Format.E4M3, rms=rms)
    y_ref, _ = R.layer_norm_quantize(x, None, None, 1e-6, torch.tensor(1.0), FP8Format.E4M3, rms=rms)
    xd = x.double()  # the reference computes in fp32 whatever the input: fp64 by hand
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) if rms else F.layer_norm(xd, (300,), eps=1e-6)
    err, err_ref = (y.double() - exact).abs().max().item(), (y_ref.double() - exact).abs().max().item()
    assert err <= 2 * err_ref + 1e-6


@pytest.mark.parametrize("rms", [False, True])
def test_hidden_size_16384(rms):
    x = torch.randn(2, 16384) * 4 + 1
    assert_matches_reference(x, torch.randn(16384), torch.randn(16384), 1e-5, torch.tensor(0.02), FP8Format.E4M3, rms)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf - inf
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rms", [False, True])
def test_special_rows(fmt, rms):
    """All-zero rows normalize to 0, constant rows to 0 (LayerNorm) or ≈ weight (RMSNorm). A NaN
    anywhere makes its row NaN in both outputs (FP8 NaN bytes), and so does ±inf in LayerNorm (RMSNorm:
    rstd = 0, so NaN only at the inf, zeros elsewhere). Huge normalized values saturate to ±fmt.max."""
    x = torch.randn(6, 37)
    x[0] = 0.0
    x[1] = 3.25
    x[2, 5] = float("nan")
    x[3, 0] = float("inf")
    x[4, 1] = float("-inf")
    x[5, 0] = -0.0
    weight = torch.full((37,), 1e4)
    y, q = assert_matches_reference(x, weight, None, 1e-5, torch.tensor(1e-2), fmt, rms)
    assert not y[0].any() and (y[1].allclose(weight) if rms else not y[1].any())
    nan_rows = y[2:3] if rms else y[2:5]  # RMSNorm: rstd(inf) = 0, so only the inf itself turns NaN
    assert nan_rows.isnan().all() and (q[2:2 + len(nan_rows)].view(torch.uint8) & 0x7F == 0x7F).all()
    if rms:
        assert y[3:5].isnan().sum() == 2 and not y[3:5].nan_to_num().any()
    assert q[5].float().abs().max().item() == fmt.max  # |y|·1e4 / 1e-2 ≫ fmt.max: saturated


def test_bias_is_ignored_by_rms_and_bad_arguments_raise():
    x = torch.randn(3, 20)
    with use_backend("triton-interpret"):
        y_bias, _ = TN.layer_norm_quantize(x, None, torch.randn(20), 1e-6, torch.tensor(0.1), FP8Format.E4M3, rms=True)
        y, _ = TN.layer_norm_quantize(x, None, None, 1e-6, torch.tensor(0.1), FP8Format.E4M3, rms=True)
        assert torch.equal(y_bias, y)
        with pytest.raises(ValueError):
            TN.layer_norm_quantize(x, None, None, 1e-6, torch.rand(3, 1), FP8Format.E4M3)  # per-row: unsupported
        with pytest.raises(ValueError):
            TN.layer_norm_quantize(x, torch.randn(21), None, 1e-6, torch.tensor(0.1), FP8Format.E4M3)


# ----------------------------------------------------------------------------------------------------
# ahead-of-time configurations


def launch_signature(kernel: Kernel, args, kwargs) -> tuple[str, dict, dict]:
    sig = {}
    for name, value in zip(kernel.jit.arg_names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*u8" if value.dtype == torch.uint8 else "*" + TRITON_DTYPES[value.dtype]
        else:
            sig[name] = "i32" if isinstance(value, int) else "fp32"
    sig.update({name: "constexpr" for name in kwargs})
    return kernel.fn.__name__, {n: sig[n] for n in kernel.jit.arg_names}, dict(kwargs)


def test_every_wrapper_launch_is_an_aot_config():
    launches = []
    original = Kernel.__getitem__

    def spy(self, grid):
        launcher = original(self, grid)
        return lambda *args, **kwargs: (launches.append(launch_signature(self, args, kwargs)),
                                        launcher(*args, **kwargs))

    with use_backend("triton-interpret"), mock.patch.object(Kernel, "__getitem__", spy):
        for dtype in DTYPES:
            for n in (5, 300, 1500):  # one per BLOCK choice
                x = torch.randn(1, n).to(dtype)
                for p_dtype in {dtype, torch.float32}:
                    w, b = torch.randn(n).to(p_dtype), torch.randn(n).to(p_dtype)
                    for fmt in FORMATS:
                        for weight, bias in ((None, None), (w, None), (None, b), (w, b)):
                            for rms in (False, True):
                                TN.layer_norm_quantize(x, weight, bias, 1e-5, torch.tensor(0.1), fmt, rms=rms)
    known = [(k.fn.__name__, sig, const) for _, _, k, sig, const in TN.AOT_CONFIGS]
    for launch in launches:
        assert launch in known, f"launched configuration missing from AOT_CONFIGS: {launch}"
    assert len({str(launch) for launch in launches}) == len(TN.AOT_CONFIGS)


def representative_configs() -> list:
    """A greedy cover: a few configs that together use every signature type, every (x, weight/bias)
    dtype pair and every constexpr value (flags, formats, BLOCKs); the full 156 is the slow test below."""
    def features(cfg):
        sig, const = cfg[3], cfg[4]
        used = [sig[p] for p, flag in (("w_ptr", "HAS_WEIGHT"), ("b_ptr", "HAS_BIAS")) if const[flag]]
        pairs = {("x and param types", sig["x_ptr"], ty) for ty in used}  # incl. mixed bf16 x, fp32 weight
        return pairs | {(k, str(v)) for k, v in (*sig.items(), *const.items())}

    todo = set().union(*(features(c) for c in TN.AOT_CONFIGS))
    chosen = []
    while todo:
        best = max(TN.AOT_CONFIGS, key=lambda c: len(features(c) & todo))
        chosen.append(best)
        todo -= features(best)
    return chosen


@pytest.mark.parametrize("arch", [90, 89])
def test_representative_aot_configs_compile_for_hopper_and_ada(arch):
    configs = representative_configs()
    assert {c[4]["BLOCK"] for c in configs} == set(TN.NORM_BLOCKS) and len({c[4]["FP8_MAX"] for c in configs}) == 2
    assert len(configs) <= 6, "keep this test fast (~0.5-1 s per compile on this machine)"
    for _, _, kernel, sig, const in configs:
        src = triton.compiler.ASTSource(fn=kernel.jit, signature=sig, constexprs=const)
        ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32)).asm["ptx"]
        assert f".target sm_{arch}" in ptx and "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx
        assert "e4m3" not in ptx and "e5m2" not in ptx and "rsqrt" not in ptx
