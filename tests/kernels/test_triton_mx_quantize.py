"""The Triton MX quantize (kernels/triton/mx_quantize.py) in the CPU interpreter against kernels.reference.mx, bit
for bit (FP8 bytes and E8M0 codes), and its ahead-of-time rows (sm_89, sm_90, sm_100: compiled, no spills, no FP8
conversion instruction)."""

from __future__ import annotations

import re

import pytest
import torch
import triton
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_triton_gemm import _jit_signature, _Recorder
from test_triton_quantize import DTYPES, assert_bit_equal, inputs
from triton.backends.compiler import GPUTarget

import dbr_quant as dq
from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import mx as RM
from dbr_quant.kernels.triton import aot
from dbr_quant.kernels.triton import mx_quantize as TM

FORMATS = list(FP8Format)


def _check(x: torch.Tensor, fmt: FP8Format, round_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with use_backend("triton-interpret"):
        q, code = TM.mx_quantize(x, fmt, round_up)
    q_ref, code_ref = RM.mx_quantize(x, fmt, round_up)
    assert code.dtype == torch.uint8 and torch.equal(code, code_ref)
    assert_bit_equal(q, q_ref)
    return q, code


@settings(max_examples=25, deadline=None)
@given(x=inputs(max_rows=40, max_n=200), fmt=st.sampled_from(FORMATS), round_up=st.booleans(),
       log_scale=st.integers(-40, 40))
@example(x=torch.zeros(3, 64), fmt=FP8Format.E4M3, round_up=False, log_scale=0)
def test_matches_reference_bit_for_bit(x, fmt, round_up, log_scale):
    """Any shape (ragged K included), dtype, magnitude (scaled by 2^log_scale: subnormal and huge blocks), special
    values and all-zero rows; non-contiguous inputs."""
    _check(x * 2.0**log_scale, fmt, round_up)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("round_up", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_blocks(fmt, round_up, dtype):
    """One 32-wide block per case: all zero (code 127), signed zeros, saturating top mantissas (1.75 < m < 2: floor
    saturates them, ceil moves up one code), fp32 subnormals (code 0 at the clamp), the largest finite values,
    inf/NaN beside finite ones (ignored by the amax), a block of only non-finite values, and a ragged tail of 5."""
    finfo = torch.finfo(dtype)
    rows = [
        torch.zeros(32),
        torch.tensor([-0.0, 0.0] * 16),
        torch.full((32,), 1.9) * torch.linspace(-1, 1, 32).sign(),
        torch.linspace(-1.99, 1.99, 32) * 2.0**10,
        torch.full((32,), 1.75 * 2.0**8),
        torch.full((32,), 2.0**-140),
        torch.linspace(-1, 1, 32) * 2.0**-130,
        torch.linspace(-1, 1, 32) * finfo.max,
        torch.cat([torch.tensor([float("inf"), float("-inf"), float("nan")]), torch.linspace(0.1, 3, 29)]),
        torch.tensor([float("nan"), float("inf")] * 16),
    ]
    x = torch.stack(rows).to(dtype)
    q, code = _check(torch.cat([x, x[:, :5]], dim=1), fmt, round_up)  # K = 37: a full block and a tail of 5
    assert code.shape == (len(rows), 2) and int(code[0, 0]) == 127  # all-zero block: scale 1
    saturating = RM.mx_dequantize(q[2:3, :32], code[2:3, :1])
    assert bool((saturating.abs() <= 1.75).all()) != round_up  # floor clips the 1.9 block to 1.75, ceil does not


@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (2, 0, 33)])
def test_empty_tensors(shape):
    _check(torch.randn(shape), FP8Format.E4M3, False)


def test_scalar_is_refused_with_what_to_do():
    with use_backend("triton-interpret"), pytest.raises(ValueError, match="mx_quantize: .*at least one dimension"):
        TM.mx_quantize(torch.tensor(1.0))


def test_fp64_and_leading_dims():
    x = torch.randn(2, 3, 70, dtype=torch.float64) * 1e3
    _check(x, FP8Format.E4M3, True)


def test_entry_point_runs_the_kernel_and_the_mx_model_uses_it():
    """kernels.mx_quantize on the Triton backend is this kernel (one launch); an MXFP8 model's activation quantize
    and weights go through it, and the converted model's output equals the reference backend's bit for bit (the
    interpreter's MX GEMM emulates the scaled MMA in fp32 in another order: compared within fp32 rounding)."""
    x = torch.randn(5, 96) * 7
    with use_backend("triton-interpret"), kernels.count_launches() as counts:
        q, code = kernels.mx_quantize(x, round_up=True)
    assert dict(counts) == {"mx_quantize": 1}
    q_ref, code_ref = RM.mx_quantize(x, round_up=True)
    assert torch.equal(code, code_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))

    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32)).eval()
    inp = torch.randn(3, 64)
    converted = dq.convert(dq.prepare(model, (inp,), dq.QConfig.mxfp8()))
    with torch.no_grad(), use_backend("triton-interpret"), kernels.count_launches() as counts:
        got = converted(inp)
    assert counts["mx_quantize"] == 2 and counts["fp8_mx_linear"] == 2
    with torch.no_grad(), use_backend("reference"):
        want = converted(inp)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------
# AOT: the table lists what the wrapper launches; each row compiles for sm_89, sm_90 and sm_100


def test_aot_configs_cover_wrapper_launches(monkeypatch):
    rec = _Recorder(TM.MX_QUANTIZE)
    monkeypatch.setattr(TM, "MX_QUANTIZE", rec)
    with use_backend("triton-interpret"):
        for dtype in DTYPES:
            for fmt in FORMATS:
                for round_up in (False, True):
                    TM.mx_quantize(torch.randn(40, 300).to(dtype), fmt, round_up)
    table = [(e[2], e[3], e[4]) for e in TM.AOT_CONFIGS]
    assert len(rec.launches) == len(table) == 12
    for args, kwargs in rec.launches:
        sig, consts = _jit_signature(rec.kernel, args, kwargs)
        assert (rec.kernel, sig, consts) in table, f"launch not in AOT_CONFIGS: {sig} {consts}"


def test_aot_rows_are_for_the_mx_gpus():
    rows = aot.all_configs("mx_quantize")
    assert rows and all(aot.for_arch(rows, arch) == rows for arch in (89, 90, 100))
    assert aot.for_arch(rows, 80) == []


@pytest.mark.parametrize("arch", [89, 90, 100])
def test_compiles_without_spills_or_fp8_conversions(arch):
    entry = next(e for e in TM.AOT_CONFIGS if e[1].startswith("x=bf16 e4m3 round=ceil"))
    src = triton.compiler.ASTSource(fn=entry[2].jit, signature=entry[3], constexprs=entry[4])
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32)).asm["ptx"]
    assert not re.search(r"cvt[^\n;]*e4m3|cvt[^\n;]*e5m2", ptx)  # bytes built by integer ops
    assert aot.ptxas_stats(ptx, arch)[1] == 0  # spill bytes
