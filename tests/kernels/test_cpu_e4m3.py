"""The compiled E4M3 decoder (kernels/cpu_e4m3.py) against torch's own FP8 casts, and the fallback."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sequential import sequential_linear

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import backend as C
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3
from dbr_quant.kernels.cpu import upcast
from dbr_quant.kernels.cpu.features import use_cpu_gemm
from dbr_quant.kernels.reference import dense as R

ALL_CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
FINITE = torch.isfinite(ALL_CODES.float())
NAN_CODES = ~FINITE


@pytest.fixture(scope="module")
def decoder():
    lib = cpu_e4m3.library()
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
        got = cpu_e4m3.decode_e4m3(ALL_CODES.clone(), dtype)
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
    torch_path = upcast.e4m3_to_fp32(q) if dtype == torch.float32 else upcast.e4m3_to_bf16(q)
    assert torch.equal(cpu_e4m3.decode_e4m3(q, dtype), torch_path)


def test_declines_what_it_cannot_read(decoder):
    q = torch.randn(8, 6).to(torch.float8_e4m3fn)
    assert cpu_e4m3.decode_e4m3(q.t(), torch.float32) is None  # not contiguous: the torch path takes it
    assert cpu_e4m3.decode_e4m3(q.to("meta"), torch.float32) is None


def test_upcast_uses_it_and_threads_agree(decoder):
    """upcast.fp8_upcast goes through the decoder (into its scratch buffer for weights), and threads
    decoding at once (ctypes releases the GIL) each get their own exact result."""
    qs = [torch.randn(300, 200).mul(k + 1).to(torch.float8_e4m3fn) for k in range(8)]
    results: list = [None] * len(qs)

    def work(i):
        with torch.inference_mode():
            results[i] = [upcast.fp8_upcast(qs[i], torch.float32).clone() for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(qs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q, res in zip(qs, results):
        assert all(torch.equal(r, q.float()) for r in res)


def test_fallback_when_disabled(monkeypatch):
    monkeypatch.setenv(cpu_e4m3.ENV_VAR, "torch")
    cpu_e4m3.reset()
    try:
        assert cpu_e4m3.library() is None
        q = torch.randn(40, 30).to(torch.float8_e4m3fn)
        assert cpu_e4m3.decode_e4m3(q, torch.float32) is None
        assert torch.equal(upcast.fp8_upcast(q, torch.float32), q.float())  # the torch bit moves still run
        monkeypatch.setenv(cpu_e4m3.ENV_VAR, "fast")
        cpu_e4m3.reset()
        with pytest.raises(ValueError, match="DBR_QUANT_CPU_DECODE"):
            cpu_e4m3.library()
    finally:
        monkeypatch.delenv(cpu_e4m3.ENV_VAR)
        cpu_e4m3.reset()


def _torch_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The definition: saturate x·(1/scale), then torch's own cast (round to nearest even)."""
    return (x.float() * torch.reciprocal(scale.float())).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("flush_denormal", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-3, 2.0**-20, 1e30])
def test_quantize_sweeps_fp32_bit_patterns(decoder, scale, flush_denormal):
    """Every 4099th fp32 bit pattern (all exponents, both signs, subnormals, ±inf, NaNs, so every rounding case
    of every E4M3 binade including ties), times five scales: the C quantize equals clamp + torch's cast bit for
    bit, with denormals-are-zero on or off."""
    x = torch.arange(0, 2**32, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
    s = torch.tensor([scale])
    if flush_denormal and not torch.set_flush_denormal(True):
        pytest.fail("this CPU cannot flush denormals (no SSE3?)")
    try:
        got, want = cpu_e4m3.quantize_e4m3(x, s), _torch_quantize(x, s)
    finally:
        torch.set_flush_denormal(False)
    assert got is not None and got.dtype == torch.float8_e4m3fn
    assert torch.equal(_bits(got), _bits(want))


def test_quantize_every_tie_and_every_bf16(decoder):
    """The exact midpoints between neighbouring E4M3 values (ties go to the even code), one ulp either side of
    them, and all 65536 bf16 bit patterns as bf16 input."""
    grid = ALL_CODES[FINITE].float().unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(-1.0)),
                      torch.tensor([448.0, 463.99, 464.0, 1e9])])
    x = torch.cat([near, -near])
    one = torch.ones(1)
    assert torch.equal(_bits(cpu_e4m3.quantize_e4m3(x, one)), _bits(_torch_quantize(x, one)))
    xb = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for s in (one, torch.tensor([0.0123])):
        assert torch.equal(_bits(cpu_e4m3.quantize_e4m3(xb, s)), _bits(_torch_quantize(xb, s)))


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), seed=st.integers(0, 2**31 - 1),
       per_row=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_quantize_and_scaled_decode_per_row(decoder, shape, seed, per_row, dtype):
    """Per-row (per-token) or single scales of any magnitude: quantize equals the torch definition, and the
    scaled decode equals ``q.float() * scale`` (both bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * torch.rand(shape, generator=g).mul(12).sub(6).exp2()).to(dtype)
    s_shape = (*shape[:-1], 1) if per_row else (1,)
    s = torch.rand(s_shape, generator=g).mul(8).sub(4).exp2()
    q = cpu_e4m3.quantize_e4m3(x, s)
    assert torch.equal(_bits(q), _bits(_torch_quantize(x, s)))
    assert torch.equal(cpu_e4m3.decode_e4m3_scaled(q, s), q.float() * s)
    assert torch.equal(C.dequantize_operand(q, s), q.float() * s)  # the CPU backend's fp32 GEMM operand


def test_quantize_declines_what_it_cannot_index(decoder):
    x = torch.randn(6, 8)
    assert cpu_e4m3.quantize_e4m3(x.t(), torch.ones(1)) is None  # not contiguous
    assert cpu_e4m3.quantize_e4m3(x.half(), torch.ones(1)) is None  # fp16 input: the torch path
    assert cpu_e4m3.quantize_e4m3(x, torch.ones(8)) is None  # a per-column scale is not a per-row one
    assert cpu_e4m3.quantize_e4m3(x, torch.ones(1, 1, 1)) is None  # broadcasts to more dims than x
    assert cpu_e4m3.quantize_e4m3(x, torch.ones(1, dtype=torch.float64)) is None
    assert cpu_e4m3.quantize_e4m3(x.requires_grad_(), torch.ones(1)) is None  # autograd records the torch ops
    for s in (torch.ones(8), torch.ones(1, 1, 1)):  # and the CPU backend's quantize still broadcasts them
        assert torch.equal(_bits(C.quantize(x.detach(), s, FP8Format.E4M3)), _bits(_torch_quantize(x.detach(), s)))


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), k=st.integers(1, 64), n=st.integers(1, 64),
       per_row=st.booleans(), per_channel=st.booleans(), bias=st.booleans(), relu=st.booleans(),
       residual=st.booleans(), fp8_out=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_small_linear_is_the_sequential_definition(decoder, lead, k, n, per_row, per_channel, bias, relu, residual,
                                                   fp8_out, seed):
    """One C call for a small FP8 linear equals the definition written as fp32 torch ops one k at a time
    (operands dequantized first, every product and sum rounded, no fused multiply-add), bit for bit; with
    ``out_scale`` its E4M3 output equals the quantize of that result; the CPU backend's fp8_linear takes it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)
    w = torch.randn(n, k, generator=g)
    xs = torch.rand(*lead, 1, generator=g) * 0.01 + 1e-3 if per_row else torch.tensor(0.004)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-3 if per_channel else torch.tensor(0.003)
    xq = C.quantize(x, xs, FP8Format.E4M3)
    wq = C.quantize(w, ws.reshape(-1, 1) if per_channel else ws, FP8Format.E4M3)
    b = torch.randn(n, generator=g) if bias else None
    r = torch.randn(*lead, n, generator=g) if residual else None
    out_s = torch.tensor(0.01) if fp8_out else None
    got = cpu_e4m3.small_linear(xq, xs, wq, ws, b, "relu" if relu else None, r, torch.float32, out_s, True)
    want = sequential_linear(xq, xs, wq, ws, b, relu, r)
    if fp8_out:
        want = C.quantize(want, out_s, FP8Format.E4M3)
    assert got is not None and torch.equal(_bits(got) if fp8_out else got, _bits(want) if fp8_out else want)
    via_backend = C.fp8_linear(xq, xs, wq, ws, bias=b, activation="relu" if relu else None, residual=r,
                                 out_scale=out_s)
    assert torch.equal(_bits(via_backend) if fp8_out else via_backend, _bits(got) if fp8_out else got)


def test_small_linear_declines_what_it_does_not_compute_exactly(decoder):
    xq = torch.randn(3, 8).to(torch.float8_e4m3fn)
    wq = torch.randn(4, 8).to(torch.float8_e4m3fn)
    s = torch.tensor(0.5)
    call = lambda **kw: cpu_e4m3.small_linear(**{**dict(  # noqa: E731
        x_q=xq, x_scale=s, w_q=wq, w_scale=s, bias=None, activation=None, residual=None, out_dtype=torch.float32,
        out_scale=None, out_e4m3=True), **kw})
    assert call() is not None
    assert call(activation="gelu") is None  # torch's erf is not C's: the torch path keeps the bits
    assert call(out_dtype=torch.bfloat16) is None
    assert call(out_scale=s, out_e4m3=False) is None  # E5M2 output
    assert call(x_q=torch.randn(3, 8).to(torch.float8_e5m2)) is None
    assert call(w_q=torch.randn(4, 2000).to(torch.float8_e4m3fn), x_q=torch.randn(3, 2000).to(torch.float8_e4m3fn)) \
        is None  # 8000 weight elements: not small
    assert call(bias=torch.randn(4, dtype=torch.bfloat16)) is None
    assert call(w_scale=torch.rand(4, 1)) is None  # per-channel scales as (N,) or one value only
    # inference only: a module's bias (a parameter that requires grad) is read as is, in or out of grad mode,
    # so the bits never depend on the grad mode
    bias = torch.nn.Parameter(torch.randn(4))
    with torch.no_grad():
        want = call(bias=bias)
    got = call(bias=bias)
    assert torch.equal(got, want) and got.grad_fn is None


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 + F16C without AVX-512; the portable loops
def test_every_vector_path_gives_the_same_bits(decoder, march, monkeypatch, tmp_path):
    """This machine runs the library built for itself; the same source built for other x86 targets takes the
    other code paths (their binaries run here: these targets are subsets of any AVX-512 or AVX2 CPU). Each
    must give the native build's bits for every code, every length (vector bodies and scalar tails)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"x86 targets only; this is {platform.machine()}")
    monkeypatch.setenv("DBR_QUANT_CACHE_DIR", str(tmp_path))
    other, why = cpu_e4m3._build(march)
    assert other is not None, why
    g = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 31, 32, 33, 100, 256 * 9 + 7):
        q = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        s = torch.tensor([0.37])
        for lib in (decoder, other):
            f32, bf16, scaled = torch.empty(n), torch.empty(n, dtype=torch.bfloat16), torch.empty(n)
            lib.dbr_e4m3_to_fp32(q.data_ptr(), f32.data_ptr(), n)
            lib.dbr_e4m3_to_bf16(q.data_ptr(), bf16.data_ptr(), n)
            lib.dbr_e4m3_to_fp32_scaled(q.data_ptr(), scaled.data_ptr(), 1, n, s.data_ptr(), 0)
            finite = torch.isfinite(q.float())
            assert torch.equal(f32[finite].view(torch.int32), q.float()[finite].view(torch.int32)), (march, n)
            assert torch.equal(bf16[finite].float(), q.float()[finite]) and torch.equal(scaled, f32 * s), (march, n)
            assert torch.equal(f32[~finite].abs(), torch.full_like(f32[~finite], 480.0))


@pytest.mark.parametrize("act", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("residual_shape", [None, (3, 4), (4,), (1, 4)])
@pytest.mark.parametrize("fp8_out", [False, True])
def test_small_gemm_is_the_c_one_whatever_the_epilogue(decoder, act, residual_shape, fp8_out):
    """A fused linear equals its ops one by one: whatever the epilogue (one C computes, or one torch runs on the
    C result: GELU, a broadcast residual), the small GEMM is the C call's, bit for bit."""
    g = torch.Generator().manual_seed(1)
    xq = torch.randn(3, 8, generator=g).to(torch.float8_e4m3fn)
    wq = torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn)
    xs, ws, b = torch.tensor(0.03), torch.rand(4, generator=g) * 0.1, torch.randn(4, generator=g)
    r = None if residual_shape is None else torch.randn(residual_shape, generator=g)
    out_s = torch.tensor(0.05) if fp8_out else None
    got = C.fp8_linear(xq, xs, wq, ws, bias=b, activation=act, residual=r, out_scale=out_s)
    base = cpu_e4m3.small_linear(xq, xs, wq, ws, b, None, None, torch.float32, None, True)
    assert torch.equal(base, sequential_linear(xq, xs, wq, ws, b))
    want = R.linear_epilogue(base.clone(), act, r, torch.float32, out_s, FP8Format.E4M3)
    assert torch.equal(_bits(got) if fp8_out else got, _bits(want) if fp8_out else want)


@pytest.mark.parametrize("threads", [2, 3])
def test_passes_split_across_threads_give_the_same_bits(decoder, threads):
    """Large passes run on torch's thread count (OpenMP, the runtime torch loaded), in chunks of whole rows where
    each row has its own scale, else of elements. Tiny chunks here force the split (ragged last chunks included):
    the same bits as one thread. On a build without OpenMP both runs are single-threaded (and equal)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 101, generator=g) * 10
    per_row, one = torch.rand(37, 1, generator=g) + 0.01, torch.tensor([0.05])
    runs = []
    before = torch.get_num_threads()
    for split in (False, True):
        decoder.dbr_set_parallel_min(64 if split else 1 << 40)
        torch.set_num_threads(threads)
        try:
            got = {f"q{k}": cpu_e4m3.quantize_e4m3(x, s) for k, s in (("row", per_row), ("one", one))}
            got["qbf16"] = cpu_e4m3.quantize_e4m3(x.bfloat16(), per_row)
            got.update({f"d{k}": cpu_e4m3.decode_e4m3_scaled(got["qrow"], s) for k, s in (("row", per_row),
                                                                                        ("one", one))})
            got["fp32"] = cpu_e4m3.decode_e4m3(got["qone"], torch.float32)
            got["bf16"] = cpu_e4m3.decode_e4m3(got["qone"], torch.bfloat16)
        finally:
            torch.set_num_threads(before)
            decoder.dbr_set_parallel_min(1 << 17)
        runs.append(got)
    for k, v in runs[1].items():
        a, b = (t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in (v, runs[0][k]))
        assert torch.equal(a, b), k
    assert torch.equal(runs[0]["qrow"].view(torch.uint8), _torch_quantize(x, per_row).view(torch.uint8))


def test_built_against_torchs_openmp_runtime(decoder):
    """Where torch ships GNU OpenMP (Linux wheels), the library links that file, so one OpenMP runtime serves
    both (its thread team, sized by torch.set_num_threads); no second libgomp is loaded."""
    omp = cpu_e4m3._torch_openmp()
    if omp is None:
        pytest.skip("this torch ships no GNU OpenMP runtime: the library is built single-threaded")
    maps = Path("/proc/self/maps").read_text()
    assert {line.split()[-1] for line in maps.splitlines() if "libgomp" in line} == {str(omp)}


@pytest.mark.parametrize("scale", [0.37, 0.0123, 3e-3, 1 / 3])
def test_every_quantize_is_x_times_the_reciprocal_on_built_ties(decoder, monkeypatch, scale):
    """Inputs built so that x·(1/s) and x/s round to different FP8 codes (fp8_ties.tie_inputs): the C quantize,
    the torch path (DBR_QUANT_CPU_DECODE=torch) and the graph lowering's quantize all give torch's own cast of
    x·reciprocal(s), bit for bit; compressed-tensors' x/s gives the neighbouring code at every one of them."""
    from fp8_ties import codes_by_division, codes_by_reciprocal, tie_inputs

    from dbr_quant.fx_rewriter import lowering

    x = tie_inputs(scale)
    s = torch.tensor([scale])
    assert x.numel() >= 20  # the construction found ties for this scale
    want = _bits(codes_by_reciprocal(x, s))
    rows = x[: x.numel() // 4 * 4].reshape(-1, 4)
    assert torch.equal(_bits(cpu_e4m3.quantize_e4m3(x, s)), want)
    assert torch.equal(_bits(cpu_e4m3.quantize_e4m3(rows, s.expand(rows.shape[0], 1).contiguous())).flatten(),
                       want[: rows.numel()])  # the per-row loop
    assert torch.equal(_bits(C.quantize(x, s, FP8Format.E4M3)), want)
    assert torch.equal(_bits(lowering.quantize(x, s, FP8Format.E4M3)), want)
    monkeypatch.setenv(cpu_e4m3.ENV_VAR, "torch")
    cpu_e4m3.reset()
    try:
        assert cpu_e4m3.library() is None
        assert torch.equal(_bits(C.quantize(x, s, FP8Format.E4M3)), want)
    finally:
        monkeypatch.delenv(cpu_e4m3.ENV_VAR)
        cpu_e4m3.reset()
    step = (want.int() - _bits(codes_by_division(x, s)).int()).abs()
    assert torch.equal(step, torch.ones_like(step))  # one code apart, same sign, at every built input
    assert tie_inputs(0.5).numel() == 0 and tie_inputs(2.0**-7).numel() == 0  # a power-of-two scale: no tie


def test_the_torch_path_gives_the_same_bits_except_a_small_linears_sum_order(decoder, monkeypatch):
    """What DBR_QUANT_CPU_DECODE=torch keeps: every quantize (built ties included), upcast and dequantize, and
    every linear whose GEMM is torch's on both paths (an operand above SMALL elements, the fp32 GEMM path), bit for
    bit. What it changes: the bf16 path's large linear runs the fused C GEMM (fp32 sums) only with the library;
    a small linear sums Σ_k in k order in C (the sequential definition) and in torch's GEMM order without it
    (F.linear of the dequantized operands: compressed-tensors' own arithmetic), so those fp32 outputs can differ in
    the last bits; each side is checked against its definition."""
    from fp8_ties import tie_inputs

    g = torch.Generator().manual_seed(5)
    ties, s = tie_inputs(0.37), torch.tensor([0.37])
    xb, wb = torch.randn(8, 640, generator=g), torch.randn(96, 640, generator=g)  # 5120 and 61440 elements
    xsm, wsm = torch.randn(3, 48, generator=g), torch.randn(20, 48, generator=g)
    xs, ws, b = torch.tensor(0.02), torch.rand(96, generator=g) * 0.01 + 1e-3, torch.randn(96, generator=g)
    q = {k: C.quantize(v, xs if k[0] == "x" else ws[: v.shape[0], None], FP8Format.E4M3)
         for k, v in (("xb", xb), ("wb", wb), ("xsm", xsm), ("wsm", wsm))}

    def run() -> dict[str, torch.Tensor]:
        out = {"ties": _bits(C.quantize(ties, s, FP8Format.E4M3)),
               "upcast32": upcast.fp8_upcast(ALL_CODES[FINITE], torch.float32),
               "upcast16": upcast.fp8_upcast(ALL_CODES[FINITE], torch.bfloat16),
               "dequant": C.dequantize_operand(q["wb"], ws[:, None])}
        for path in ("fp32", "bf16"):
            with use_cpu_gemm(path):
                out[f"big_{path}"] = C.fp8_linear(q["xb"], xs, q["wb"], ws, bias=b, activation="relu")
        out["small"] = C.fp8_linear(q["xsm"], xs, q["wsm"], ws[:20], bias=b[:20])
        return out

    with_c = run()
    monkeypatch.setenv(cpu_e4m3.ENV_VAR, "torch")
    cpu_e4m3.reset()
    try:
        without = run()
    finally:
        monkeypatch.delenv(cpu_e4m3.ENV_VAR)
        cpu_e4m3.reset()
    for k in with_c:
        if k not in ("small", "big_bf16"):
            assert torch.equal(with_c[k], without[k]), k
    # the bf16 path's large linear is the fused C GEMM with the library (fp32 sums, no bf16 rounding of the result),
    # torch's bf16 GEMM (its result rounded once to bf16) without: each equals its own definition
    fused = cpu_e4m3.fp8_gemm(q["xb"], xs, q["wb"], ws, b, cpu_e4m3.SCALES_FIRST)
    assert fused is not None and torch.equal(with_c["big_bf16"], torch.relu(fused))
    acc = torch.nn.functional.linear(q["xb"].float(), q["wb"].float()).to(torch.bfloat16).float()
    assert torch.equal(without["big_bf16"], torch.relu(R.dequantize_accumulator(acc, xs * ws, b)))
    assert torch.equal(with_c["small"], sequential_linear(q["xsm"], xs, q["wsm"], ws[:20], b[:20]))
    xd, wd = q["xsm"].float() * xs, q["wsm"].float() * ws[:20, None]
    assert torch.equal(without["small"], torch.nn.functional.linear(xd, wd, b[:20]))
    # two orders of one fp32 dot product (bias as its (K+1)-th term): each within γ_{K+1}·Σ|terms| of the exact
    # sum (Higham's bound, FMA or not), so within twice that of each other (on a 16×64 · 64×48 probe 69 % of the
    # outputs differed, by up to hundreds of ulps where the sum cancels; how many depends on torch's GEMM order)
    n, u = xd.shape[-1] + 1, 2.0**-24
    bound = 2 * n * u / (1 - n * u) * (xd.double().abs() @ wd.double().abs().t() + b[:20].double().abs())
    assert ((with_c["small"].double() - without["small"].double()).abs() <= bound).all()
