"""The fused FP8 GEMM (csrc/fp8_gemm.c through kernels.cpu.e4m3.fp8_gemm) and the one-call dynamic quantize, on
every code path the C file has: the library built for this CPU and for other x86 targets (x86-64-v4: AVX-512F
without BF16; x86-64-v3: AVX2-FMA; x86-64: portable loops), whose binaries run on any CPU that has their ISA.

Against the reference semantics: exact where the design promises it (every E4M3 code decodes to its value; sums
fp32 holds exactly, with power-of-two scales, come out as the reference's bits; the thread split never changes
bits), else within the dot product's fp32 error bound of the exact (fp64) result."""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import backend as C
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3
from dbr_quant.kernels.cpu import features
from dbr_quant.kernels.reference import dense as R

E4M3 = torch.float8_e4m3fn
U32 = 2.0**-24
# -march target → the code path its build must report (csrc/fp8_gemm.c: dbr_fp8_gemm_isa)
TARGETS = {"x86-64-v4": "AVX-512F FMA", "x86-64-v3": "AVX2-FMA", "x86-64": "portable C"}


def _runs_here(march: str) -> bool:
    f = features.cpu_features()
    return platform.machine() in ("x86_64", "AMD64") and {
        "x86-64-v4": f["avx512"], "x86-64-v3": f["avx2"], "x86-64": True}[march]


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """The native library and every other target's that this CPU can run, built into a private cache."""
    native = cpu_e4m3.library()
    if native is None:
        pytest.fail("the C E4M3 kernels did not build (a C compiler is part of the dev setup)")
    libs = {"native": native}
    mp = pytest.MonkeyPatch()
    mp.setenv("DBR_QUANT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        for march in TARGETS:
            if _runs_here(march):
                lib, why = cpu_e4m3._build(march)
                assert lib is not None, why
                libs[march] = lib
    finally:
        mp.undo()
    return libs


def _gemm(lib: ctypes.CDLL, xq, xs, wq, ws, bias, order: int) -> torch.Tensor:
    m, (n, k) = xq.numel() // xq.shape[-1], wq.shape
    y = torch.empty(m, n)
    rc = lib.dbr_fp8_gemm(xq.data_ptr(), xs.data_ptr(), 1 if xs.numel() > 1 else 0, wq.data_ptr(), ws.data_ptr(),
                          1 if ws.numel() > 1 else 0, None if bias is None else bias.data_ptr(), m, n, k, order,
                          y.data_ptr())
    assert rc == 0
    return y


def _codes(shape, g, finite=True) -> torch.Tensor:
    c = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    if finite:
        c[(c & 0x7F) == 0x7F] = 0x3F  # NaN codes are unsupported on the fast paths (read as ±480)
    return c.view(E4M3)


def test_each_build_reports_its_path(libraries):
    for name, lib in libraries.items():
        got = cpu_e4m3.GEMM_ISAS[lib.dbr_fp8_gemm_isa()]
        assert got == (cpu_e4m3.gemm_isa() if name == "native" else TARGETS[name]), name
    f = features.cpu_features()
    if f["avx512_bf16"] and "avx512vbmi" in open("/proc/cpuinfo").read():
        assert cpu_e4m3.gemm_isa() == "AVX512-BF16 vdpbf16ps"


@pytest.mark.parametrize("order", [cpu_e4m3.SCALES_FIRST, cpu_e4m3.DEQUANTIZE_FIRST])
@pytest.mark.parametrize("rows", [1, 5])  # the in-register GEMV, and the panel tiles
def test_every_code_decodes_to_its_value(libraries, order, rows):
    """K = 1 and x = 1: output n is weight code n's value (×its scale), on every path; NaN codes read ±480."""
    wq = torch.arange(256, dtype=torch.uint8).view(E4M3).reshape(256, 1)
    xq = torch.full((rows, 1), 1.0).to(E4M3)
    xs, ws = torch.full((rows, 1), 2.0**-3), torch.full((256,), 2.0**5)
    value = wq.float().flatten()
    value[value.isnan()] = 480.0 * torch.sign(torch.tensor([1.0, -1.0]))
    for name, lib in libraries.items():
        y = _gemm(lib, xq, xs, wq, ws, None, order)
        assert torch.equal(y, (value * 4.0).expand(rows, 256)), name


@pytest.mark.parametrize("order", [cpu_e4m3.SCALES_FIRST, cpu_e4m3.DEQUANTIZE_FIRST])
@settings(max_examples=25, deadline=None)
@given(m=st.sampled_from([1, 2, 3, 4, 5, 12, 13, 30]), n=st.sampled_from([1, 3, 4, 17, 33, 70]),
       k=st.sampled_from([1, 5, 16, 33, 64, 100]), seed=st.integers(0, 2**16))
def test_exact_sums_are_the_references_bits(libraries, order, m, n, k, seed):
    """FP8 values in [1/8, 2) and 0: products are multiples of 2⁻¹² below 4, so 100 of them sum below 2¹⁰ on
    fp32's grid (24 bits) in any order; with power-of-two scales every path returns the reference's bits."""
    operands, want = _grid_case(m, n, k, seed)
    for name, lib in libraries.items():
        assert torch.equal(_gemm(lib, *operands, order), want), name


def _grid_case(m: int, n: int, k: int, seed: int):
    """Operands whose sums fp32 holds exactly in any order (see test_exact_sums_are_the_references_bits), and the
    reference's result for them."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([0.0] + [v for v in torch.arange(256, dtype=torch.uint8).view(E4M3).float().tolist()
                                 if 0.125 <= abs(v) < 2])
    xq = grid[torch.randint(0, len(grid), (m, k), generator=g)].to(E4M3)
    wq = grid[torch.randint(0, len(grid), (n, k), generator=g)].to(E4M3)
    xs, ws = torch.tensor([2.0**-3]), torch.full((n,), 2.0**-5)
    bias = torch.arange(n, dtype=torch.float32) / 8
    return (xq, xs, wq, ws, bias), R.fp8_linear(xq, xs, wq, ws, bias=bias)


@pytest.mark.parametrize("order", [cpu_e4m3.SCALES_FIRST, cpu_e4m3.DEQUANTIZE_FIRST])
def test_kept_buffers_never_leak_between_calls(libraries, order):
    """Each thread keeps its decode buffers between calls: a call after a larger one (whose codes fill the buffer
    past this call's K, padding included) and one larger than the kept size (allocated for the call) still return
    the reference's bits."""
    sizes = [(40, 70, 1000), (5, 13, 130), (13, 33, 100), (2, 9, 1000), (40, 70, 257), (8200, 3, 1088)]
    for i, (m, n, k) in enumerate(sizes):  # 8200 × 1088 bf16 / fp32 decoded rows: above GEMM_KEEP_BYTES (16 MiB)
        args, want = _grid_case(m, n, k, seed=i)
        for name, lib in libraries.items():
            assert torch.equal(_gemm(lib, *args, order), want), (name, m, n, k)


def test_threads_keep_their_own_buffers(libraries):
    """Calls from several threads at once (ctypes releases the GIL) each decode into their own thread's buffers."""
    cases = [_grid_case(m, 40, k, seed=m) for m, k in ((3, 500), (30, 200), (17, 1000), (64, 64))]

    def run(lib, case):
        return all(torch.equal(_gemm(lib, *case[0], cpu_e4m3.SCALES_FIRST), case[1]) for _ in range(20))

    for name, lib in libraries.items():
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            assert all(pool.map(functools.partial(run, lib), cases)), name


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("tail", ["plain", "residual", "quantized"])
def test_fused_linear_epilogue_is_the_ops_one_by_one(activation, tail):
    """Where the backend's fp8_linear runs the fused GEMM it applies the activation in place on the GEMM's own
    result: the same bits as the reference's epilogue (torch's out-of-place activation, residual, quantize) on it."""
    g = torch.Generator().manual_seed(7)
    wq, ws, bias = _codes((96, 256), g), torch.rand(96, generator=g), torch.randn(96, generator=g)
    xq, xs = _codes((40, 256), g), torch.rand(40, 1, generator=g)
    residual = torch.randn(40, 96, generator=g) if tail == "residual" else None
    out_scale = torch.tensor(0.5) if tail == "quantized" else None
    with features.use_cpu_gemm("bf16"):
        if not C.runs_fused_gemm(xq, wq):
            pytest.skip("the fused GEMM does not run this linear on this CPU")
        got = C.fp8_linear(xq, xs, wq, ws, bias=bias, activation=activation, residual=residual, out_scale=out_scale)
    y = cpu_e4m3.fp8_gemm(xq, xs, wq, ws, bias, cpu_e4m3.SCALES_FIRST)
    want = R.linear_epilogue(y, activation, residual, torch.float32, out_scale, FP8Format.E4M3, inplace=False)
    assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("order", [cpu_e4m3.SCALES_FIRST, cpu_e4m3.DEQUANTIZE_FIRST])
@pytest.mark.parametrize("shape", [(1, 7, 1), (1, 64, 1024), (3, 9, 100), (4, 33, 65), (5, 13, 130),
                                   (17, 33, 384), (40, 70, 257)])
@pytest.mark.parametrize("per_row", [False, True])
def test_within_the_dot_products_error_bound(libraries, order, shape, per_row):
    """Random codes and scales: |y − exact| ≤ (K + 4)·u·Σ|x·w|·|sx·sw| + 4u·(|exact| + |b|), exact in fp64 from
    the operands each order reads (dequantized first: the fp32-rounded x·sx and w·sw)."""
    m, n, k = shape
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    xq, wq = _codes((m, k), g), _codes((n, k), g)
    xs = torch.rand(m, 1, generator=g) + 0.5 if per_row else torch.tensor([0.7])
    ws, bias = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    for name, lib in libraries.items():
        y = _gemm(lib, xq, xs, wq, ws, bias, order)
        assert _within_bound(y, xq, xs, wq, ws, bias, order), name


def _within_bound(y, xq, xs, wq, ws, bias, order) -> bool:
    k = xq.shape[-1]
    if order == cpu_e4m3.SCALES_FIRST:
        x64, w64 = xq.double(), wq.double()
        exact = (x64 @ w64.T) * (xs * ws).double() + bias.double()
        mag = (x64.abs() @ w64.abs().T) * (xs * ws).double()
    else:
        x64, w64 = (xq.float() * xs).double(), (wq.float() * ws[:, None]).double()
        exact = x64 @ w64.T + bias.double()
        mag = x64.abs() @ w64.abs().T
    bound = (k + 4) * U32 * mag + 4 * U32 * (exact.abs() + bias.double().abs()) + 1e-30
    return bool(((y.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("rows", [1, 64])
def test_the_thread_split_never_changes_bits(libraries, rows):
    """Columns are split over threads in whole blocks; each output's sum is computed by one thread in one order."""
    g = torch.Generator().manual_seed(rows)
    xq, wq = _codes((rows, 300), g), _codes((200, 300), g)
    xs, ws = torch.tensor([0.3]), torch.rand(200, generator=g)
    lib = libraries["native"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _gemm(lib, xq, xs, wq, ws, None, cpu_e4m3.SCALES_FIRST)
        torch.set_num_threads(2)
        lib.dbr_set_parallel_min(1)
        two = _gemm(lib, xq, xs, wq, ws, None, cpu_e4m3.SCALES_FIRST)
    finally:
        lib.dbr_set_parallel_min(1 << 17)
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_fp8_gemm_declines_what_it_cannot_read():
    g = torch.Generator().manual_seed(0)
    xq, wq, one = _codes((2, 8), g), _codes((3, 8), g), torch.tensor(1.0)
    assert cpu_e4m3.fp8_gemm(xq, one, wq, one, None, 0) is not None
    assert cpu_e4m3.fp8_gemm(xq.float(), one, wq, one, None, 0) is None  # not E4M3
    assert cpu_e4m3.fp8_gemm(xq, one, wq.t().contiguous().t(), one, None, 0) is None  # not contiguous
    assert cpu_e4m3.fp8_gemm(xq, one, wq, torch.ones(2), None, 0) is None  # a scale that does not index rows
    assert cpu_e4m3.fp8_gemm(xq, one, wq, one, torch.ones(3, dtype=torch.bfloat16), 0) is None  # bias dtype
    assert cpu_e4m3.fp8_gemm(xq[:, :4], one, wq, one, None, 0) is None  # K mismatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("shape", [(1, 7), (5, 384), (3, 4, 1536), (1000,), (2, 70000)])
def test_dynamic_quantize_is_the_references_bits(dtype, per_token, shape):
    """amax (non-finite values ignored), safe_scale and the quantize in one C call: the reference's codes and
    scales bit for bit, all-zero rows (scale 1) and inf / NaN inputs included."""
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = (torch.randn(shape, generator=g) * torch.rand((*shape[:-1], 1), generator=g) * 10).to(dtype)
    if x.numel() > 10:
        x.view(-1)[3], x.view(-1)[5] = float("inf"), float("nan")
    if x.dim() > 1 and x.shape[0] > 2:
        x[1] = 0
    got = C.dynamic_quantize(x, FP8Format.E4M3, per_token)
    want = R.dynamic_quantize(x, FP8Format.E4M3, per_token)
    assert cpu_e4m3.dynamic_quantize_e4m3(x, per_token) is not None
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1]) and got[1].shape == want[1].shape


def test_linear_on_the_bf16_path_runs_the_fused_gemm():
    """The backend's fp8_linear on the bf16 GEMM path returns the fused kernel's fp32 result (no bf16 rounding):
    equal to calling it directly, at a decode-sized and a larger batch."""
    g = torch.Generator().manual_seed(3)
    wq, ws, bias = _codes((96, 256), g), torch.rand(96, generator=g), torch.randn(96, generator=g)
    for rows in (1, 40):
        xq, xs = _codes((rows, 256), g), torch.rand(rows, 1, generator=g)
        with features.use_cpu_gemm("bf16"):
            got = C.fp8_linear(xq, xs, wq, ws, bias=bias)
        if rows <= cpu_e4m3.fused_rows(bf16_path=True):
            assert torch.equal(got, cpu_e4m3.fp8_gemm(xq, xs, wq, ws, bias, cpu_e4m3.SCALES_FIRST))
        assert _within_bound(got, xq, xs, wq, ws, bias, cpu_e4m3.SCALES_FIRST), rows
