"""The CPU GEMM path (kernels.cpu): how it is chosen, and both paths' numerics against fp64 on any machine
(each path is forced, so a CPU without BF16 dot products still tests the bf16 path and vice versa).

Error model of both paths (FP8 operands are exact in bf16 and fp32; products of two FP8 values are exact
in fp32; the sum of K products is accumulated in fp32): |acc − exact| ≤ γ_K · Σ|x||w| with γ_K ≈ K·2⁻²⁴.
The bf16 path then rounds the accumulator once to bf16: a further ≤ 2⁻⁸·|acc|. The epilogue (× scale,
+ bias, activation, + residual) adds a few fp32 roundings of the values it touches.
"""

import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from sequential import sequential_linear

from dbr_quant.formats import FP8Format, safe_scale
from dbr_quant.kernels import use_cpu_gemm
from dbr_quant.kernels.cpu import backend as C
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3
from dbr_quant.kernels.cpu import features as cpu
from dbr_quant.kernels.cpu import upcast
from dbr_quant.kernels.reference import dense as R

U32, U16 = 2.0**-24, 2.0**-8  # unit roundoff of fp32 and of bf16 (8 significant bits)
LIPSCHITZ = {None: 1.0, "relu": 1.0, "gelu": 1.13, "gelu_tanh": 1.13, "silu": 1.1}  # max |act'| (+ margin)


# ---------------------------------------------------------------- choosing the path


@pytest.fixture
def reread_env():
    """The environment variable is read once per process: re-read it in the test, and again after."""
    cpu._process_default.cache_clear()
    yield cpu._process_default.cache_clear
    cpu._process_default.cache_clear()


def test_env_var_and_context_choose_the_path(monkeypatch, reread_env):
    monkeypatch.setenv(cpu.ENV_VAR, "fp32")
    assert cpu.current_gemm_path() == "fp32" and cpu.gemm_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.setenv(cpu.ENV_VAR, "bf16")
    assert cpu.current_gemm_path() == "fp32"  # read once: a later change does not apply
    reread_env()
    assert cpu.current_gemm_path() == "bf16" and cpu.gemm_dtype(torch.zeros(1)) == torch.bfloat16
    assert cpu.describe().startswith(f"CPU GEMM path: bf16 (forced by {cpu.ENV_VAR}=bf16)")
    with use_cpu_gemm("fp32"):  # the block wins over the environment, and blocks nest
        assert cpu.current_gemm_path() == "fp32"
        assert cpu.describe().startswith("CPU GEMM path: fp32 (use_cpu_gemm('fp32'))")
        with use_cpu_gemm("auto"):
            assert cpu.current_gemm_path() == cpu.detected_gemm_path()
        assert cpu.current_gemm_path() == "fp32"
    assert cpu.current_gemm_path() == "bf16"
    for unset in ("", "auto"):
        monkeypatch.setenv(cpu.ENV_VAR, unset)
        reread_env()
        assert cpu.current_gemm_path() == cpu.detected_gemm_path()
    monkeypatch.setenv(cpu.ENV_VAR, "fp16")
    reread_env()
    with pytest.raises(ValueError, match="DBR_QUANT_CPU_GEMM='fp16'"):
        cpu.current_gemm_path()
    with pytest.raises(ValueError, match="use_cpu_gemm"):
        with use_cpu_gemm("tf32"):
            pass


def test_context_is_thread_local():
    seen = []
    with use_cpu_gemm("fp32" if cpu.detected_gemm_path() == "bf16" else "bf16"):
        forced = cpu.current_gemm_path()
        t = threading.Thread(target=lambda: seen.append(cpu.current_gemm_path()))
        t.start()
        t.join()
    assert seen == [cpu.detected_gemm_path()] != [forced]


@pytest.mark.parametrize("avx512_bf16,amx,want", [(True, False, "bf16"), (False, True, "bf16"),
                                                  (False, False, "fp32")])
def test_auto_picks_bf16_only_with_native_bf16_dot_products(monkeypatch, reread_env, avx512_bf16, amx, want):
    features = dict(cpu.cpu_features(), avx512_bf16=avx512_bf16, amx=amx)
    monkeypatch.setattr(cpu, "cpu_features", lambda: features)
    monkeypatch.delenv(cpu.ENV_VAR, raising=False)
    reread_env()
    assert cpu.current_gemm_path() == want
    native = "native" if want == "bf16" else "no native"
    assert cpu.describe().startswith(f"CPU GEMM path: {want} (auto: {native} BF16 dot products)")


def test_features_come_from_torch_and_other_devices_keep_bf16():
    f = cpu.cpu_features()
    assert f["capability"] == torch.backends.cpu.get_cpu_capability()
    assert f["avx512_bf16"] == torch.cpu._is_avx512_bf16_supported()
    assert f["amx"] == torch.cpu._is_amx_tile_supported()
    with use_cpu_gemm("fp32"):
        assert cpu.gemm_dtype(torch.device("cuda")) == torch.bfloat16


# ---------------------------------------------------------------- the fp32 upcast


@pytest.mark.parametrize("reuse", [False, True])
def test_fp8_to_fp32_is_exact_for_every_code(reuse):
    with torch.no_grad():  # the scratch buffer is only used without autograd
        for fmt in FP8Format:
            codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).reshape(16, 16)
            want = codes.float()
            got = upcast.fp8_to_fp32(codes, reuse_buffer=reuse)
            assert got.dtype == torch.float32
            nan = want.isnan()
            if fmt is FP8Format.E4M3:
                assert nan.sum() == 2 and (got[nan].abs() == 480).all()  # as e4m3_to_bf16: NaN → ±480
            else:
                assert torch.equal(got.isnan(), nan)  # E5M2 keeps NaN and ±inf
            assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))  # −0.0 included
    with pytest.raises(ValueError, match="fp8_upcast"):
        upcast.fp8_upcast(codes, torch.float16)


# ---------------------------------------------------------------- both paths of the CPU backend against fp64


def _fp8_grid(values: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(rows, -1).to(torch.float8_e4m3fn)


def _large(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zero columns appended (sums unchanged) so the GEMM takes the CPU path's own kernel, not the
    small-operand path (torch casts + fp32 GEMM) that operands of ≤ C.SMALL_OPERAND elements take."""
    return torch.cat([t, torch.zeros(t.shape[0], C.SMALL_OPERAND + 1, dtype=t.dtype)], dim=1)


@pytest.mark.parametrize("path", cpu.GEMM_PATHS)
def test_each_path_is_exact_up_to_its_one_output_rounding(path):
    """With a sum that fp32 holds exactly, the fp32 path returns it exactly and the bf16 path returns it
    rounded once to bf16 (round to nearest even). 15·15 + 0.125·1 = 225.125 needs 11 significant bits."""
    x, w = _fp8_grid([15.0, 0.125], 1), _fp8_grid([15.0, 1.0], 1)
    one = torch.tensor(1.0)
    with use_cpu_gemm(path):
        y = C.fp8_linear(_large(x), one, _large(w), one)
        mm = C.fp8_matmul(_large(x), one, _large(w).t(), one)
        small_y, small_mm = C.fp8_linear(x, one, w, one), C.fp8_matmul(x, one, w.t(), one)
    # the bf16 path's linear runs the fused C GEMM (fp32 sums, no bf16 rounding) where the C library is built
    assert y.item() == (225.125 if path == "fp32" or cpu_e4m3.library() is not None else 225.0)
    assert mm.item() == (225.125 if path == "fp32" else 225.0)
    assert small_y.item() == small_mm.item() == 225.125  # small operands: fp32 GEMM on either path


@settings(max_examples=30, deadline=None)
@given(data=st.data(), m=st.integers(1, 9), k=st.integers(1, 16), n=st.integers(1, 9),
       path=st.sampled_from(cpu.GEMM_PATHS))
def test_exact_sums_come_out_exact_or_rounded_once(data, m, k, n, path):
    """FP8 values in [1/8, 15] (and 0): products are multiples of 2⁻¹² below 2⁸ and K ≤ 16 keeps every
    partial sum below 2¹², so fp32 accumulates exactly in any order; the paths may differ only by the
    bf16 path's final rounding."""
    grid = [0.0] + [v for v in torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
                    if 0.125 <= abs(v) <= 15]
    pick = lambda rows, cols: _fp8_grid(data.draw(st.lists(st.sampled_from(grid), min_size=rows * cols,  # noqa: E731
                                                           max_size=rows * cols)), rows)
    x, w = pick(m, k), pick(n, k)
    one = torch.tensor(1.0)
    exact = x.double() @ w.double().t()
    with use_cpu_gemm(path):
        y = C.fp8_linear(_large(x), one, _large(w), one)
        mm = C.fp8_matmul(_large(x).unsqueeze(0), one, _large(w).t().unsqueeze(0), one)[0]
        small_y = C.fp8_linear(x, one, w, one)
    want = exact.float() if path == "fp32" else exact.float().to(torch.bfloat16).float()
    fused = path == "bf16" and cpu_e4m3.library() is not None  # the fused C GEMM: fp32 sums, no bf16 rounding
    assert torch.equal(y, exact.float() if fused else want) and torch.equal(mm, want)
    assert torch.equal(small_y, exact.float())


def _bound(path: str, k: int, mag: torch.Tensor, acc: torch.Tensor, bias: torch.Tensor | None,
           pre: torch.Tensor, ref: torch.Tensor, residual: torch.Tensor | None, act: str | None) -> torch.Tensor:
    """Elementwise error bound of one path: ``mag`` = Σ|x||w|·|s|, ``acc`` = exact Σxw·s, ``pre`` = exact
    pre-activation, ``ref`` = exact output (all fp64)."""
    accumulate = (k + 2) * U32 * mag  # γ_K of the fp32 sum, plus the rounding of the combined scale
    if path == "bf16":
        accumulate = accumulate + U16 * (acc.abs() + accumulate)  # the one rounding of the GEMM result to bf16
    epilogue = 2 * U32 * (acc.abs() + (0 if bias is None else bias.abs()))  # × scale, + bias
    act_eval = 0 if act is None else 8 * U32 * (pre.abs() + ref.abs())  # fp32 activation, a few ulp
    add = 0 if residual is None else U32 * (ref.abs() + residual.abs())
    return LIPSCHITZ[act] * (accumulate + epilogue) + act_eval + add + 1e-30


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 24), k=st.integers(1, 300), n=st.integers(1, 24), per_channel=st.booleans(),
       act=st.sampled_from([None, "relu", "gelu", "gelu_tanh", "silu"]), bias=st.booleans(),
       residual=st.booleans(), path=st.sampled_from(cpu.GEMM_PATHS), log_x=st.floats(-6, 6))
def test_each_path_against_fp64_within_its_own_rounding(m, k, n, per_channel, act, bias, residual, path, log_x):
    fmt = FP8Format.E4M3
    x, w = torch.randn(m, k) * 2.0**log_x, torch.randn(n, k)
    xs = safe_scale(x.abs().amax(), fmt)
    ws = safe_scale(w.abs().amax(1), fmt) if per_channel else safe_scale(w.abs().amax(), fmt)
    xq, wq = R.quantize(x, xs, fmt), R.quantize(w, ws.unsqueeze(1) if per_channel else ws, fmt)
    b = torch.randn(n) if bias else None
    r = torch.randn(m, n) if residual else None
    with use_cpu_gemm(path):
        got = C.fp8_linear(xq, xs, wq, ws, bias=b, activation=act, residual=r).double()
    s = (xs * ws).double()  # the kernel multiplies the two scales in fp32 (that rounding is in the bound)
    acc = xq.double() @ wq.double().t() * s
    mag = xq.double().abs() @ wq.double().abs().t() * s.abs()
    pre = acc if b is None else acc + b.double()
    ref = R.apply_activation(pre, act)
    ref = ref if r is None else ref + r.double()
    bound = _bound(path, k, mag, acc, None if b is None else b.double(), pre, ref,
                   None if r is None else r.double(), act)
    assert ((got - ref).abs() <= bound).all(), ((got - ref).abs() / bound).max().item()


@pytest.mark.parametrize("path", cpu.GEMM_PATHS)
def test_each_path_batched_matmul_against_fp64(path):
    fmt = FP8Format.E4M3
    a, b = torch.randn(2, 3, 9, 40), torch.randn(2, 3, 40, 7) * 0.1
    sa, sb = safe_scale(a.abs().amax(), fmt), safe_scale(b.abs().amax(), fmt)
    aq, bq = R.quantize(a, sa, fmt), R.quantize(b, sb, fmt)
    with use_cpu_gemm(path):
        got = C.fp8_matmul(aq, sa, bq, sb).double()
    s = (sa * sb).double()
    acc = aq.double() @ bq.double() * s
    mag = aq.double().abs() @ bq.double().abs() * s
    bound = _bound(path, 40, mag, acc, None, acc, acc, None, None)
    assert ((got - acc).abs() <= bound).all()


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 40), k=st.sampled_from([16, 96, 384]), n=st.sampled_from([8, 64, 200]),
       per_token=st.booleans(), per_channel=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_fp32_gemms_dequantize_operands_first(m, k, n, per_token, per_channel, bias, seed):
    """The CPU backend's fp32 GEMMs (the fp32 path at any size; small operands on either path) compute
    compressed-tensors' arithmetic bit for bit, ``F.linear(q_x·s_x, q_w·s_w, b)``; the reference keeps the
    GPU kernels' order, ``(q_x·q_wᵀ)·(s_x·s_w)`` (+ b in the same rounding step), also bit for bit."""
    g = torch.Generator().manual_seed(seed)
    fmt = FP8Format.E4M3
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    xs = safe_scale(x.abs().amax(1, keepdim=True), fmt) if per_token else safe_scale(x.abs().amax(), fmt)
    ws = safe_scale(w.abs().amax(1), fmt) if per_channel else safe_scale(w.abs().amax(), fmt)
    xq, wq = R.quantize(x, xs, fmt), R.quantize(w, ws.unsqueeze(1) if per_channel else ws, fmt)
    b = torch.randn(n, generator=g) if bias else None
    loader = F.linear(xq.float() * xs, wq.float() * (ws.unsqueeze(1) if per_channel else ws), b)
    large = xq.numel() > C.SMALL_OPERAND or wq.numel() > C.SMALL_OPERAND
    for path in cpu.GEMM_PATHS:
        with use_cpu_gemm(path):
            got = C.fp8_linear(xq, xs, wq, ws, bias=b)
        if large and path == "fp32":
            assert torch.equal(got, loader), path
        elif not large:  # one C call (cpu_e4m3.small_linear): the same operands, summed in k order
            assert torch.equal(got, sequential_linear(xq, xs, wq, ws, b)), path
            torch.testing.assert_close(got, loader, rtol=1e-5, atol=1e-5)
    gpu_order = F.linear(xq.float(), wq.float()) * (xs * ws)
    assert torch.equal(R.fp8_linear(xq, xs, wq, ws), gpu_order)

