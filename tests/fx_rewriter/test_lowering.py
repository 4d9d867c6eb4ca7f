"""The inductor lowering of the dbr_quant custom ops (fx_rewriter.lowering).

Two kinds of checks: the lowering's own FP8 arithmetic against torch's FP8 cast (every byte, every
midpoint, eager and compiled), and each op's lowering run eagerly against the op itself (the reference
kernels), so a compiled graph computes what the eager graph does.
"""

import contextlib
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import dbr_quant.fx_rewriter.ops  # noqa: F401  (defines the ops and registers their lowerings)
from dbr_quant.formats import FP8Format
from dbr_quant.fx_rewriter import lowering
from dbr_quant.kernels import use_backend, use_cpu_gemm
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3
from dbr_quant.kernels.cpu.features import GEMM_PATHS
from dbr_quant.kernels.reference import dense as reference

FORMATS = list(FP8Format)


@pytest.fixture(autouse=True)
def _fresh_inductor():
    """No cached compiled graphs: inductor's cache key does not cover the lowering's Python source."""
    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


@contextlib.contextmanager
def _eager_as_decomposed(path: str):
    """Eager as the decomposition computes it. On the bf16 GEMM path eager runs an FP8 linear on the fused C GEMM
    (cpu_e4m3.fp8_gemm: fp32 sums of the exact products, no bf16 rounding of the result; tested against fp64 in
    tests/kernels), which inductor's GEMM cannot reproduce; the decomposition keeps the upcast + bf16 GEMM, so it
    is compared with eager's torch path (the C kernels off: every other pass gives the same bits either way)."""
    if path != "bf16":
        yield
        return
    previous = os.environ.get(cpu_e4m3.ENV_VAR)
    os.environ[cpu_e4m3.ENV_VAR] = "torch"
    cpu_e4m3.reset()
    try:
        yield
    finally:
        if previous is None:
            del os.environ[cpu_e4m3.ENV_VAR]
        else:
            os.environ[cpu_e4m3.ENV_VAR] = previous
        cpu_e4m3.reset()


def every_value(fmt: FP8Format) -> torch.Tensor:
    """Every finite FP8 value, the midpoints between neighbours (the ties), and values past the max."""
    v = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    v = v[torch.isfinite(v)].unique().sort().values
    mids = (v[1:] + v[:-1]) / 2
    return torch.cat([v, mids, torch.nextafter(mids, v[1:]), torch.nextafter(mids, v[:-1]),
                      torch.tensor([fmt.max * 1.01, -fmt.max * 1.5, 1e30, -0.0])])


def bytes_of(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_and_encode_every_byte(fmt):
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype)
    want = codes.float()
    finite = torch.isfinite(want)
    got = lowering.decode(codes)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # -0.0 included
    assert torch.equal(bytes_of(lowering.encode(want[finite], fmt)), bytes_of(codes[finite]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rounding", ["veltkamp", "bits"])
def test_quantize_matches_torch_cast_at_every_tie_eager_and_compiled(fmt, rounding):
    x = torch.cat([every_value(fmt), torch.randn(20000) * 3, torch.randn(2000) * 1e-3,
                   torch.tensor([float("nan"), float("inf"), -float("inf")])])
    scale = torch.tensor(1.0)
    want = bytes_of(reference.quantize(x, scale, fmt))
    patch = {} if rounding == "veltkamp" else {"cpp.enable_floating_point_contract_flag": "fast"}
    with inductor_config.patch(patch):
        assert lowering._float_ops_kept_as_written() == (rounding == "veltkamp")
        assert torch.equal(bytes_of(lowering.quantize(x, scale, fmt)), want)
        compiled = torch.compile(lambda x, s: lowering.quantize(x, s, fmt))
        assert torch.equal(bytes_of(compiled(x, scale)), want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=64),
       st.floats(min_value=1e-6, max_value=1e3), st.sampled_from(FORMATS))
def test_quantize_property_equals_reference(values, scale, fmt):
    x, s = torch.tensor(values), torch.tensor(scale)
    assert torch.equal(bytes_of(lowering.quantize(x, s, fmt)), bytes_of(reference.quantize(x, s, fmt)))


def _fp8(shape, fmt=FP8Format.E4M3, scale=0.05):
    x = torch.randn(shape)
    s = torch.tensor(scale)
    return reference.quantize(x, s, fmt), s


LINEAR_CASES = [
    dict(activation="", bias=False, residual=False, out_scale=False),
    dict(activation="gelu", bias=True, residual=False, out_scale=True),
    dict(activation="relu", bias=True, residual=True, out_scale=False),
    dict(activation="silu", bias=False, residual=True, out_scale=True),
]


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("path", GEMM_PATHS)
def test_fp8_linear_lowering_equals_the_op(case, per_channel, path):
    x_q, x_s = _fp8((3, 7, 160))  # both operands above SMALL_OPERAND: the decomposition runs (see below)
    w_q, _ = _fp8((40, 160))
    w_s = torch.rand(40) * 0.01 + 0.001 if per_channel else torch.tensor(0.003)
    args = (x_q, x_s, w_q, w_s, torch.randn(40) if case["bias"] else None, case["activation"],
            torch.randn(3, 7, 40) if case["residual"] else None, torch.float32,
            torch.tensor(0.02) if case["out_scale"] else None, "e4m3")
    with use_cpu_gemm(path):  # the lowering follows the CPU GEMM path as the op does
        with _eager_as_decomposed(path):
            want = torch.ops.dbr_quant.fp8_linear(*args)
        got = lowering.fp8_linear(*args)
    assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                                                   want.view(torch.uint8) if want.dtype.itemsize == 1 else want)


def test_small_gemms_stay_as_the_op():
    """Where both operands are small, eager runs one C call (cpu_e4m3.small_linear) whose sum order inductor
    would not reproduce: the decomposition declines, so a compiled graph calls the op itself (the same kernel)."""
    x_q, x_s = _fp8((3, 7, 48))
    w_q, w_s = _fp8((40, 48))
    linear = lowering.LOWERINGS["fp8_linear"]
    assert linear(x_q, x_s, w_q, w_s, None, "relu", None, torch.float32, None, "e4m3") is NotImplemented
    big_x, _ = _fp8((3, 70, 48))  # a large input with a small weight: not the small C call
    mlp = lowering.LOWERINGS["fp8_mlp"]
    w2_q, _ = _fp8((48, 40))
    args = (x_s, w_q, w_s, None, "relu", x_s, "e4m3", w2_q, w_s, None, None, torch.float32)
    assert mlp(x_q, *args) is NotImplemented
    # where eager runs the fused C GEMM (bf16 path, C library built) that op stays a call too (compiled = eager)
    fused = cpu_backend.runs_fused_gemm(big_x, w_q)
    assert (linear(big_x, x_s, w_q, w_s, None, "relu", None, torch.float32, None, "e4m3") is NotImplemented) == fused
    assert (mlp(big_x, *args) is NotImplemented) == fused
    with _eager_as_decomposed(cpu_backend.features.current_gemm_path()):  # no fused GEMM: inductor's GEMM
        assert linear(big_x, x_s, w_q, w_s, None, "relu", None, torch.float32, None, "e4m3") is not NotImplemented
        assert mlp(big_x, *args) is not NotImplemented
    compiled = torch.compile(lambda *a: torch.ops.dbr_quant.fp8_linear(*a), fullgraph=True)
    args = (x_q, x_s, w_q, w_s, torch.randn(40), "relu", None, torch.float32, None, "e4m3")
    assert torch.equal(compiled(*args), torch.ops.dbr_quant.fp8_linear(*args))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fp8_mlp_lowering_equals_the_op(activation):
    x_q, x_s = _fp8((2, 50, 96))
    w1, w1_s = _fp8((2 * 48 if activation == "swiglu" else 48, 96), scale=0.01)
    w2, w2_s = _fp8((96, 48), scale=0.01)
    args = (x_q, x_s, w1, w1_s, None if activation == "swiglu" else torch.randn(48), activation, torch.tensor(0.03),
            "e4m3", w2, w2_s, torch.randn(96), torch.randn(2, 50, 96), torch.float32)
    with _eager_as_decomposed(cpu_backend.features.current_gemm_path()):
        want = torch.ops.dbr_quant.fp8_mlp(*args)
    got = lowering.fp8_mlp(*args)
    if activation == "swiglu":  # one stacked GEMM instead of the reference's two: the same dot products
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)


def test_gated_linear_lowering_matches_the_op():
    x_q, x_s = _fp8((40, 128))  # not small: the decomposition runs (small GEMMs stay as the op)
    w_q, w_s = _fp8((2 * 24, 128), scale=0.01)
    for act in ("swiglu", "geglu", "geglu_tanh"):
        args = (x_q, x_s, w_q, w_s, None, act, None, torch.float32, None, "e4m3")
        # one stacked GEMM instead of the reference's two: the same dot products
        with _eager_as_decomposed(cpu_backend.features.current_gemm_path()):
            want = torch.ops.dbr_quant.fp8_linear(*args)
        torch.testing.assert_close(lowering.fp8_linear(*args), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rms,path", [(False, "bf16"), (True, "fp32")])
def test_norm_quantize_matmul_attention_and_dynamic_lowerings_equal_the_ops(rms, path):
    x = torch.randn(4, 9, 32)
    w, b, s = torch.rand(32) + 0.5, torch.randn(32), torch.tensor(0.02)
    for got, want in zip(lowering.layer_norm_quantize(x, w, b, 1e-5, s, "e4m3", rms),
                         torch.ops.dbr_quant.layer_norm_quantize(x, w, b, 1e-5, s, "e4m3", rms)):
        assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                           want.view(torch.uint8) if want.dtype.itemsize == 1 else want)
    a_q, a_s = _fp8((2, 3, 9, 16))
    b_q, b_s = _fp8((2, 3, 16, 9))
    q_q, k_q, v_q = (_fp8((2, 4, 9, 16))[0] for _ in range(3))
    mask = torch.rand(9, 9) > 0.3
    with use_cpu_gemm(path):
        assert torch.equal(lowering.fp8_matmul(a_q, a_s, b_q, b_s),
                           torch.ops.dbr_quant.fp8_matmul(a_q, a_s, b_q, b_s))
        for causal, m in [(False, mask), (True, None)]:
            args = (q_q, s, k_q, s, v_q, s, m, causal, None, None, "e4m3")
            assert torch.equal(lowering.fp8_attention(*args), torch.ops.dbr_quant.fp8_attention(*args))
    for per_token in (False, True):
        got, want = lowering.dynamic_quantize(x, "e5m2", per_token), torch.ops.dbr_quant.dynamic_quantize(
            x, "e5m2", per_token)
        assert torch.equal(got[1], want[1]) and torch.equal(bytes_of(got[0]), bytes_of(want[0]))
    q, _ = _fp8((6, 5))
    assert torch.equal(lowering.LOWERINGS["dequantize"](q, s, torch.bfloat16),
                       torch.ops.dbr_quant.dequantize(q, s, torch.bfloat16))


def test_upcast_ops_are_exact():
    for fmt in FORMATS:
        codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype)
        finite = torch.isfinite(codes.float())
        assert torch.equal(torch.ops.dbr_quant.fp8_to_bf16(codes)[finite].float(), codes.float()[finite])
        assert torch.equal(torch.ops.dbr_quant.fp8_to_fp32(codes)[finite], codes.float()[finite])


@pytest.mark.parametrize("path", GEMM_PATHS)
def test_compiled_ops_are_inlined_and_close_to_eager(path, close_to_reference):
    """Under torch.compile the FP8 ops become inductor code fused with their neighbours (only the weight
    upcast stays a call), and the result is close to the eager graph's. The GEMMs run in the CPU GEMM
    path's dtype: forcing fp32 leaves no bf16 tensor in the generated code."""
    x_q, x_s = _fp8((6, 64))
    w1, w1_s = _fp8((128, 64), scale=0.01)  # weights above cpu_backend.SMALL_OPERAND: the CPU path's GEMM
    w2, w2_s = _fp8((64, 128), scale=0.01)
    b1, mid_s = torch.randn(128), torch.tensor(0.05)

    def mlp(x, ln_w):
        h, q = torch.ops.dbr_quant.layer_norm_quantize(x, ln_w, None, 1e-5, x_s, "e4m3", False)
        y = torch.ops.dbr_quant.fp8_linear(q, x_s, w1, w1_s, b1, "gelu", None, torch.float32, mid_s, "e4m3")
        return torch.ops.dbr_quant.fp8_linear(y, mid_s, w2, w2_s, None, "", h, torch.float32, None, "e4m3")

    x, ln_w = torch.randn(6, 64), torch.rand(64) + 0.5
    # without the fused C GEMM (whose linears stay calls, test_small_gemms_stay_as_the_op), as the decomposition
    with torch.no_grad(), use_cpu_gemm(path), _eager_as_decomposed(path):
        out, (code,) = run_and_get_code(torch.compile(mlp, fullgraph=True), x, ln_w)
        want = mlp(x, ln_w)
    calls = [line.split("torch.ops.dbr_quant.")[1].split(".")[0] for line in code.splitlines()
             if "= torch.ops.dbr_quant." in line]
    # the two weight upcasts; everything else became inductor's own code, and the FP8 activations went
    # from producer to GEMM as grid values (no byte round trip, no upcast call for them)
    assert calls == [f"fp8_to_{path}"] * 2
    assert ("bfloat16" in code) == (path == "bf16")
    assert "Original ATen: [dbr_quant.layer_norm_quantize, dbr_quant.fp8_linear]" in code  # fused together
    close_to_reference(out, want, min_cos=0.999, max_rel=0.03)


def test_ops_stay_calls_on_the_triton_backend():
    """Off the CPU backend (Triton on CUDA; the plain reference) the decompositions decline, so the op stays one
    kernel."""
    decomposition = lowering._on_cpu_backend(lowering.fp8_matmul)
    a_q, a_s = _fp8((3, 4))
    b_q, b_s = _fp8((4, 3))
    assert torch.is_tensor(decomposition(a_q, a_s, b_q, b_s))
    with use_backend("triton-interpret"):
        assert decomposition(a_q, a_s, b_q, b_s) is NotImplemented
    with use_backend("reference"):
        assert decomposition(a_q, a_s, b_q, b_s) is NotImplemented


def test_compile_frozen_folds_weights_where_eager_runs_the_fused_gemm(monkeypatch, close_to_reference):
    """Where eager runs the fused C GEMM (bf16 path, C library built), a plain compile keeps the linear as a call
    (compiled = eager), but ``compile_frozen`` decomposes it: its weights are constants, so their upcast folds and
    no dbr_quant call is left in the code (the frozen speed it exists for). Close to eager, not bit-equal: the
    decomposition's bf16 GEMM rounds its result."""
    from test_rewrite import converted_block

    from dbr_quant.fx_rewriter import compile_frozen, rewrite

    monkeypatch.setattr(cpu_backend, "SMALL_OPERAND", 0)  # the block's small GEMMs would run as small C calls
    _, c, x = converted_block()
    gm = rewrite(c)
    with use_cpu_gemm("bf16"):
        x_q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        if not cpu_backend.runs_fused_gemm(x_q, torch.empty(32, 32, dtype=torch.float8_e4m3fn)):
            pytest.skip("eager does not run the fused C GEMM here (no C library, or not at this batch on this ISA)")
        plain, (plain_code,) = run_and_get_code(torch.compile(gm, fullgraph=True), x)
        frozen, codes = run_and_get_code(compile_frozen(gm), x)
        with torch.no_grad():
            want = c(x)["out"]
    assert "torch.ops.dbr_quant.fp8_linear" in plain_code  # kept as the eager kernel
    assert torch.equal(plain["out"], want)
    assert codes and not any("= torch.ops.dbr_quant." in line for code in codes for line in code.splitlines())
    assert any("bfloat16" in code for code in codes)
    close_to_reference(frozen["out"], want, min_cos=0.999, max_rel=0.03)


@pytest.mark.parametrize("path", GEMM_PATHS)
def test_compile_frozen_folds_the_weight_upcast(path, monkeypatch, close_to_reference):
    """With freezing the weights are constants: the upcast runs once at compile time, not per call. The
    CPU GEMM path current at compile_frozen() is the one compiled in, wherever the call happens."""
    from test_rewrite import converted_block

    from dbr_quant.fx_rewriter import RewriteError, compile_frozen, rewrite

    monkeypatch.setattr(cpu_backend, "SMALL_OPERAND", 0)  # the block's small GEMMs would all run in fp32

    _, c, x = converted_block()
    gm = rewrite(c)
    with _eager_as_decomposed(path):  # without the fused C GEMM, whose linears stay calls (no upcast to fold)
        if path == "bf16":  # once is enough (a compile costs seconds)
            with torch.no_grad():
                torch.compile(gm, fullgraph=True)(x)  # a plain compile of the same graph first must not be reused
        with use_cpu_gemm(path):
            frozen = compile_frozen(gm)
        with use_cpu_gemm("bf16" if path == "fp32" else "fp32"):  # the other path at the call: not used
            out, codes = run_and_get_code(frozen, x)
        assert codes, "compile_frozen did not compile"
        assert not any("= torch.ops.dbr_quant." in line for code in codes for line in code.splitlines())
        assert any("bfloat16" in code for code in codes) == (path == "bf16")
        with torch.no_grad():
            want = c(x)["out"]
    close_to_reference(out["out"], want, min_cos=0.999, max_rel=0.03)  # measured 0.016 (fp32)
    with pytest.raises(RewriteError, match="GraphModule that rewrite"):
        compile_frozen(c)
