"""Triton FP8 quantize kernels in the CPU interpreter against the reference, bit for bit (scales and bytes),
and their ahead-of-time configurations compiled for Hopper (sm_90) and Ada (sm_89)."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.backends.compiler import GPUTarget

from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.triton import quantize as TQ
from dbr_quant.kernels.triton.common import Kernel

FORMATS = [FP8Format.E4M3, FP8Format.E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN = float("nan")
INF = float("inf")
SPECIALS = [0.0, -0.0, INF, -INF, NAN, -NAN, 1e30, -1e30, 1e-40, -1e-40, 65504.0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, except that the sign of a NaN is not compared (hardware and numpy drop it)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    both_nan = torch.isnan(got.float()) & torch.isnan(want.float())
    diff = (bits(got) != bits(want)) & ~both_nan
    assert not diff.any(), f"{int(diff.sum())} differ, first at {diff.nonzero()[0].tolist()}"


@st.composite
def inputs(draw, max_rows: int = 64, max_n: int = 300) -> torch.Tensor:
    """A tensor of 1-3 dims (≤ max_rows rows of ≤ max_n), of a drawn dtype and magnitude, optionally
    non-contiguous, with special values and all-zero rows sprinkled in."""
    ndim = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_n))
    lead = [draw(st.integers(1, 4)) for _ in range(ndim - 1)]
    if ndim == 3:
        lead[1] = draw(st.integers(1, max(1, max_rows // lead[0])))
    elif ndim == 2:
        lead[0] = draw(st.integers(1, max_rows))
    shape = (*lead, n)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(shape, generator=gen) * 10.0 ** draw(st.integers(-4, 4))
    flat = x.view(-1)
    for pos, value in draw(st.lists(st.tuples(st.integers(0, 2**20), st.sampled_from(SPECIALS)), max_size=6)):
        flat[pos % flat.numel()] = value
    if ndim > 1 and draw(st.booleans()):
        x.view(-1, n)[draw(st.integers(0, x.numel() // n - 1))] = 0.0
    x = x.to(draw(st.sampled_from(DTYPES)))
    if draw(st.booleans()):  # same values, every other element of a wider buffer
        wide = torch.empty(*shape[:-1], 2 * n, dtype=x.dtype)[..., ::2]
        x = wide.copy_(x)
    return x


@contextlib.contextmanager
def interpret():
    with use_backend("triton-interpret"):
        yield


@settings(max_examples=30, deadline=None)
@given(x=inputs(), fmt=st.sampled_from(FORMATS), per_row=st.booleans(), log_scale=st.floats(-12, 6))
def test_static_quantize_matches_reference_bit_for_bit(x, fmt, per_row, log_scale):
    if per_row:
        scale = torch.rand(*x.shape[:-1], 1) * 2.0**log_scale + 1e-30
    else:
        scale = torch.tensor(2.0**log_scale * 1.37)
    with interpret():
        got = TQ.quantize(x, scale, fmt)
    assert_bit_equal(got, R.quantize(x, scale, fmt))


def test_static_quantize_on_built_ties_is_x_times_the_reciprocal():
    """Inputs where x·(1/s) and x/s round to different codes (fp8_ties): the Triton kernel multiplies by the
    reciprocal torch computed, like the reference (and vLLM's static quantize), bit for bit."""
    from fp8_ties import codes_by_reciprocal, tie_inputs

    x, scale = tie_inputs(0.0123), torch.tensor(0.0123)
    with interpret():
        got = TQ.quantize(x, scale, FP8Format.E4M3)
    assert_bit_equal(got, codes_by_reciprocal(x, scale))


@settings(max_examples=30, deadline=None)
@given(x=inputs(), fmt=st.sampled_from(FORMATS), per_token=st.booleans())
def test_dynamic_quantize_matches_reference_bit_for_bit(x, fmt, per_token):
    with interpret():
        q, scale = TQ.dynamic_quantize(x, fmt, per_token)
    want_scale = R.dynamic_scale(x, fmt, per_token)
    assert_bit_equal(scale, want_scale)
    assert_bit_equal(q, R.quantize(x, want_scale, fmt))


@settings(max_examples=8, deadline=None)
@given(x=inputs(max_rows=8, max_n=300), fmt=st.sampled_from(FORMATS), block=st.sampled_from([16, 64, 128]))
def test_per_token_rows_longer_than_the_block_are_looped(x, fmt, block):
    with interpret(), mock.patch.object(TQ, "TOKEN_BLOCKS", (block,)):
        q, scale = TQ.dynamic_quantize(x, fmt, per_token=True)
    want_scale = R.dynamic_scale(x, fmt, True)
    assert_bit_equal(scale, want_scale)
    assert_bit_equal(q, R.quantize(x, want_scale, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_rows_get_scale_one_and_nonfinite_values_are_ignored_by_amax(fmt):
    x = torch.randn(6, 40)
    x[0] = 0.0
    x[1] = -0.0
    x[2] = NAN  # an all-NaN row: amax 0 → scale 1, every byte NaN
    x[3, :3] = torch.tensor([INF, -INF, NAN])
    x[4] = 0.0
    x[4, 7] = INF  # only non-finite → scale 1, inf saturates to ±max
    with interpret():
        q, scale = TQ.dynamic_quantize(x, fmt, per_token=True)
        q_t, scale_t = TQ.dynamic_quantize(torch.zeros(3, 5), fmt, per_token=False)
    assert scale[[0, 1, 2, 4]].flatten().tolist() == [1.0] * 4
    assert scale_t.item() == 1.0 and not q_t.view(torch.uint8).any()
    b = q.view(torch.uint8)
    assert not b[0].any() and (b[1] == 0x80).all()  # -0.0 keeps its sign
    assert (b[2] & 0x7F == 0x7F).all()
    assert b[3, 0].item() == b[4, 7].item() == R.quantize(torch.tensor(fmt.max), torch.tensor(1.0), fmt).view(
        torch.uint8).item()
    assert b[3, 1].item() == b[3, 0].item() | 0x80
    assert_bit_equal(q, R.quantize(x, R.dynamic_scale(x, fmt, True), fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_gives_the_fp8_nan_byte_with_the_input_sign(fmt):
    x = torch.tensor([NAN, -NAN, 1.0, -2.0, INF, -INF, -0.0])
    with interpret():
        q = TQ.quantize(x, torch.tensor(0.5), fmt).view(torch.uint8)
        q_dyn, scale = TQ.dynamic_quantize(x, fmt, per_token=False)
    assert q[:2].tolist() == [0x7F, 0xFF]
    assert q[-1].item() == 0x80
    want = (torch.tensor(2.0) / fmt.max).item()  # NaN and inf ignored by amax
    assert scale.item() == R.dynamic_scale(x, fmt, False).item() == want
    assert_bit_equal(q_dyn, R.quantize(x, scale, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_huge_values_saturate_and_tiny_amax_scales_match_safe_scale(fmt):
    x = torch.tensor([[1e38, -3e38, 1.0], [1e-45, 0.0, -1e-45], [1e-40, 3e-41, 0.0], [1e-38, -5e-39, 2e-39]])
    with interpret():
        q = TQ.quantize(x, torch.tensor(1.0), fmt)
        q_dyn, scale = TQ.dynamic_quantize(x, fmt, per_token=True)
    assert q[0, :2].float().tolist() == [fmt.max, -fmt.max]
    want = R.dynamic_scale(x, fmt, True)
    assert_bit_equal(scale, want)  # amax/fmt.max underflowing to 0 → 1; subnormal → fp32 tiny
    assert_bit_equal(q_dyn, R.quantize(x, want, fmt))


def test_scalar_fp64_and_leading_dim_broadcast_scales():
    fmt = FP8Format.E4M3
    x = torch.randn(2, 3, 17, dtype=torch.float64) * 1e3
    scale = torch.rand(3, 1) + 0.1  # broadcasts over the batch dim
    with interpret():
        assert_bit_equal(TQ.quantize(x, scale, fmt), R.quantize(x, scale, fmt))
        assert_bit_equal(TQ.quantize(torch.tensor(3.3), torch.tensor(0.1), fmt),
                         R.quantize(torch.tensor(3.3), torch.tensor(0.1), fmt))
        q, s = TQ.dynamic_quantize(x, fmt, per_token=False)
        assert_bit_equal(s, R.dynamic_scale(x, fmt, False))
        with pytest.raises(ValueError):
            TQ.quantize(x, torch.rand(17), fmt)  # per-column scale: not this kernel's job
        with pytest.raises(ValueError):
            TQ.quantize(x, torch.rand(1, 1, 1, 1), fmt)  # would broadcast x to 4-d


# ----------------------------------------------------------------------------------------------------
# ahead-of-time configurations


def launched_configs(run) -> list[tuple[str, dict, dict]]:
    """Run ``run()`` in the interpreter and return each launch as (kernel fn name, signature, constexprs)."""
    launches = []
    original = Kernel.__getitem__

    def spy(self, grid):
        launcher = original(self, grid)

        def record(*args, **kwargs):
            names = self.jit.arg_names
            sig = {}
            for name, value in zip(names, args):
                if isinstance(value, torch.Tensor):
                    sig[name] = "*u8" if value.dtype == torch.uint8 else "*" + TQ.TRITON_DTYPES[value.dtype]
                else:
                    sig[name] = "i32" if isinstance(value, int) else "fp32"
            sig.update({name: "constexpr" for name in kwargs})
            launches.append((self.fn.__name__, {n: sig[n] for n in names}, dict(kwargs)))
            return launcher(*args, **kwargs)

        return record

    with interpret(), mock.patch.object(Kernel, "__getitem__", spy):
        run()
    return launches


def assert_launches_are_aot_configs(launches, configs) -> None:
    known = [(k.fn.__name__, sig, const) for _, _, k, sig, const in configs]
    for launch in launches:
        assert launch in known, f"launched configuration missing from AOT_CONFIGS: {launch}"


def greedy_cover(configs) -> list:
    """A few configs that together use every kernel, every signature type and every constexpr value."""
    def features(cfg):
        _, _, kernel, sig, const = cfg
        return {(kernel.fn.__name__, k, str(v)) for k, v in (*sig.items(), *const.items())}

    todo = set().union(*(features(c) for c in configs))
    chosen = []
    while todo:
        best = max(configs, key=lambda c: len(features(c) & todo))
        chosen.append(best)
        todo -= features(best)
    return chosen


def compile_config(cfg, arch: int) -> str:
    _, _, kernel, sig, const = cfg
    src = triton.compiler.ASTSource(fn=kernel.jit, signature=sig, constexprs=const)
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32)).asm["ptx"]
    assert f".target sm_{arch}" in ptx
    # no float→fp8 conversion instruction and no approximate rsqrt. (``div.full.f32`` does appear: it is
    # round_to_fp8's subnormal-grid division by a power of two; our own divisions are div.rn.f32.)
    assert "e4m3" not in ptx and "e5m2" not in ptx and "rsqrt" not in ptx
    return ptx


def test_every_wrapper_launch_is_an_aot_config():
    def run():
        for dtype in DTYPES:
            for fmt in FORMATS:
                for n in (5, 300, 1500):  # one per BLOCK choice of the per-token kernel
                    x = torch.randn(2, n).to(dtype)
                    TQ.quantize(x, torch.tensor(0.1), fmt)
                    TQ.quantize(x, torch.rand(2, 1) + 0.1, fmt)
                    TQ.dynamic_quantize(x, fmt, per_token=True)
                    TQ.dynamic_quantize(x, fmt, per_token=False)

    launches = launched_configs(run)
    assert {name for name, _, _ in launches} == {k.fn.__name__ for _, _, k, _, _ in TQ.AOT_CONFIGS}
    assert_launches_are_aot_configs(launches, TQ.AOT_CONFIGS)
    assert len({str(c[1:3]) for c in launches}) == len(TQ.AOT_CONFIGS)  # and every AOT config is launchable


@pytest.mark.parametrize("arch", [90, 89])
def test_representative_aot_configs_compile_for_hopper_and_ada(arch):
    """A greedy cover (every kernel, dtype, format, flag and BLOCK at least once): the full set is the
    slow test below (~0.35 s per compile here)."""
    for cfg in greedy_cover(TQ.AOT_CONFIGS):
        ptx = compile_config(cfg, arch)
        if cfg[0] == "amax":
            assert "atom.global" in ptx
        if cfg[0] in ("amax_quantize", "token_quantize"):
            assert "div.rn.f32" in ptx


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 89])
def test_all_aot_configs_compile_for_hopper_and_ada(arch):
    for cfg in TQ.AOT_CONFIGS:
        compile_config(cfg, arch)
