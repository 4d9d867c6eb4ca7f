"""The Triton MXFP8 linear (kernels/triton/mx_gemm.py) in the CPU interpreter against kernels.reference.mx, and its
ahead-of-time rows: sm_100 (tl.dot_scaled → tcgen05 block-scaled FP8 MMA) and the sm_89/90 block path.

Triton 3.7.1's interpreter has no ``tl.dot_scaled`` (InterpreterBuilder lacks create_dot_scaled: asserted below, so
this test says when that changes); there the MX kernel runs its fp32 emulation of the scaled product (same tile
walk, masks, scale addressing, gated halves and epilogue), and the dot_scaled call is checked compiled for sm_100.
The "block" path (the block GEMM with 1×32 blocks: what sm_89/90 run) is tested in the interpreter as it is.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl
from test_triton_gemm import _jit_signature, _Recorder
from triton.backends.compiler import GPUTarget

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import mx as RM
from dbr_quant.kernels.triton import aot
from dbr_quant.kernels.triton import block_gemm as TB
from dbr_quant.kernels.triton import mx_gemm as TM
from dbr_quant.kernels.triton.gemm_core import GemmConfig

SMALL = {"scaled": GemmConfig("t", 16, 16, 64), "block": GemmConfig("t", 16, 16, 32)}


def _operands(gen, m, n_w, k, fmt_x=FP8Format.E4M3, fmt_w=FP8Format.E4M3, lead=()):
    x = torch.randn(*lead, m, k, generator=gen) * torch.exp2(torch.randint(-6, 6, (k,), generator=gen).float())
    w = torch.randn(n_w, k, generator=gen)
    x_q, x_s = RM.mx_quantize(x, fmt_x)
    w_q, w_s = RM.mx_quantize(w, fmt_w)
    return x_q, x_s, w_q, w_s


@pytest.mark.parametrize("path", ["scaled", "block"])
@pytest.mark.parametrize("m, n, k, lead, fmts, activation, has_bias, residual, out", [
    (1, 24, 64, (), ("e4m3", "e4m3"), None, False, None, torch.float32),  # decode, whole K blocks
    (7, 40, 100, (2,), ("e4m3", "e5m2"), "gelu", True, torch.float32, torch.bfloat16),  # ragged K: 100 = 3·32 + 4
    (19, 33, 70, (), ("e5m2", "e4m3"), "swiglu", True, torch.bfloat16, FP8Format.E4M3),  # gated, FP8 out
    (5, 16, 200, (), ("e4m3", "e4m3"), "relu", False, torch.float16, torch.float16),
])
def test_mx_linear_matches_reference(path, m, n, k, lead, fmts, activation, has_bias, residual, out):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    gated = activation in ("swiglu", "geglu", "geglu_tanh")
    n_w = 2 * n if gated else n
    x_q, x_s, w_q, w_s = _operands(gen, m, n_w, k, FP8Format.parse(fmts[0]), FP8Format.parse(fmts[1]), lead)
    bias = torch.randn(n_w, generator=gen) if has_bias else None
    res = None if residual is None else torch.randn(*lead, m, n, generator=gen).to(residual)
    kw = {"out_scale": torch.tensor(0.25), "out_fmt": out} if isinstance(out, FP8Format) else {"out_dtype": out}
    with use_backend("triton-interpret"):
        got = TM.fp8_mx_linear(x_q, x_s, w_q, w_s, bias=bias, activation=activation, residual=res,
                               config=SMALL[path], path=path, **kw)
    want = RM.fp8_mx_linear(x_q, x_s, w_q, w_s, bias=bias, activation=activation, residual=res, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    if isinstance(out, FP8Format):  # at most one FP8 step apart (fp32 addition order before the rounding)
        step = (want.float().abs() * 2.0**-3).clamp(min=2.0**-9)
        assert bool(((got.float() - want.float()).abs() <= step * 1.0001).all())
    else:
        scale = want.float().abs().amax().clamp(min=1.0)
        tol = 1e-5 if out == torch.float32 else 2.0**-7
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(scale))


def test_default_path_is_scaled_in_the_interpreter_and_refuses_float_scales():
    gen = torch.Generator().manual_seed(2)
    x_q, x_s, w_q, w_s = _operands(gen, 3, 16, 64)
    with use_backend("triton-interpret"), kernels.count_launches() as counts:
        got = kernels.fp8_mx_linear(x_q, x_s, w_q, w_s)
        assert TM.default_path(x_q.device) == "scaled"
        with pytest.raises(TypeError, match="E8M0"):
            TM.fp8_mx_linear(x_q, x_s.float(), w_q, w_s)
    assert counts == {"fp8_mx_linear": 1}
    torch.testing.assert_close(got, RM.fp8_mx_linear(x_q, x_s, w_q, w_s), rtol=1e-5, atol=1e-4)


def test_the_interpreter_still_lacks_dot_scaled():
    """Why the MX kernel is emulated in the interpreter: when this fails, the interpreter can run tl.dot_scaled
    and the test above can run SCALED_MMA=True."""

    @triton.jit
    def scaled(a_ptr, s_ptr, o_ptr):
        r, c, s = tl.arange(0, 16), tl.arange(0, 32), tl.arange(0, 1)
        a = tl.load(a_ptr + r[:, None] * 32 + c[None, :])
        sa = tl.load(s_ptr + r[:, None] + s[None, :])
        o = tl.dot_scaled(a, sa, tl.constexpr("e4m3"), a.T, sa, tl.constexpr("e4m3"))
        tl.store(o_ptr + r[:, None] * 16 + r[None, :], o)

    from triton.runtime.interpreter import InterpretedFunction

    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    with pytest.raises(Exception, match="create_dot_scaled"):
        InterpretedFunction(scaled.fn)[(1,)](a, torch.full((16, 1), 127, dtype=torch.uint8), torch.empty(16, 16))


# ---------------------------------------------------------------------------------------------------
# AOT: the table lists what the wrapper launches; sm_100 compiles to block-scaled FP8 MMA without spills


def test_aot_configs_cover_wrapper_launches(monkeypatch):
    rec_mx, rec_block = _Recorder(TM.MX_LINEAR_KERNEL), _Recorder(TB.BLOCK_LINEAR_KERNEL)
    monkeypatch.setattr(TM, "MX_LINEAR_KERNEL", rec_mx)
    monkeypatch.setattr(TB, "BLOCK_LINEAR_KERNEL", rec_block)
    monkeypatch.setattr(TM, "on_interpreter", lambda: False)  # launch as on a GPU: SCALED_MMA=True
    gen = torch.Generator().manual_seed(5)
    with use_backend("triton-interpret"):
        for path in ("scaled", "block"):
            for m, act, out, res in [(1, None, torch.float32, None), (40, "swiglu", FP8Format.E4M3, torch.bfloat16),
                                     (300, "gelu", torch.bfloat16, torch.float32)]:
                gated = act in ("swiglu",)
                x_q, x_s, w_q, w_s = _operands(gen, m, 512 if gated else 256, 384)
                kw = {"out_scale": torch.tensor(0.5), "out_fmt": out} if isinstance(out, FP8Format) else {
                    "out_dtype": out}
                TM.fp8_mx_linear(x_q, x_s, w_q, w_s, bias=torch.randn(w_q.shape[0]), activation=act, path=path,
                                 residual=None if res is None else torch.randn(m, 256).to(res), **kw)
    table = [(e[2], e[3], e[4]) for e in TM.AOT_CONFIGS]
    for rec in (rec_mx, rec_block):
        assert len(rec.launches) == 3
        for args, kwargs in rec.launches:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
            sig, consts = _jit_signature(rec.kernel, args, kwargs)
            assert (rec.kernel, sig, consts) in table, f"launch not in AOT_CONFIGS: {sig} {consts}"


def test_rows_are_tagged_for_their_architecture():
    configs = aot.all_configs("mx_linear")
    assert configs and all("sm_100" in c.description for c in configs)
    assert aot.for_arch(configs, 100) == configs and aot.for_arch(configs, 90) == []
    block_rows = [c for c in aot.all_configs("block_linear") if "mx=1x32" in c.description]
    assert block_rows and aot.for_arch(block_rows, 89) == block_rows and aot.for_arch(block_rows, 100) == []


def test_heaviest_mx_linear_compiles_to_block_scaled_fp8_mma_without_spills():
    entry = next(e for e in TM.AOT_CONFIGS if re.match(
        r"mx-large-gated .* e4m3xe4m3 act=swiglu bias=1 residual=bf16 out=fp8e4m3$", e[1]))
    src = triton.compiler.ASTSource(fn=entry[2].jit, signature=entry[3], constexprs=entry[4], attrs=TM.aot_attrs(entry))
    compiled = triton.compile(src, target=GPUTarget("cuda", 100, 32), options=TM.aot_options(entry))
    ptx = compiled.asm["ptx"]
    assert re.search(r"tcgen05\.mma[^\n;]*kind::mxf8f6f4\.block_scale", ptx)
    assert aot.fp8_mma_count(ptx, 100) > 0
    assert aot.ptxas_stats(ptx, 100)[1] == 0  # spill bytes


@pytest.mark.slow
def test_aot_tool_passes_on_sm_100(capsys):
    assert aot.main(["--arch", "100"]) == 0
    assert "_fp8_mx_linear_kernel" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 89])
def test_aot_tool_passes_on_the_mx_block_path(arch, capsys):
    assert aot.main(["--arch", str(arch), "--only", "block_linear"]) == 0
    assert "mx=1x32" in capsys.readouterr().out
