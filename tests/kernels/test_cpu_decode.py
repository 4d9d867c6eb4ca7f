"""The compiled E4M3 decoder (kernels/cpu_decode.py) against torch's own FP8 casts, and the fallback."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dbr_quant.kernels import cpu_decode
from dbr_quant.kernels import reference as R

ALL_CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
FINITE = torch.isfinite(ALL_CODES.float())
NAN_CODES = ~FINITE


@pytest.fixture(scope="module")
def decoder():
    lib = cpu_decode.library()
    if lib is None:
        pytest.fail("the C decoder did not build on this machine (a C compiler is part of the dev setup)")
    return lib


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_every_code_decodes_exactly(decoder, dtype, flush_denormal):
    """All 256 codes, subnormals included, equal torch's cast; also with denormals-are-zero switched on
    (torch.set_flush_denormal), which a decoder that scaled subnormal floats would get wrong."""
    if flush_denormal and not torch.set_flush_denormal(True):
        pytest.fail("this CPU cannot flush denormals (no SSE3?)")
    try:
        got = cpu_decode.decode_e4m3(ALL_CODES.clone(), dtype)
    finally:
        torch.set_flush_denormal(False)  # torch's default; the call returns support, not the previous mode
    assert got is not None and got.dtype == dtype
    want = ALL_CODES.float().to(dtype)
    assert torch.equal(got[FINITE], want[FINITE])
    assert torch.equal(got[FINITE].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want[FINITE].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # ±0 too
    assert torch.equal(got[NAN_CODES].abs(), torch.full((2,), 480.0, dtype=dtype))  # as the torch fast path


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 70), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_same_bits_as_the_torch_path(decoder, rows, cols, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    torch_path = R.e4m3_to_fp32(q) if dtype == torch.float32 else R.e4m3_to_bf16(q)
    assert torch.equal(cpu_decode.decode_e4m3(q, dtype), torch_path)


def test_declines_what_it_cannot_read(decoder):
    q = torch.randn(8, 6).to(torch.float8_e4m3fn)
    assert cpu_decode.decode_e4m3(q.t(), torch.float32) is None  # not contiguous: the torch path takes it
    assert cpu_decode.decode_e4m3(q.to("meta"), torch.float32) is None


def test_upcast_uses_it_and_threads_agree(decoder):
    """reference.fp8_upcast goes through the decoder (into its scratch buffer for weights), and threads
    decoding at once (ctypes releases the GIL) each get their own exact result."""
    qs = [torch.randn(300, 200).mul(k + 1).to(torch.float8_e4m3fn) for k in range(8)]
    results: list = [None] * len(qs)

    def work(i):
        with torch.inference_mode():
            results[i] = [R.fp8_upcast(qs[i], torch.float32).clone() for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(qs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q, res in zip(qs, results):
        assert all(torch.equal(r, q.float()) for r in res)


def test_fallback_when_disabled(monkeypatch):
    monkeypatch.setenv(cpu_decode.ENV_VAR, "torch")
    cpu_decode.reset()
    try:
        assert cpu_decode.library() is None
        q = torch.randn(40, 30).to(torch.float8_e4m3fn)
        assert cpu_decode.decode_e4m3(q, torch.float32) is None
        assert torch.equal(R.fp8_upcast(q, torch.float32), q.float())  # the torch bit moves still run
        monkeypatch.setenv(cpu_decode.ENV_VAR, "fast")
        cpu_decode.reset()
        with pytest.raises(ValueError, match="DBR_QUANT_CPU_DECODE"):
            cpu_decode.library()
    finally:
        monkeypatch.delenv(cpu_decode.ENV_VAR)
        cpu_decode.reset()


def test_a_broken_compiler_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DBR_QUANT_CACHE_DIR", str(tmp_path / "cache"))
    cpu_decode.reset()
    try:
        assert cpu_decode.library() is None  # a missing compiler is silent: the torch path is correct
        (tmp_path / "bad-cc").write_text("#!/bin/sh\necho compiler says no >&2\nexit 1\n")
        (tmp_path / "bad-cc").chmod(0o755)
        monkeypatch.setenv("CC", str(tmp_path / "bad-cc"))
        cpu_decode.reset()
        with pytest.warns(RuntimeWarning, match="compiler says no"):
            assert cpu_decode.library() is None
    finally:
        cpu_decode.reset()
