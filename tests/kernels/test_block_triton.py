"""The block-scaled Triton kernels in the CPU interpreter against kernels.reference.block, and compiled ahead of
time for Hopper (wgmma) and Ada (mma.sync).

* fp8_block_linear: small 16×16×32 tiles and small scale blocks (bn 16…128 with tiles straddling them, bk 32…96)
  so every case has several tiles, several K blocks and ragged M, N and K; tolerance relative to Σ|P·scale|
  (the fp32 dot accumulates in another order than torch), FP8 outputs within one step.
* group_quantize: bit for bit (amax is order-independent, the rest is IEEE).
* layer_norm_group_quantize: normalized output within fp32 rounding of the reference, and its (fp8, scale)
  bit for bit equal to reference group_quantize of that output.
"""

from __future__ import annotations

import math
import re
from unittest import mock

import pytest
import torch
import triton
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_triton_gemm import _jit_signature, _Recorder
from test_triton_norm import fp8_ordinal
from triton.backends.compiler import GPUTarget

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import block as RB
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.triton import aot
from dbr_quant.kernels.triton import block_gemm as TB
from dbr_quant.kernels.triton import group_quantize as TG
from dbr_quant.kernels.triton.gemm import GemmConfig

SMALL = GemmConfig("test", 16, 16, 32, GROUP_M=2)
FORMATS = list(FP8Format)
ACTS = [None, *R.ACTIVATIONS, *R.GATED]
REL = 1e-5


def _operands(gen, lead, m, n, k, block, fmt_x, fmt_w, gated):
    """Group-quantized activations with outlier channels, [gate; up] weights blocked half by half."""
    x = torch.randn(*lead, m, k, generator=gen) * torch.exp(torch.randn(k, generator=gen))
    x_q, x_s = RB.group_quantize(x, block[1], fmt_x)
    halves = [RB.block_quantize_weight(torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen)),
                                       block, fmt_w) for _ in range(2 if gated else 1)]
    return x_q, x_s, torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


def _magnitude(x_q, x_s, w_q, w_s, block, bias, gated):
    """Σ|x·w| with scales (what the fp32 summation order can perturb); gate·up magnitudes when gated."""
    halves = (w_q.chunk(2), w_s.chunk(2)) if gated else ((w_q,), (w_s,))  # gated: each half its own grid
    w = torch.cat([RB.block_dequantize(q, s, block).double().abs() for q, s in zip(*halves)])
    x = RB.group_dequantize(x_q, x_s, block[1]).double().abs()
    mag = x @ w.T + (0 if bias is None else bias.double().abs())
    if gated:
        gate, up = mag.chunk(2, dim=-1)
        return (gate.max() * up.max() + gate.max() + up.max()).item()
    return mag.max().item()


@settings(max_examples=50, deadline=None)
@given(
    m=st.sampled_from([1, 2, 5, 17, 33]),
    n=st.integers(1, 60),
    k=st.sampled_from([1, 31, 32, 33, 64, 95, 96, 97, 200]),
    lead=st.sampled_from([(), (2,)]),
    block=st.sampled_from([(16, 32), (24, 64), (48, 96), (128, 32), (7, 32)]),
    fmt_x=st.sampled_from(FORMATS),
    fmt_w=st.sampled_from(FORMATS),
    has_bias=st.booleans(),
    activation=st.sampled_from(ACTS),
    residual=st.sampled_from([None, torch.float32, torch.bfloat16]),
    out=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, FP8Format.E4M3, FP8Format.E5M2]),
    seed=st.integers(0, 2**16),
)
@example(m=1, n=17, k=64, lead=(2,), block=(7, 32), fmt_x=FP8Format.E4M3, fmt_w=FP8Format.E5M2, has_bias=False,
         activation="gelu", residual=None, out=FP8Format.E5M2, seed=709)  # gelu's tail in E5M2 subnormals
def test_fp8_block_linear_matches_reference(m, n, k, lead, block, fmt_x, fmt_w, has_bias, activation, residual, out,
                                            seed):
    gen = torch.Generator().manual_seed(seed)
    gated = activation in R.GATED
    x_q, x_s, w_q, w_s = _operands(gen, lead, m, n, k, block, fmt_x, fmt_w, gated)
    bias = torch.randn(w_q.shape[0], generator=gen) if has_bias else None
    res = None if residual is None else torch.randn(*lead, m, n, generator=gen).to(residual)
    kw = dict(block=block, bias=bias, activation=activation, residual=res)
    ref = RB.fp8_block_linear(x_q, x_s, w_q, w_s, **kw)
    with use_backend("triton-interpret"):
        if isinstance(out, FP8Format):
            out_scale = R.amax(ref) / out.max * (0.5 + torch.rand((), generator=gen)) + 1e-6  # some saturate
            got = TB.fp8_block_linear(x_q, x_s, w_q, w_s, out_scale=out_scale, out_fmt=out, config=SMALL, **kw)
        else:
            got = TB.fp8_block_linear(x_q, x_s, w_q, w_s, out_dtype=out, config=SMALL, **kw)
    assert got.shape == (*lead, m, n)
    if isinstance(out, FP8Format):
        want = R.quantize(ref, out_scale, out)
        steps = (fp8_ordinal(got) - fp8_ordinal(want)).abs()
        # Far in an activation's tail fp32 itself is noise: gelu(-5.35) = 0.5·x·(1 + erf) cancels to a multiple
        # of |x|·2**-24 (torch fp32 -1.59e-7, the exact reference -3.19e-7, true -2.36e-7), and E5M2 subnormals
        # are finer than that (seed 709: 4 steps). Such elements are compared absolutely, with the float tolerance.
        tol = REL * (_magnitude(x_q, x_s, w_q, w_s, block, bias, gated) + ref.abs().max().item()) + 1e-30
        noise = (got.float() * out_scale - ref).abs() <= tol
        off = (steps != 0) & ~noise
        assert not ((steps > 1) & ~noise).any()
        assert off.sum() <= max(1, int(0.01 * got.numel()))
        return
    assert got.dtype == out
    tol = REL * (_magnitude(x_q, x_s, w_q, w_s, block, bias, gated) + ref.abs().max().item()) + 1e-30
    step = 0.0 if out == torch.float32 else ref.abs() * 2.0 ** -(8 if out == torch.bfloat16 else 11)
    out_max = torch.finfo(out).max  # outlier channels × gated products can overflow fp16: inf, as ref.to(fp16)
    over = ref.abs() >= out_max * (1 - 2.0**-11)
    assert torch.all(got.float()[over].abs() >= out_max) and torch.equal(got[over].sign(), ref[over].sign().to(out))
    err = (got.float() - ref).abs()[~over]
    assert torch.all(err <= tol + (step if out == torch.float32 else step[~over])), (
        f"max error {err.max().item():.3g} > tolerance {tol:.3g}")


@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_checkpoint_blocks_through_the_dispatch_default_configs(activation):
    """128×128 blocks, the tile config the wrapper picks (BLOCK_K = 128), N and K not multiples of 128,
    decode M = 1 and a 20-token prefill, through kernels.fp8_block_linear on the interpreter backend."""
    gen = torch.Generator().manual_seed(3)
    for m in (1, 20):
        x_q, x_s, w_q, w_s = _operands(gen, (), m, 130, 300, (128, 128), FP8Format.E4M3, FP8Format.E4M3,
                                       activation is not None)
        ref = RB.fp8_block_linear(x_q, x_s, w_q, w_s, activation=activation)
        with use_backend("triton-interpret"), kernels.count_launches() as counts:
            got = kernels.fp8_block_linear(x_q, x_s, w_q, w_s, activation=activation)
        assert counts == {"fp8_block_linear": 1}
        tol = REL * (_magnitude(x_q, x_s, w_q, w_s, (128, 128), None, activation is not None) + ref.abs().max())
        assert (got - ref).abs().max() <= tol


def test_block_k_must_divide_the_scale_block():
    gen = torch.Generator().manual_seed(4)
    x_q, x_s, w_q, w_s = _operands(gen, (), 3, 20, 100, (16, 48), FP8Format.E4M3, FP8Format.E4M3, False)
    with use_backend("triton-interpret"):
        with pytest.raises(ValueError, match="BLOCK_K must divide the scale block's K"):
            TB.fp8_block_linear(x_q, x_s, w_q, w_s, block=(16, 48), config=SMALL)  # 32 does not divide 48
        x_q, x_s, w_q, w_s = _operands(gen, (), 3, 20, 100, (16, 96), FP8Format.E4M3, FP8Format.E4M3, False)
        got = TB.fp8_block_linear(x_q, x_s, w_q, w_s, block=(16, 96))  # picked config narrowed to BLOCK_K 32
    ref = RB.fp8_block_linear(x_q, x_s, w_q, w_s, block=(16, 96))
    assert (got - ref).abs().max() <= REL * _magnitude(x_q, x_s, w_q, w_s, (16, 96), None, False)


@st.composite
def activations(draw, max_rows=40, max_k=400):
    shape = (*[draw(st.integers(1, 4)) for _ in range(draw(st.integers(0, 2)))], draw(st.integers(1, max_k)))
    while torch.Size(shape[:-1]).numel() > max_rows:
        shape = shape[1:]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[-1], generator=gen) * 2)
    x = (x * 10.0 ** draw(st.integers(-3, 3))).to(draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])))
    flat = x.view(-1, shape[-1])
    if draw(st.booleans()):
        flat[0, :7] = 0.0  # part of a group (a whole one when the group is small)
    if draw(st.booleans()):
        flat[-1, -1] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0]))
    if draw(st.booleans()):
        x = torch.empty(*shape[:-1], 2 * shape[-1], dtype=x.dtype)[..., ::2].copy_(x)  # non-contiguous
    return x


@settings(max_examples=40, deadline=None)
@given(x=activations(), group=st.sampled_from([128, 64, 48, 7, 1]), fmt=st.sampled_from(FORMATS))
def test_group_quantize_is_bit_exact(x, group, fmt):
    with use_backend("triton-interpret"):
        q, scale = TG.group_quantize(x, group, fmt)
    q_ref, s_ref = RB.group_quantize(x, group, fmt)
    assert scale.shape == s_ref.shape == (*x.shape[:-1], math.ceil(x.shape[-1] / group))
    assert torch.equal(scale, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@settings(max_examples=25, deadline=None)
@given(x=activations(max_rows=8, max_k=600), group=st.sampled_from([128, 48]), fmt=st.sampled_from(FORMATS),
       rms=st.booleans(), affine=st.booleans(), block=st.sampled_from([None, 64]))
def test_layer_norm_group_quantize_matches_reference(x, group, fmt, rms, affine, block):
    x = x.nan_to_num(0.0, 0.0, 0.0)  # non-finite rows: see test_triton_norm.test_special_rows (same statistics code)
    n = x.shape[-1]
    weight, bias = (torch.randn(n), torch.randn(n)) if affine else (None, None)
    blocks = (block,) if block else TG.NORM_BLOCKS  # a small block: rows longer than the statistics block
    with use_backend("triton-interpret"), mock.patch.object(TG, "NORM_BLOCKS", blocks):
        y, q, scale = TG.layer_norm_group_quantize(x, weight, bias, 1e-5, group, fmt, rms=rms)
    y_ref, q_ref, s_ref = RB.layer_norm_group_quantize(x, weight, bias, 1e-5, group, fmt, rms=rms)
    assert y.dtype == x.dtype and q.shape == x.shape and scale.shape == s_ref.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        q_own, s_own = RB.group_quantize(y, group, fmt)  # its FP8 is exactly the group quantization of its y
        assert torch.equal(scale, s_own) and torch.equal(q.view(torch.uint8), q_own.view(torch.uint8))
    else:
        torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(scale, s_ref, rtol=1e-5, atol=0)
    steps = (fp8_ordinal(q) - fp8_ordinal(q_ref)).abs()
    assert steps.max() <= 1 and (steps == 0).float().mean() >= 0.99


def test_dispatch_routes_group_kernels_to_triton():
    x = torch.randn(4, 300)
    with use_backend("triton-interpret"), kernels.count_launches() as counts:
        q, s = kernels.group_quantize(x)
        y, q2, s2 = kernels.layer_norm_group_quantize(x, None, None, 1e-5)
    assert counts == {"group_quantize": 1, "norm_group_quantize": 1}
    q_ref, s_ref = RB.group_quantize(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert s2.shape == (4, 3)


# ---------------------------------------------------------------------------------------------------
# AOT table: it lists what the wrappers launch (128×128 blocks), and it compiles to FP8 MMA without spills


def test_aot_configs_cover_wrapper_launches(monkeypatch):
    recorders = {name: _Recorder(getattr(mod, name)) for mod, name in
                 ((TB, "BLOCK_LINEAR_KERNEL"), (TG, "GROUP_QUANTIZE"), (TG, "LAYER_NORM_GROUP_QUANTIZE"))}
    monkeypatch.setattr(TB, "BLOCK_LINEAR_KERNEL", recorders["BLOCK_LINEAR_KERNEL"])
    monkeypatch.setattr(TG, "GROUP_QUANTIZE", recorders["GROUP_QUANTIZE"])
    monkeypatch.setattr(TG, "LAYER_NORM_GROUP_QUANTIZE", recorders["LAYER_NORM_GROUP_QUANTIZE"])
    gen = torch.Generator().manual_seed(5)
    with use_backend("triton-interpret"):
        for m, act, out, res in [(1, None, torch.float32, None), (40, "swiglu", FP8Format.E4M3, torch.bfloat16),
                                 (300, "gelu", torch.bfloat16, torch.float32)]:
            gated = act in R.GATED
            x_q, x_s, w_q, w_s = _operands(gen, (), m, 256, 384, (128, 128), FP8Format.E4M3, FP8Format.E4M3, gated)
            kw = {"out_scale": torch.tensor(0.5), "out_fmt": out} if isinstance(out, FP8Format) else {"out_dtype": out}
            TB.fp8_block_linear(x_q, x_s, w_q, w_s, bias=torch.randn(w_q.shape[0]), activation=act,
                                residual=None if res is None else torch.randn(m, 256).to(res), **kw)
        for dtype in (torch.float32, torch.bfloat16):
            TG.group_quantize(torch.randn(3, 256).to(dtype))
            TG.layer_norm_group_quantize(torch.randn(3, 256).to(dtype), torch.randn(256), None, 1e-5, rms=True)
    table = [(e[2], e[3], e[4]) for mod in (TB, TG) for e in mod.AOT_CONFIGS]
    for rec in recorders.values():
        assert rec.launches
        for args, kwargs in rec.launches:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
            sig, consts = _jit_signature(rec.kernel, args, kwargs)
            assert (rec.kernel, sig, consts) in table, f"launch not in AOT_CONFIGS: {sig} {consts}"


@pytest.mark.parametrize("arch", [90, 89])
def test_heaviest_block_linear_compiles_to_fp8_mma_without_spills(arch):
    """The large gated tile with every epilogue feature (two accumulators and two partial tiles live)."""
    entry = next(e for e in TB.AOT_CONFIGS if re.match(
        r"large-gated .* e4m3xe4m3 act=swiglu bias=1 residual=bf16 out=fp8e4m3$", e[1]))
    src = triton.compiler.ASTSource(fn=entry[2].jit, signature=entry[3], constexprs=entry[4], attrs=TB.aot_attrs(entry))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=TB.aot_options(entry))
    ptx = compiled.asm["ptx"]
    assert aot.fp8_mma_count(ptx, arch) > 0
    assert aot.ptxas_stats(ptx, arch)[1] == 0  # spill bytes
    assert compiled.metadata.shared <= 99 * 1024  # Ada's per-block limit


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 89])
def test_aot_tool_passes_on_the_block_kernels(arch, capsys):
    assert aot.main(["--arch", str(arch), "--only", "group_quantize"]) == 0
    assert aot.main(["--arch", str(arch), "--only", "block_linear"]) == 0
    assert "_fp8_block_linear_kernel" in capsys.readouterr().out
