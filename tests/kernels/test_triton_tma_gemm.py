"""The sm_90 TMA persistent FP8 linear (kernels/triton/tma_gemm.py) in the CPU interpreter against the
reference, its dispatch (which kernel the dense and block-scaled wrappers launch), and its AOT rows.

The interpreter runs tensor descriptors (Triton 3.7; 3.6's cannot iterate ``tl.range`` over tensor bounds)
with the hardware's out-of-bounds rule, zero fill, so ragged M, N and K edges test the same masking-free
main loop the GPU runs. Tiles are 16×16×32 with 3 programs, so every case walks several tiles per program.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_triton import _magnitude, _operands
from test_triton_gemm import _assert_fp8_close, _fp8, _jit_signature, _Recorder, _tolerance
from triton.backends.compiler import GPUTarget

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import block as RB
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.triton import aot
from dbr_quant.kernels.triton import block_gemm as TB
from dbr_quant.kernels.triton import gemm as G
from dbr_quant.kernels.triton import tma_gemm as T

FORMATS = list(FP8Format)
ACTS = [None, *R.ACTIVATIONS, *R.GATED]
OUTS = [torch.float32, torch.bfloat16, torch.float16, FP8Format.E4M3, FP8Format.E5M2]
REL = 1e-5


def _small(flatten: bool, halves: bool = False) -> T.TmaConfig:
    return T.TmaConfig("test", 16, 16, 32, GROUP_M=2, num_warps=4, num_stages=2, flatten=flatten,
                       epilogue_halves=halves)


def _out_kwargs(out, ref, gen):
    if isinstance(out, FP8Format):
        out_scale = R.amax(ref) / out.max * (0.5 + torch.rand((), generator=gen)) + 1e-6  # some saturate
        return {"out_scale": out_scale, "out_fmt": out}
    return {"out_dtype": out}


def _check(got, ref, out, kwargs, tol, kind):
    """FP8 out: within one step of the reference quantized, rarely; else within tol (+ one output rounding)."""
    if isinstance(out, FP8Format):
        _assert_fp8_close(got, R.quantize(ref, kwargs["out_scale"], out), kind)
        return
    assert got.dtype == out
    step = 0.0 if out == torch.float32 else ref.abs() * 2.0 ** -(8 if out == torch.bfloat16 else 11)
    finite = ref.abs() < torch.finfo(out).max * (1 - 2.0**-11)  # fp16 overflow: inf, as ref.to(fp16)
    err = (got.float() - ref).abs()
    assert torch.all((err <= tol + step)[finite]), f"max error {err[finite].max().item():.3g} > tolerance {tol:.3g}"


@settings(max_examples=30, deadline=None)
@given(
    m=st.sampled_from([1, 5, 17, 40]),
    n=st.integers(1, 40),
    k=st.sampled_from([16, 48, 64, 80]),  # TMA: K % 16 == 0; 48 and 80 leave a ragged last K step
    fmt_x=st.sampled_from(FORMATS),
    fmt_w=st.sampled_from(FORMATS),
    per_row=st.booleans(),
    per_channel=st.booleans(),
    has_bias=st.booleans(),
    activation=st.sampled_from(ACTS),
    residual=st.sampled_from([None, torch.float32, torch.bfloat16]),
    out=st.sampled_from(OUTS),
    flatten=st.booleans(),
    halves=st.booleans(),  # the epilogue on two column halves (the wide tile's), ragged N included
    seed=st.integers(0, 2**16),
)
def test_dense_tma_linear_matches_reference(m, n, k, fmt_x, fmt_w, per_row, per_channel, has_bias, activation,
                                            residual, out, flatten, halves, seed):
    gen = torch.Generator().manual_seed(seed)
    n_w = 2 * n if activation in R.GATED else n
    x_q, w_q = _fp8((m, k), fmt_x, gen), _fp8((n_w, k), fmt_w, gen)
    xs = torch.rand((m, 1) if per_row else (), generator=gen) * 0.1 + 1e-3
    ws = torch.rand((n_w,) if per_channel else (), generator=gen) * 0.1 + 1e-3
    bias = torch.randn(n_w, generator=gen) if has_bias else None
    res = None if residual is None else torch.randn((m, n), generator=gen).to(residual)
    ref = R.fp8_linear(x_q, xs, w_q, ws, bias=bias, activation=activation, residual=res)
    kwargs = _out_kwargs(out, ref, gen)
    with use_backend("triton-interpret"):
        got = G.fp8_linear(x_q, xs, w_q, ws, bias=bias, activation=activation, residual=res,
                           config=_small(flatten, halves), kernel="tma", **kwargs)
    assert got.shape == (m, n)
    _check(got, ref, out, kwargs, _tolerance(x_q, xs, w_q, ws, bias, activation, ref), "tma dense")


@settings(max_examples=25, deadline=None)
@given(
    m=st.sampled_from([1, 5, 33]),
    n=st.integers(1, 40),
    k=st.sampled_from([32, 64, 96, 160]),
    block=st.sampled_from([(16, 32), (24, 64), (128, 32), (7, 32)]),  # tiles straddle the N blocks
    fmt_x=st.sampled_from(FORMATS),
    fmt_w=st.sampled_from(FORMATS),
    has_bias=st.booleans(),
    activation=st.sampled_from(ACTS),
    residual=st.sampled_from([None, torch.float32]),
    out=st.sampled_from(OUTS),
    seed=st.integers(0, 2**16),
)
def test_block_tma_linear_matches_reference(m, n, k, block, fmt_x, fmt_w, has_bias, activation, residual, out,
                                            seed):
    gen = torch.Generator().manual_seed(seed)
    gated = activation in R.GATED
    x_q, x_s, w_q, w_s = _operands(gen, (), m, n, k, block, fmt_x, fmt_w, gated)
    bias = torch.randn(w_q.shape[0], generator=gen) if has_bias else None
    res = None if residual is None else torch.randn(m, n, generator=gen).to(residual)
    kw = dict(block=block, bias=bias, activation=activation, residual=res)
    ref = RB.fp8_block_linear(x_q, x_s, w_q, w_s, **kw)
    kwargs = _out_kwargs(out, ref, gen)
    with use_backend("triton-interpret"):
        got = TB.fp8_block_linear(x_q, x_s, w_q, w_s, config=_small(False), kernel="tma", **kw, **kwargs)
    assert got.shape == (m, n)
    tol = REL * (_magnitude(x_q, x_s, w_q, w_s, block, bias, gated) + ref.abs().max().item()) + 1e-30
    if isinstance(out, FP8Format):
        # as test_block_triton: elements whose fp32 value is within tol of the reference are noise, not steps
        want = R.quantize(ref, kwargs["out_scale"], out)
        noise = (got.float() * kwargs["out_scale"] - ref).abs() <= tol
        off = (got.view(torch.uint8) != want.view(torch.uint8)) & ~noise
        assert off.sum() <= max(1, int(0.01 * got.numel()))
        return
    _check(got, ref, out, kwargs, tol, "tma block")


@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_default_tile_through_the_op_table(activation):
    """The tiles tma_config gives (128×128×128 "tma-wide" for the dense ungated linear, 128×64×128 for the gated
    and the block-scaled ones), forced through kernels.fp8_linear / fp8_block_linear (the op table's entry points)
    with forced_kernel: 128-row tiles over 300 rows, K = 384 (three TMA K steps)."""
    gen = torch.Generator().manual_seed(7)
    gated = activation is not None
    m, n, k = 300, 48, 384
    x_q, w_q = _fp8((m, k), FP8Format.E4M3, gen), _fp8((2 * n if gated else n, k), FP8Format.E4M3, gen)
    xs, ws = torch.rand(m, 1, generator=gen) * 0.05, torch.tensor(0.02)
    bx_q, bx_s, bw_q, bw_s = _operands(gen, (), m, n, k, (128, 128), FP8Format.E4M3, FP8Format.E4M3, gated)
    recorder = _Recorder(T.TMA_LINEAR_KERNEL)
    with use_backend("triton-interpret"), T.forced_kernel("tma"), kernels.count_launches() as counts:
        got = kernels.fp8_linear(x_q, xs, w_q, ws, activation=activation)
        got_block = kernels.fp8_block_linear(bx_q, bx_s, bw_q, bw_s, activation=activation)
        with pytest.MonkeyPatch.context() as patch:  # which kernel the auto choice launches, recorded not run
            patch.setattr(T, "TMA_LINEAR_KERNEL", recorder)
            with T.forced_kernel(None):
                kernels.fp8_linear(x_q, xs, w_q, ws, activation=activation)
    assert counts == {"fp8_linear": 2, "fp8_block_linear": 1}
    assert not recorder.launches  # the interpreter's automatic choice is the pointer kernel
    ref = R.fp8_linear(x_q, xs, w_q, ws, activation=activation)
    assert (got - ref).abs().max() <= _tolerance(x_q, xs, w_q, ws, None, activation, ref)
    ref_block = RB.fp8_block_linear(bx_q, bx_s, bw_q, bw_s, activation=activation)
    tol = REL * (_magnitude(bx_q, bx_s, bw_q, bw_s, (128, 128), None, gated) + ref_block.abs().max())
    assert (got_block - ref_block).abs().max() <= tol


def test_automatic_choice(monkeypatch):
    """Off by default (measured slower on an H100: tma_gemm.AUTO_TMA); with AUTO_TMA on, TMA on sm_90 for
    m > TMA_MIN_ROWS with TMA-ready operands and no pointer-kernel config; else classic."""
    monkeypatch.setattr(T, "on_interpreter", lambda: False)
    monkeypatch.setattr(T, "_is_sm90", lambda device: True)
    rows = T.TMA_MIN_ROWS + 1
    a, w = torch.zeros(rows, 64, dtype=torch.float8_e4m3fn), torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    assert not T.use_tma("op", None, a, w, rows, False)  # the shipped default
    assert T.use_tma("op", "tma", a, w, rows, False)  # asked for
    monkeypatch.setattr(T, "AUTO_TMA", True)
    assert T.use_tma("op", None, a, w, rows, False)
    assert not T.use_tma("op", None, a[:-1], w, rows - 1, False)  # small M
    assert not T.use_tma("op", None, a, w, rows, True)  # a pointer-kernel config was given
    assert not T.use_tma("op", "classic", a, w, rows, False)
    assert T.use_tma("op", None, a, w, rows, False, block_k=256)
    assert not T.use_tma("op", None, a, w, rows, False, block_k=64)  # the 128-wide TMA K step straddles blocks
    unaligned = torch.zeros(rows, 72, dtype=torch.float8_e4m3fn)[:, :70]  # row stride 72 B: not 16-byte aligned
    assert not T.use_tma("op", None, unaligned, w[:, :70], rows, False)
    with T.forced_kernel("classic"):
        assert not T.use_tma("op", None, a, w, rows, False)
        assert T.use_tma("op", "tma", a, w, rows, False)  # the call's keyword wins
    monkeypatch.setattr(T, "_is_sm90", lambda device: False)  # sm_89
    assert not T.use_tma("op", None, a, w, rows, False)


def test_forced_tma_refuses_what_it_cannot_run():
    gen = torch.Generator().manual_seed(8)
    x_q, w_q = _fp8((20, 77), FP8Format.E4M3, gen), _fp8((16, 77), FP8Format.E4M3, gen)
    with use_backend("triton-interpret"):
        with pytest.raises(ValueError, match="16-byte aligned"):
            G.fp8_linear(x_q, torch.tensor(1.0), w_q, torch.tensor(1.0), kernel="tma")
        with pytest.raises(ValueError, match="unknown kernel"):
            G.fp8_linear(x_q, torch.tensor(1.0), w_q, torch.tensor(1.0), kernel="wgmma")
    x_q, w_q = _fp8((20, 64), FP8Format.E4M3, gen), _fp8((24, 64), FP8Format.E4M3, gen)
    with use_backend("triton-interpret"):  # a plain GemmConfig (no flatten field) is taken as a TMA tile
        got = G.fp8_linear(x_q, torch.tensor(0.5), w_q, torch.tensor(0.25), kernel="tma",
                           config=G.GemmConfig("plain", 16, 16, 32, num_warps=4, num_stages=2))
    ref = R.fp8_linear(x_q, torch.tensor(0.5), w_q, torch.tensor(0.25))
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    with pytest.raises(ValueError, match="unknown kernel"), T.forced_kernel("fast"):
        pass
    x_q, x_s, w_q, w_s = _operands(gen, (), 4, 16, 128, (16, 64), FP8Format.E4M3, FP8Format.E4M3, False)
    with use_backend("triton-interpret"), pytest.raises(ValueError, match="must divide the scale block"):
        TB.fp8_block_linear(x_q, x_s, w_q, w_s, block=(16, 64), kernel="tma")  # BLOCK_K 128 > bk 64


# ---------------------------------------------------------------------------------------------------
# AOT table: the rows are what the wrappers launch, and they compile to TMA copies and FP8 wgmma


def test_aot_configs_cover_tma_launches(monkeypatch):
    recorder = _Recorder(T.TMA_LINEAR_KERNEL)
    monkeypatch.setattr(T, "TMA_LINEAR_KERNEL", recorder)
    gen = torch.Generator().manual_seed(9)
    with use_backend("triton-interpret"), T.forced_kernel("tma"):
        for act, fmt, out, res in [(None, FP8Format.E4M3, torch.float32, None),
                                   ("swiglu", FP8Format.E5M2, FP8Format.E4M3, torch.bfloat16),
                                   ("gelu_tanh", FP8Format.E4M3, torch.float16, torch.float32)]:
            n_w = 64 if act in R.GATED else 32
            kw = {"out_scale": torch.tensor(0.5), "out_fmt": out} if isinstance(out, FP8Format) else {"out_dtype": out}
            residual = None if res is None else torch.randn(300, 32).to(res)
            G.fp8_linear(_fp8((300, 256), fmt, gen), torch.rand(300, 1), _fp8((n_w, 256), FP8Format.E4M3, gen),
                         torch.rand(n_w), bias=torch.randn(n_w), activation=act, residual=residual, **kw)
            x_q, x_s, w_q, w_s = _operands(gen, (), 300, 32, 256, (128, 128), fmt, FP8Format.E4M3, act in R.GATED)
            TB.fp8_block_linear(x_q, x_s, w_q, w_s, bias=torch.randn(n_w), activation=act, residual=residual, **kw)
    table = [(e[2], e[3], e[4]) for e in T.AOT_CONFIGS]
    assert len(recorder.launches) == 6
    for args, kwargs in recorder.launches:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        sig, consts = _jit_signature(recorder.kernel, args, kwargs)
        assert (recorder.kernel, sig, consts) in table, f"launch not in AOT_CONFIGS: {sig} {consts}"


def test_each_linear_gets_the_tile_it_compiles_without_spills():
    """Dense ungated linears take the wide tile; gated and block-scaled ones keep the 128×64 tile, whose wide
    version spills (TMA_CONFIGS); the AOT table holds each tile only for the linears it is launched for."""
    wide, narrow = T.TMA_CONFIGS["tma-wide"], T.TMA_CONFIGS["tma"]
    assert (wide.BLOCK_M, wide.BLOCK_N, wide.BLOCK_K) == (128, 128, 128) and narrow.BLOCK_N == 64
    assert T.tma_config(False, False) is wide
    assert T.tma_config(True, False) is narrow and T.tma_config(False, True) is narrow
    for entry in T.AOT_CONFIGS:
        name = entry[1].split()[0]
        if name == "tma-wide":
            assert "block=" not in entry[1] and not entry[4]["GATED"]
        else:
            assert name in ("tma", "tma-gated")


def test_tma_rows_are_for_sm_90_only():
    rows = [c for c in aot.all_configs("tma")]
    assert rows and all("sm_90" in c.description for c in rows)
    assert aot.for_arch(rows, 89) == [] and aot.for_arch(rows, 90) == rows


@pytest.mark.parametrize("pattern", [
    r"tma-gated .* sm_90 block=128x128 e4m3xe4m3 act=swiglu bias=1 residual=fp32 out=fp8e4m3$",
    r"tma .* sm_90 block=128x128 e4m3xe4m3 act=gelu bias=1 residual=fp32 out=fp16$",  # 128x128 spills here (3.6)
    r"tma-wide .* sm_90 e4m3xe4m3 act=gelu bias=1 residual=fp32 out=fp32$",  # 255 registers under 3.6
])
def test_heaviest_tma_rows_compile_to_tma_and_fp8_wgmma_without_spills(pattern):
    [entry] = [e for e in T.AOT_CONFIGS if re.search(pattern, e[1])]
    src = triton.compiler.ASTSource(fn=entry[2].jit, signature=entry[3], constexprs=entry[4], attrs=T.aot_attrs(entry))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=T.aot_options(entry))
    ptx = compiled.asm["ptx"]
    assert aot.tma_count(ptx) > 0 and aot.fp8_mma_count(ptx, 90) > 0
    assert aot.ptxas_stats(ptx, 90)[1] == 0  # spill bytes
    assert compiled.metadata.shared <= 227 * 1024  # Hopper's per-block limit
