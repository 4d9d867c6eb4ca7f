"""The Triton wrappers' host path (kernels/triton/gemm_core.py, gemm.py, weight_only_gemm.py, quantize.py) keeps
per-variant decisions between calls (launch keyword arguments, gated tile configs, FP8 constants, a 1.0 operand) and
passes fp32 scales to the kernels in place: calls of one shape that differ in strides, scale layouts, output kind,
dtypes or epilogue, run back to back, must each give the reference's result, never one a previous call decided.

The operands are small integers and the scales powers of two, so every product, sum and scaling is exact in fp32:
the kernels (default tile configs, in the interpreter) then match the reference bit for bit, whatever the order of
the additions, and any stale launch argument shows as a wrong value.
"""

from __future__ import annotations

import pytest
import torch

from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import block as RB
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.reference import mx as RM
from dbr_quant.kernels.reference import weight_only as RW
from dbr_quant.kernels.triton import block_gemm as TB
from dbr_quant.kernels.triton import gemm as G
from dbr_quant.kernels.triton import gemm_core as core
from dbr_quant.kernels.triton import mx_gemm as TM
from dbr_quant.kernels.triton import quantize as TQ
from dbr_quant.kernels.triton import weight_only_gemm as TW

M, K, N = 3, 40, 24


def _ints(gen: torch.Generator, *shape: int, low: int = -3, high: int = 4) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen).float()


def _pow2(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Scales 2**-2 … 2**1: products with integers stay exact."""
    return 2.0 ** torch.randint(-2, 2, shape, generator=gen).float()


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view whose last dim has stride 2 (not contiguous)."""
    wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def _linear_cases(gen: torch.Generator) -> list[tuple[str, dict]]:
    """Operand sets of one shape (M rows × K → N), each differing from the one before in what a cache could keep."""
    x = _ints(gen, M, K).to(torch.float8_e4m3fn)
    w = _ints(gen, N, K).to(torch.float8_e4m3fn)
    w13 = _ints(gen, 2 * N, K).to(torch.float8_e4m3fn)
    sx, sw = torch.tensor(0.5), torch.tensor(0.25)
    row, channel, channel13 = _pow2(gen, M, 1), _pow2(gen, N), _pow2(gen, 2 * N)
    bias, res = _ints(gen, N) / 2, _ints(gen, M, N)
    x_kt = x.float().t().contiguous().t().to(torch.float8_e4m3fn)  # stride 1 along M, not K: copied
    assert x_kt.stride(1) != 1
    base = {"x_q": x, "x_scale": sx, "w_q": w, "w_scale": sw}
    return [
        ("per-tensor, bf16 out", {**base, "out_dtype": torch.bfloat16}),
        ("per-row and per-channel", {**base, "x_scale": row, "w_scale": channel, "out_dtype": torch.bfloat16}),
        ("x with K not contiguous", {**base, "x_q": x_kt}),
        ("3-D x, (M, 1) row scale broadcast", {**base, "x_q": x[None], "x_scale": row}),
        ("3-D x, (1, M, 1) row scale", {**base, "x_q": x[None], "x_scale": row[None], "w_scale": channel[:, None]}),
        ("x rows 2K apart", {**base, "x_q": torch.cat([x, x], 1)[:, :K], "x_scale": row}),
        ("3-D x, 3-D bf16 residual", {**base, "x_q": x[None], "residual": res[None].bfloat16()}),
        ("3-D x not contiguous, residual broadcast", {**base, "x_q": torch.stack([x, x], 1)[:, :1],
                                                      "x_scale": row[:, None], "residual": res[0]}),
        ("strided row and channel scales", {**base, "x_scale": _strided(row.t()).t(), "w_scale": _strided(channel)}),
        ("FP8 out e4m3", {**base, "w_scale": channel, "out_scale": torch.tensor(2.0)}),
        ("FP8 out e5m2", {**base, "w_scale": channel, "out_scale": torch.tensor(0.5), "out_fmt": FP8Format.E5M2}),
        ("bias and fp32 residual, fp16 out", {**base, "bias": bias, "residual": res, "out_dtype": torch.float16}),
        ("strided bias (the kernel indexes it by column)", {**base, "bias": _strided(bias)}),
        ("bf16 residual, relu", {**base, "residual": res.bfloat16(), "activation": "relu"}),
        ("gated, FP8 out", {**base, "w_q": w13, "w_scale": channel13, "activation": "swiglu",
                            "out_scale": torch.tensor(0.25)}),
        ("gated, fp32 out, bias", {**base, "w_q": w13, "activation": "swiglu", "bias": _ints(gen, 2 * N)}),
        ("e5m2 operands, fp32 out", {**base, "x_q": x.to(torch.float8_e5m2), "w_q": w.to(torch.float8_e5m2)}),
        ("per-tensor again", {**base}),
    ]


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _assert_matches(got: torch.Tensor, want: torch.Tensor, gated: bool, what: str) -> None:
    """Bit for bit, except after a gated activation: exp in the interpreter (numpy) and in torch may differ in the
    last bit, which an FP8 output may round one step the other way."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if not gated:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if want.dtype in FP8_DTYPES else \
            torch.equal(got, want), what
    elif want.dtype in FP8_DTYPES:
        assert torch.all((got.float() - want.float()).abs() <= want.float().abs() * 2.0**-3), what
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6, msg=what)


def test_fp8_linear_variants_back_to_back_match_the_reference():
    cases = _linear_cases(torch.Generator().manual_seed(0))
    with use_backend("triton-interpret"):
        for _ in range(2):  # the second pass runs every variant with its decisions already kept
            for what, kw in cases:
                kw = dict(kw)
                x_q, x_scale, w_q, w_scale = kw.pop("x_q"), kw.pop("x_scale"), kw.pop("w_q"), kw.pop("w_scale")
                # the reference takes w_scale as (N,) only; the wrapper any shape of N values
                want = R.fp8_linear(x_q, x_scale, w_q, w_scale.reshape(-1) if w_scale.dim() else w_scale, **kw)
                got = G.fp8_linear(x_q, x_scale, w_q, w_scale, **kw)
                _assert_matches(got, want, "gated" in what, what)
                assert got.is_contiguous(), what


def test_fp8_linear_bad_arguments_still_raise_after_cached_launches():
    """A variant launched before (so its decisions are kept) still has its operands checked on every call."""
    gen = torch.Generator().manual_seed(1)
    x = _ints(gen, M, K).to(torch.float8_e4m3fn)
    w = _ints(gen, N, K).to(torch.float8_e4m3fn)
    with use_backend("triton-interpret"):
        G.fp8_linear(x, torch.tensor(1.0), w, _pow2(gen, N))
        with pytest.raises(ValueError, match="w_scale must be a scalar or have 24 values"):
            G.fp8_linear(x, torch.tensor(1.0), w, _pow2(gen, N + 1))
        with pytest.raises(RuntimeError):  # a row scale that does not broadcast to x's rows
            G.fp8_linear(x, _pow2(gen, M + 1, 1), w, torch.tensor(1.0))
        with pytest.raises(ValueError, match="out_scale must be a single"):
            G.fp8_linear(x, torch.tensor(1.0), w, torch.tensor(1.0), out_scale=torch.ones(2))
        with pytest.raises(TypeError, match="out_dtype must be one of"):
            G.fp8_linear(x, torch.tensor(1.0), w, torch.tensor(1.0), out_dtype=torch.int32)
        with pytest.raises(RuntimeError, match="needs cuda tensors"), use_backend("triton"):
            G.fp8_linear(x, torch.tensor(1.0), w, torch.tensor(1.0))


def test_launch_options_are_shared_read_only():
    """Every launch of a variant gets the same keyword mapping: it must not be writable by a caller."""
    options = core.linear_launch_options(G.CONFIGS["decode"], None, False, "bf16", False)
    assert options is core.linear_launch_options(G.CONFIGS["decode"], None, False, "bf16", False)
    with pytest.raises(TypeError):
        options["BLOCK_M"] = 16  # type: ignore[index]
    assert options["BLOCK_M"] == 64 and options["OUT_KIND"] == "bf16" and options["num_warps"] == 4


def test_weight_only_variants_back_to_back_match_the_reference():
    gen = torch.Generator().manual_seed(2)
    w = _ints(gen, N, K).to(torch.float8_e4m3fn)
    w13 = _ints(gen, 2 * N, K).to(torch.float8_e4m3fn)
    x = _ints(gen, M, K)
    channel = _pow2(gen, N)
    cases = [
        ("bf16 x, per-channel, bf16 out", x.bfloat16(), w, channel, {"out_dtype": torch.bfloat16}),
        ("fp16 x, per-tensor", x.half(), w, torch.tensor(0.5), {}),
        ("fp32 x, strided channel scale and bias", x, w, _strided(channel), {"bias": _strided(_ints(gen, N))}),
        ("3-D bf16 x, (N, 1) scale, FP8 out", x.bfloat16()[None], w, channel[:, None],
         {"out_scale": torch.tensor(4.0)}),
        ("3-D fp16 x not contiguous", torch.stack([x, x], 1)[:, :1].half(), w, channel, {}),
        ("bf16 x rows 2K apart, residual", torch.cat([x, x], 1)[:, :K].bfloat16(), w, channel,
         {"residual": _ints(gen, M, N)}),
        ("gated", x.bfloat16(), w13, _pow2(gen, 2 * N), {"activation": "swiglu"}),
        ("bf16 x, per-channel, again", x.bfloat16(), w, channel, {"out_dtype": torch.bfloat16}),
    ]
    with use_backend("triton-interpret"):
        for _ in range(2):
            for what, x_in, w_q, w_s, kw in cases:
                want = RW.fp8_weight_only_linear(x_in, w_q, w_s, **kw)
                got = TW.fp8_weight_only_linear(x_in, w_q, w_s, **kw)
                _assert_matches(got, want, "gated" in what, what)


@pytest.mark.parametrize("fmt", list(FP8Format))
def test_quantize_variants_back_to_back_match_the_reference(fmt):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, M, K, generator=gen) * 30
    with use_backend("triton-interpret"):
        for _ in range(2):
            for x_in in (x, x.bfloat16(), x[:, :, ::2], x[0]):
                for per_token in (True, False):
                    q, scale = TQ.dynamic_quantize(x_in, fmt, per_token)
                    want_scale = R.dynamic_scale(x_in, fmt, per_token)
                    assert torch.equal(scale, want_scale) and scale.shape == want_scale.shape
                    assert torch.equal(q.view(torch.uint8), R.quantize(x_in, want_scale, fmt).view(torch.uint8))
                for scale in (torch.tensor(0.125), torch.full((1, 1), 0.25), _pow2(gen, *x_in.shape[:-1], 1)):
                    want = R.quantize(x_in, scale, fmt).view(torch.uint8)
                    assert torch.equal(TQ.quantize(x_in, scale, fmt).view(torch.uint8), want)
        with pytest.raises(ValueError, match="does not broadcast"):
            TQ.quantize(x[0], torch.ones(1, 1, 1), fmt)  # one value, but more dims than x


@pytest.mark.parametrize("kind", ["block", "mx"])
def test_block_and_mx_linears_read_a_strided_bias(kind):
    """The block-scaled and MX linears' kernels index the bias by column, as the dense one's: a strided 1-D bias is
    made contiguous first (it was passed as the strided view, read at the wrong elements)."""
    gen = torch.Generator().manual_seed(4)
    k, n = 64, N
    x_q, w_q = _ints(gen, M, k).to(torch.float8_e4m3fn), _ints(gen, n, k).to(torch.float8_e4m3fn)
    bias = _strided(_ints(gen, n))
    with use_backend("triton-interpret"):
        if kind == "block":
            x_s, w_s = _pow2(gen, M, 2), _pow2(gen, 2, 2)  # (16, 32) blocks: N 24 → 2 row blocks, K 64 → 2
            got = TB.fp8_block_linear(x_q, x_s, w_q, w_s, block=(16, 32), bias=bias)
            want = RB.fp8_block_linear(x_q, x_s, w_q, w_s, block=(16, 32), bias=bias.contiguous())
        else:
            codes = lambda *shape: torch.randint(125, 129, shape, generator=gen, dtype=torch.uint8)  # noqa: E731
            x_s, w_s = codes(M, k // 32), codes(n, k // 32)  # E8M0: 2**-2 … 2**1
            got = TM.fp8_mx_linear(x_q, x_s, w_q, w_s, bias=bias)
            want = RM.fp8_mx_linear(x_q, x_s, w_q, w_s, bias=bias.contiguous())
    assert torch.equal(got, want), float((got - want).abs().max())
