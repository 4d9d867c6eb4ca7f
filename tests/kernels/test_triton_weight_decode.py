"""The Triton E4M3 weight decode (kernels/triton/weight_decode.py) in the CPU interpreter against
kernels.reference.dense.dequantize to bf16/fp16, bit for bit, and its ahead-of-time rows for sm_80."""

from __future__ import annotations

import re

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from test_triton_gemm import _jit_signature, _Recorder
from triton.backends.compiler import GPUTarget

from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.triton import aot
from dbr_quant.kernels.triton import weight_decode as WD

DTYPES = [torch.bfloat16, torch.float16]
CODES = torch.arange(256, dtype=torch.uint8)
FINITE = CODES[(CODES & 0x7F) != 0x7F]  # 254 codes: E4M3's NaN excluded (weights never hold it)


def _check(w_q: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> None:
    with use_backend("triton-interpret"):
        got = WD.decode_weight(w_q, w_scale, dtype)
    want = R.dequantize(w_q, w_scale.reshape(-1, 1) if w_scale.numel() > 1 else w_scale.reshape(()), dtype)
    assert got.dtype == dtype and got.shape == w_q.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bits: -0.0 and subnormals included


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy's fp16 cast: inf, as torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [[1.0, 1.0], [0.37, 3e-4], [2.0**-20, 1e-7], [5e3, 1e-30], [0.011]])
def test_every_finite_code_times_its_scale(dtype, scale):
    """All 254 finite codes in each of two rows (per channel) or one scale (per tensor): ties of the rounding to
    bf16/fp16, fp16 subnormals and underflow (2⁻²⁰, 1e-7), fp16 overflow to inf (5e3·448), -0.0."""
    w_q = FINITE.repeat(2).view(torch.float8_e4m3fn).reshape(2, 254)
    _check(w_q, torch.tensor(scale), dtype)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 300), dtype=st.sampled_from(DTYPES), per_channel=st.booleans(),
       log_scale=st.floats(-30, 10), seed=st.integers(0, 2**31), transposed=st.booleans())
def test_matches_reference_bit_for_bit(n, k, dtype, per_channel, log_scale, seed, transposed):
    """Ragged N and K (masked tile edges), random codes and scales, a non-contiguous weight (copied first)."""
    gen = torch.Generator().manual_seed(seed)
    codes = FINITE[torch.randint(0, FINITE.numel(), (k, n) if transposed else (n, k), generator=gen)]
    w_q = codes.view(torch.float8_e4m3fn)
    w_q = w_q.t() if transposed else w_q
    scale = (torch.rand(n if per_channel else 1, generator=gen) + 0.5) * 2.0**log_scale
    _check(w_q, scale if per_channel else scale.reshape(()), dtype)


def test_refuses_what_it_cannot_decode():
    w_q = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with use_backend("triton-interpret"):
        with pytest.raises(TypeError, match="decode_weight: decodes to bf16 or fp16"):
            WD.decode_weight(w_q, torch.ones(4), torch.float32)
        with pytest.raises(TypeError, match="float8_e4m3fn matrix"):
            WD.decode_weight(w_q.view(torch.float8_e5m2), torch.ones(4), torch.bfloat16)
        with pytest.raises(ValueError, match="one value or one per row"):
            WD.decode_weight(w_q, torch.ones(3), torch.bfloat16)


# ---------------------------------------------------------------------------------------------------
# AOT: the table lists what the wrapper launches; sm_80 compiles it without spills or FP8 conversions


def test_aot_configs_cover_wrapper_launches(monkeypatch):
    rec = _Recorder(WD.DECODE_WEIGHT)
    monkeypatch.setattr(WD, "DECODE_WEIGHT", rec)
    w_q = torch.zeros(96, 300, dtype=torch.float8_e4m3fn)
    with use_backend("triton-interpret"):
        for dtype in DTYPES:
            WD.decode_weight(w_q, torch.ones(96), dtype)
            WD.decode_weight(w_q, torch.tensor(0.5), dtype)
    table = [(e[2], e[3], e[4]) for e in WD.AOT_CONFIGS]
    assert len(rec.launches) == 4 and len(table) == 2
    for args, kwargs in rec.launches:
        kwargs = {k: v for k, v in kwargs.items() if k != "num_warps"}
        sig, consts = _jit_signature(rec.kernel, args, kwargs)
        assert (rec.kernel, sig, consts) in table, f"launch not in AOT_CONFIGS: {sig} {consts}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_compiles_for_sm_80_without_spills_or_fp8_conversions(dtype):
    entry = next(e for e in WD.AOT_CONFIGS if e[1].startswith(f"out={dtype}"))
    assert aot.for_arch([aot.Config("weight_decode", 0, entry[0], entry[1])], 80)
    src = triton.compiler.ASTSource(fn=entry[2].jit, signature=entry[3], constexprs=entry[4])
    ptx = triton.compile(src, target=GPUTarget("cuda", 80, 32), options={"num_warps": WD.NUM_WARPS}).asm["ptx"]
    assert not re.search(r"\be4m3\b|cvt[^\n;]*e4m3", ptx)  # decoded by integer moves
    assert aot.ptxas_stats(ptx, 80)[1] == 0  # spill bytes
