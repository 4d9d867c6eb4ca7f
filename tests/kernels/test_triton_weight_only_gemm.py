"""The Triton weight-only FP8 linear (kernels/triton/weight_only_gemm.py) in the CPU interpreter against
kernels.reference.weight_only, its bit-move E4M3 decode against torch's cast for all 254 finite codes, and its
ahead-of-time rows for sm_80 (bf16 MMA present, no spills)."""

from __future__ import annotations

import re

import pytest
import torch
import triton
from gpu.gpu_bounds import decode_once_bound  # tests/ is on sys.path (conftest): the bound the GPU tests use too
from test_triton_gemm import _jit_signature, _Recorder
from triton.backends.compiler import GPUTarget

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import weight_only as RW
from dbr_quant.kernels.triton import aot
from dbr_quant.kernels.triton import weight_decode as WD
from dbr_quant.kernels.triton import weight_only_gemm as TW
from dbr_quant.kernels.triton.gemm_core import GemmConfig

SMALL = GemmConfig("t", 16, 16, 32)


def _weight(gen, n, k, per_channel=True):
    w = torch.randn(n, k, generator=gen) * 3
    scale = torch.rand(n, generator=gen) + 0.05 if per_channel else torch.tensor(0.3)
    return (w * 40).clamp(-448, 448).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_is_torchs_cast_for_every_finite_code(dtype):
    """Identity rows select each weight column: the output is the decoded weight itself."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 254 finite codes (NaN excluded)
    w_q = codes.view(torch.float8_e4m3fn).reshape(2, 127)
    x = torch.eye(127, dtype=dtype)
    with use_backend("triton-interpret"):
        got = TW.fp8_weight_only_linear(x, w_q, torch.ones(2), config=SMALL)
    assert torch.equal(got, w_q.float().T)


def _case(seed, m, n, k, lead, dtype, per_channel, activation, has_bias, residual, out):
    """A weight-only linear's operands from ``seed``: (x, w_q, w_s, bias, residual, output keywords)."""
    gen = torch.Generator().manual_seed(seed)
    n_w = 2 * n if activation == "swiglu" else n
    w_q, w_s = _weight(gen, n_w, k, per_channel)
    x = torch.randn(*lead, m, k, generator=gen).to(dtype)
    bias = torch.randn(n_w, generator=gen) if has_bias else None
    res = None if residual is None else torch.randn(*lead, m, n, generator=gen).to(residual)
    kw = {"out_scale": torch.tensor(4.0), "out_fmt": out} if isinstance(out, FP8Format) else {"out_dtype": out}
    return x, w_q, w_s, bias, res, kw


@pytest.mark.parametrize("m, n, k, lead, dtype, per_channel, activation, has_bias, residual, out", [
    (1, 24, 64, (), torch.bfloat16, True, None, False, None, torch.bfloat16),  # decode
    (7, 40, 100, (2,), torch.float16, True, "gelu", True, torch.float32, torch.float16),  # ragged K
    (19, 33, 70, (), torch.bfloat16, False, "swiglu", True, torch.bfloat16, torch.float32),  # gated, per tensor
    (5, 16, 48, (), torch.float32, True, "silu", False, None, FP8Format.E4M3),  # fp32 x (rounded to bf16), FP8 out
])
def test_weight_only_linear_matches_reference(m, n, k, lead, dtype, per_channel, activation, has_bias, residual,
                                              out):
    x, w_q, w_s, bias, res, kw = _case(m * 100 + k, m, n, k, lead, dtype, per_channel, activation, has_bias,
                                       residual, out)
    with use_backend("triton-interpret"):
        got = TW.fp8_weight_only_linear(x, w_q, w_s, bias=bias, activation=activation, residual=res, config=SMALL,
                                        **kw)
    x_mma = x.bfloat16() if dtype == torch.float32 else x  # what the kernel multiplies (documented)
    want = RW.fp8_weight_only_linear(x_mma, w_q, w_s, bias=bias, activation=activation, residual=res, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    if isinstance(out, FP8Format):
        step = (want.float().abs() * 2.0**-3).clamp(min=2.0**-9)
        assert bool(((got.float() - want.float()).abs() <= step * 1.0001).all())
    else:
        scale = float(want.float().abs().amax().clamp(min=1.0))
        tol = 1e-5 if out == torch.float32 else 2.0**-7
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


def test_entry_point_runs_the_kernel_on_the_triton_backend():
    gen = torch.Generator().manual_seed(1)
    w_q, w_s = _weight(gen, 32, 64)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    with use_backend("triton-interpret"), kernels.count_launches() as counts:
        got = kernels.fp8_weight_only_linear(x, w_q, w_s, out_dtype=torch.float32)
    assert counts == {"fp8_weight_only_linear": 1}
    torch.testing.assert_close(got, RW.fp8_weight_only_linear(x, w_q, w_s), rtol=1e-5, atol=1e-3)


def test_refuses_e5m2_weights():
    with use_backend("triton-interpret"), pytest.raises(TypeError, match="float8_e4m3fn"):
        TW.fp8_weight_only_linear(torch.randn(2, 16), torch.randn(4, 16).to(torch.float8_e5m2), torch.ones(4))


# ---------------------------------------------------------------------------------------------------
# AOT: the table lists what the wrapper launches; sm_80 compiles to bf16 MMA without spills


def test_aot_configs_cover_wrapper_launches(monkeypatch):
    rec = _Recorder(TW.WEIGHT_ONLY_KERNEL)
    monkeypatch.setattr(TW, "WEIGHT_ONLY_KERNEL", rec)
    monkeypatch.setattr(TW, "on_interpreter", lambda: False)  # launch as on a GPU: bf16 tiles into the MMA
    gen = torch.Generator().manual_seed(5)
    with use_backend("triton-interpret"):
        for m, dtype, act, out, res, per_channel in [
                (1, torch.bfloat16, None, torch.bfloat16, None, True),
                (40, torch.float16, "swiglu", FP8Format.E4M3, torch.bfloat16, False),
                (300, torch.float32, "gelu", torch.float32, torch.float32, True)]:
            n_w = 512 if act == "swiglu" else 256
            w_q, w_s = _weight(gen, n_w, 384, per_channel)
            kw = {"out_scale": torch.tensor(0.5), "out_fmt": out} if isinstance(out, FP8Format) else {"out_dtype": out}
            TW.fp8_weight_only_linear(torch.randn(m, 384).to(dtype), w_q, w_s, bias=torch.randn(n_w), activation=act,
                                      residual=None if res is None else torch.randn(m, 256).to(res), **kw)
    table = [(e[2], e[3], e[4]) for e in TW.AOT_CONFIGS]
    assert len(rec.launches) == 3
    for args, kwargs in rec.launches:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        sig, consts = _jit_signature(rec.kernel, args, kwargs)
        assert (rec.kernel, sig, consts) in table, f"launch not in AOT_CONFIGS: {sig} {consts}"


def test_heaviest_weight_only_linear_compiles_to_bf16_mma_without_spills():
    entry = next(e for e in TW.AOT_CONFIGS if re.match(
        r"large-gated .* x=bf16 act=swiglu bias=1 residual=bf16 out=fp8e4m3$", e[1]))
    src = triton.compiler.ASTSource(fn=entry[2].jit, signature=entry[3], constexprs=entry[4], attrs=TW.aot_attrs(entry))
    compiled = triton.compile(src, target=GPUTarget("cuda", 80, 32), options=TW.aot_options(entry))
    ptx = compiled.asm["ptx"]
    assert re.search(r"mma\.sync[^\n;]*\.bf16\.bf16", ptx) and aot.fp8_mma_count(ptx, 80) > 0
    assert not re.search(r"\be4m3\b|cvt[^\n;]*e4m3", ptx)  # decoded by integer moves: no FP8 conversion on sm_80
    assert aot.ptxas_stats(ptx, 80)[1] == 0  # spill bytes


def test_mma_detection_per_architecture():
    assert aot.fp8_mma_count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {...};", 80) == 1
    assert aot.fp8_mma_count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {...};", 89) == 0
    assert aot.fp8_mma_count("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X [%r1];", 100) == 1
    assert aot.fp8_mma_count("tcgen05.mma.cta_group::1.kind::f16 [%r1];", 100) == 0
    rows = aot.all_configs("weight_only")
    assert rows and aot.for_arch(rows, 80) == rows and aot.for_arch(rows, 90) == []


@pytest.mark.slow
def test_aot_tool_passes_on_sm_80(capsys):
    assert aot.main(["--arch", "80"]) == 0
    assert "_fp8_weight_only_linear_kernel" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# prefill: above DECODE_ONCE_ABOVE_M rows W is decoded once (weight_decode) and multiplied by torch.matmul


@pytest.mark.parametrize("m, n, k, lead, dtype, per_channel, activation, has_bias, residual, out", [
    (33, 40, 100, (2,), torch.bfloat16, True, None, False, None, torch.bfloat16),  # plain: the matmul's own output
    (20, 24, 64, (), torch.float16, True, "gelu", True, torch.float32, torch.float32),
    (19, 33, 70, (), torch.bfloat16, False, "swiglu", True, torch.bfloat16, torch.float32),  # gated, per tensor
    (9, 16, 48, (), torch.float32, True, "silu", False, None, FP8Format.E4M3),  # fp32 x (rounded to bf16), FP8 out
])
def test_decode_once_path_within_its_bound(m, n, k, lead, dtype, per_channel, activation, has_bias, residual, out):
    x, w_q, w_s, bias, res, kw = _case(m * 100 + k + 1, m, n, k, lead, dtype, per_channel, activation, has_bias,
                                       residual, out)
    with use_backend("triton-interpret"):
        got = TW.fp8_weight_only_linear(x, w_q, w_s, bias=bias, activation=activation, residual=res,
                                        path="decode_once", **kw)
    x_mma = x.bfloat16() if dtype == torch.float32 else x
    want = RW.fp8_weight_only_linear(x_mma, w_q, w_s, bias=bias, activation=activation, residual=res, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    pre = RW.fp8_weight_only_linear(x_mma, w_q, w_s, bias=bias)
    bound = decode_once_bound(x_mma, w_q, w_s, pre, activation).reshape(want.shape)
    err = (got.double() - want.double()).abs()
    if isinstance(out, FP8Format):  # one FP8 step of the value (in out_scale units) beyond the bound
        bound = bound / 4.0 + (want.double().abs() * 2.0**-3).clamp(min=2.0**-9) * 1.0001
    elif out != torch.float32:  # the output dtype's own rounding of both
        bound = bound + 2.0**-8 * want.double().abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def test_the_bound_is_tight_enough_to_fail():
    """The decode-once bound catches a wrong path: the fused result with the weight scale applied twice fails it."""
    gen = torch.Generator().manual_seed(3)
    w_q, w_s = _weight(gen, 32, 64)
    x = torch.randn(8, 64, generator=gen).bfloat16()
    want = RW.fp8_weight_only_linear(x, w_q, w_s)
    wrong = RW.fp8_weight_only_linear(x, w_q, w_s * (1 + 2.0**-6))
    assert not bool(((wrong - want).abs() <= decode_once_bound(x, w_q, w_s, want, None)).all())


def test_dispatch_rule_picks_the_path_by_rows(monkeypatch):
    """Up to DECODE_ONCE_ABOVE_M rows the fused kernel runs, above it the decode kernel and torch.matmul; both
    through the op table's entry point."""
    assert TW.pick_path(TW.DECODE_ONCE_ABOVE_M) == "fused" and TW.pick_path(TW.DECODE_ONCE_ABOVE_M + 1) == "decode_once"
    fused, decode = _Recorder(TW.WEIGHT_ONLY_KERNEL), _Recorder(WD.DECODE_WEIGHT)
    monkeypatch.setattr(TW, "WEIGHT_ONLY_KERNEL", fused)
    monkeypatch.setattr(WD, "DECODE_WEIGHT", decode)
    w_q, w_s = _weight(torch.Generator().manual_seed(0), 16, 32)
    with use_backend("triton-interpret"), kernels.count_launches() as counts:
        for m in (TW.DECODE_ONCE_ABOVE_M, TW.DECODE_ONCE_ABOVE_M + 1):
            kernels.fp8_weight_only_linear(torch.zeros(m, 32, dtype=torch.bfloat16), w_q, w_s)
    assert len(fused.launches) == 1 and len(decode.launches) == 1
    assert counts == {"fp8_weight_only_linear": 2}


def test_prefill_rows_run_the_decode_once_path_against_the_reference():
    """M = DECODE_ONCE_ABOVE_M + 1 through the entry point with nothing patched: within the decode-once bound."""
    gen = torch.Generator().manual_seed(11)
    w_q, w_s = _weight(gen, 24, 40)
    x = torch.randn(TW.DECODE_ONCE_ABOVE_M + 1, 40, generator=gen).bfloat16()
    with use_backend("triton-interpret"):
        got = kernels.fp8_weight_only_linear(x, w_q, w_s, out_dtype=torch.float32)
    want = RW.fp8_weight_only_linear(x, w_q, w_s)
    assert bool(((got - want).abs() <= decode_once_bound(x, w_q, w_s, want, None)).all())
