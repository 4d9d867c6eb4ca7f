"""The CPU backend (kernels.cpu.backend) against the plain reference (kernels.reference), on every CPU path forced:
both GEMM paths (bf16, fp32), the C E4M3 kernels on and off ($DBR_QUANT_CPU_DECODE), small and large operands.

The tolerance stated in kernels/reference/dense.py's docstring:
* quantize, dequantize, dynamic scales, norms, the block GEMM on the fp32 path: the reference's bits;
* linears and matmuls: bit for bit where fp32 holds every partial sum and the scales are powers of two (the two
  scale orders then round nothing); in general within the fp32 accumulation's rounding (both orders), plus the
  GEMM result's one rounding to bf16 on the bf16 path.
And which backend runs: "auto" picks the CPU backend for CPU tensors, "reference" forces the plain one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dbr_quant import kernels
from dbr_quant.formats import FP8Format, safe_scale
from dbr_quant.kernels.cpu import backend as C
from dbr_quant.kernels.cpu.features import use_cpu_gemm
from dbr_quant.kernels.reference import block as RB
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.reference import grouped as RG
from dbr_quant.kernels.routing import moe_route

E4M3 = FP8Format.E4M3
U32, U16 = 2.0**-24, 2.0**-8
# (m, k, n): both operands ≤ SMALL_OPERAND elements (one C call), or not (a torch GEMM on the path's dtype)
SHAPES = {"small": (4, 32, 24), "large": (40, 160, 48)}


@pytest.fixture(params=["bf16", "fp32"])
def path(request):
    with use_cpu_gemm(request.param):
        yield request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _grid_operands(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 operands whose products and partial sums fp32 holds exactly, and whose sums bf16 holds too: values
    ±{0, 1/2, 1, 2, 4} (k ≤ 160 terms of at most 16: every sum a multiple of 1/4 below 2**12 — 14 bits, so not
    bf16 in general; the bf16 path is compared against the reference rounded to bf16)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0, -0.5, -1.0, -2.0, -4.0])
    pick = lambda *shape: values[torch.randint(0, len(values), shape, generator=g)]  # noqa: E731
    return pick(m, k).to(torch.float8_e4m3fn), pick(n, k).to(torch.float8_e4m3fn)


def _scaled_case(m: int, k: int, n: int, seed: int, per_token: bool, per_channel: bool):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g) * 3, torch.randn(n, k, generator=g) * 0.2
    xs = safe_scale(x.abs().amax(-1, keepdim=True) if per_token else x.abs().amax(), E4M3)
    ws = safe_scale(w.abs().amax(1) if per_channel else w.abs().amax(), E4M3)
    return R.quantize(x, xs, E4M3), xs, R.quantize(w, ws[:, None] if per_channel else ws, E4M3), ws, g


# ---------------------------------------------------------------- which backend runs


def test_auto_runs_the_cpu_backend_on_cpu_and_reference_forces_the_plain_one(monkeypatch):
    x = torch.randn(3, 8)
    assert kernels._impl(x) is C and kernels.resolve_backend(x.device) == "cpu"
    with kernels.use_backend("reference"):
        assert kernels._impl(x) is R and kernels._impl(x, RB) is RB and kernels._impl(x, RG) is RG
    with kernels.use_backend("cpu"):
        assert kernels._impl(x) is C
    monkeypatch.setenv("DBR_QUANT_BACKEND", "reference")
    monkeypatch.setattr(kernels, "_env_cache", [])  # read the variable again (it is read once)
    monkeypatch.setattr(kernels.dispatch, "_env_cache", kernels._env_cache)
    assert kernels._impl(x) is R and kernels.current_backend() == "reference"


def test_the_reference_backend_runs_the_plain_kernels_through_the_entry_points():
    xq, xs, wq, ws, _ = _scaled_case(40, 160, 48, 0, False, True)
    with kernels.use_backend("reference"):
        got = kernels.fp8_linear(xq, xs, wq, ws, activation="gelu")
    assert torch.equal(got, R.fp8_linear(xq, xs, wq, ws, activation="gelu"))


# ---------------------------------------------------------------- the same bits


@pytest.mark.parametrize("shape", [(16, 64), (300, 200)])  # ≤ SMALL_OPERAND and beyond it
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_and_dequantize_are_the_references_bits(shape, per_row, dtype, decode):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[1])).to(dtype)
    x[0, :4] = torch.tensor([float("inf"), float("-inf"), 1e30, -0.0])
    for fmt in FP8Format:
        scale = R.dynamic_scale(x, fmt, per_token=per_row) * 1.37
        q = C.quantize(x, scale, fmt)
        assert torch.equal(_bits(q), _bits(R.quantize(x, scale, fmt))), fmt
        assert torch.equal(C.dequantize(q, scale), R.dequantize(q, scale))
        got_q, got_s = C.dynamic_quantize(x, fmt, per_row)
        want_q, want_s = R.dynamic_quantize(x, fmt, per_row)
        assert torch.equal(_bits(got_q), _bits(want_q)) and torch.equal(got_s, want_s)


@pytest.mark.parametrize("rms", [False, True])
def test_norm_quantize_is_the_references(rms, decode):
    g = torch.Generator().manual_seed(2)
    x, weight, bias = torch.randn(5, 300, generator=g) * 3, torch.randn(300, generator=g), torch.randn(300, generator=g)
    scale = torch.tensor(0.01)
    y, q = C.layer_norm_quantize(x, weight, bias, 1e-5, scale, E4M3, rms=rms)
    y_ref, q_ref = R.layer_norm_quantize(x, weight, bias, 1e-5, scale, E4M3, rms=rms)
    assert torch.equal(y, y_ref) and torch.equal(_bits(q), _bits(q_ref))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("activation", [None, "relu", "swiglu"])
def test_linear_and_matmul_with_exact_sums_and_power_of_two_scales(shape, activation, path, decode):
    """fp32 holds every partial sum and the scales are powers of two: both scale orders round nothing, so the CPU
    backend is the reference bit for bit, except the bf16 path's one rounding of a large GEMM's result."""
    m, k, n = SHAPES[shape]
    xq, wq = _grid_operands(m, k, 2 * n if activation == "swiglu" else n, seed=len(shape) + k)
    xs, ws = torch.tensor(2.0**-3), torch.full((wq.shape[0],), 2.0**-5)
    bias = torch.arange(wq.shape[0], dtype=torch.float32) / 8
    got = C.fp8_linear(xq, xs, wq, ws, bias=bias, activation=activation)
    mm = C.fp8_matmul(xq, xs, wq.t(), ws[:1])
    want = R.fp8_linear(xq, xs, wq, ws, bias=bias, activation=activation)
    want_mm = R.fp8_matmul(xq, xs, wq.t(), ws[:1])
    if path == "bf16" and shape == "large":  # a torch bf16 GEMM's result rounded once to bf16, then the same epilogue
        want_mm = (xq.float() @ wq.float().t()).to(torch.bfloat16).float() * (xs * ws[:1])
        if decode == "torch":  # without the C library's fused GEMM (fp32 sums, no bf16 rounding) the linear too
            acc = F.linear(xq.float(), wq.float()).to(torch.bfloat16).float()
            want = R.linear_epilogue(R.dequantize_accumulator(acc, xs * ws, bias), activation, None, torch.float32,
                                     None, E4M3)
    assert torch.equal(got, want) and torch.equal(mm, want_mm)


def test_block_linear_is_the_references_bits_on_the_fp32_path(decode):
    g = torch.Generator().manual_seed(3)
    x_q, x_s = RB.group_quantize(torch.randn(2, 7, 300, generator=g), 128)
    w_q, w_s = RB.block_quantize_weight(torch.randn(200, 300, generator=g))
    (gate, gate_s), (up, up_s) = (RB.block_quantize_weight(torch.randn(64, 300, generator=g)) for _ in range(2))
    gate_up, gate_up_s = torch.cat([gate, up]), torch.cat([gate_s, up_s])
    bias = torch.randn(200, generator=g)
    with use_cpu_gemm("fp32"):
        assert torch.equal(C.fp8_block_linear(x_q, x_s, w_q, w_s, bias=bias),
                           RB.fp8_block_linear(x_q, x_s, w_q, w_s, bias=bias))
        assert torch.equal(C.fp8_block_linear(x_q, x_s, gate_up, gate_up_s, activation="swiglu"),
                           RB.fp8_block_linear(x_q, x_s, gate_up, gate_up_s, activation="swiglu"))
    assert torch.equal(_bits(C.group_quantize(x_q.float(), 128)[0]), _bits(RB.group_quantize(x_q.float(), 128)[0]))


# ---------------------------------------------------------------- within the stated tolerance


def _bound(path: str, small: bool, k: int, mag: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """How far the CPU backend's linear may be from the reference's (both fp64 views): each accumulates k products
    in fp32 (γ_k·Σ|x||w|·|s| each, plus the scale's rounding); the bf16 path rounds its result once to bf16."""
    err = 2 * (k + 3) * U32 * mag
    if path == "bf16" and not small:
        err = err + U16 * (acc.abs() + err)
    return err + 1e-30


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("epilogue", ["plain", "gelu_bias_residual", "swiglu_per_token", "relu_fp8_out"])
def test_linear_is_within_the_stated_tolerance_of_the_reference(shape, epilogue, path, decode):
    m, k, n = SHAPES[shape]
    activation = {"plain": None, "gelu_bias_residual": "gelu", "swiglu_per_token": "swiglu",
                  "relu_fp8_out": "relu"}[epilogue]
    rows = 2 * n if activation == "swiglu" else n
    xq, xs, wq, ws, g = _scaled_case(m, k, rows, seed=k + rows, per_token=epilogue == "swiglu_per_token",
                                     per_channel=True)
    bias = torch.randn(rows, generator=g) if epilogue != "plain" else None
    residual = torch.randn(m, n, generator=g) if epilogue == "gelu_bias_residual" else None
    kw = dict(bias=bias, activation=activation, residual=residual)
    if epilogue == "relu_fp8_out":  # FP8 out: at most one code apart (a value within the GEMM rounding of a midpoint)
        out_scale = R.fp8_linear(xq, xs, wq, ws, **kw).abs().amax() / 448
        got = C.fp8_linear(xq, xs, wq, ws, out_scale=out_scale, **kw)
        want = R.fp8_linear(xq, xs, wq, ws, out_scale=out_scale, **kw)
        steps = (_bits(got).int() - _bits(want).int()).abs()
        assert steps.max() <= 1 and (steps > 0).float().mean() < 0.1
        return
    got = C.fp8_linear(xq, xs, wq, ws, **kw).double()
    want = R.fp8_linear(xq, xs, wq, ws, **kw).double()
    s = xs.double() * ws.double()
    acc = xq.double() @ wq.double().t() * s
    pre = acc if bias is None else acc + bias.double()
    # + the bias's own rounding step (in the GEMM on the fp32 paths, in the epilogue on the reference's)
    bound = _bound(path, shape == "small", k, xq.double().abs() @ wq.double().abs().t() * s.abs(), acc) \
        + 2 * U32 * pre.abs()
    if activation == "swiglu":  # the gate's error scaled by |up|, the up's by |silu(gate)| (slope ≤ 1.1)
        (gate, up), (b_g, b_u) = pre.chunk(2, -1), bound.chunk(2, -1)
        bound = 1.1 * b_g * (up.abs() + b_u) + F.silu(gate).abs() * b_u + 4 * U32 * want.abs()
    else:
        bound = 1.13 * bound + 4 * U32 * (want.abs() + (0 if residual is None else residual.double().abs()))
    err = (got - want).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, allowed there {bound.flatten()[err.argmax()]:.3g}"


def test_attention_is_within_the_stated_tolerance_of_the_reference(path, decode):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, n, 64, generator=g) for n in (40, 48, 48))
    scales = [safe_scale(t.abs().amax(), E4M3) for t in (q, k, v)]
    qq, kq, vq = (R.quantize(t, s, E4M3) for t, s in zip((q, k, v), scales))
    got = C.fp8_attention(qq, scales[0], kq, scales[1], vq, scales[2], is_causal=True)
    want = R.fp8_attention(qq, scales[0], kq, scales[1], vq, scales[2], is_causal=True)
    # S's rounding can move a probability by one FP8 step (2**-4 relative) before P·V
    assert (got - want).abs().max() <= 2.0**-3 * want.abs().max()
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999


def test_grouped_linears_run_the_cpu_linear_per_expert(path, decode):
    g = torch.Generator().manual_seed(5)
    experts, tokens, k, n = 4, 40, 160, 48
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    r = moe_route(ids, experts)
    x = torch.randn(tokens, k, generator=g)
    xs = safe_scale(x.abs().amax(), E4M3)
    xq = R.quantize(x, xs, E4M3)
    wq = R.quantize(torch.randn(experts, 2 * n, k, generator=g), torch.tensor(0.002), E4M3)
    ws = torch.full((experts, 2 * n), 0.002)
    got = C.fp8_grouped_linear(xq, xs, wq, ws, r, activation="swiglu")
    offsets = r.expert_offsets.tolist()
    for e in range(experts):  # each expert's rows are exactly the CPU backend's dense linear of them
        rows = r.tokens[offsets[e]:offsets[e + 1]]
        assert torch.equal(got[offsets[e]:offsets[e + 1]], C.fp8_linear(xq[rows], xs, wq[e], ws[e],
                                                                        activation="swiglu"))
    want = RG.fp8_grouped_linear(xq, xs, wq, ws, r, activation="swiglu")
    assert (got - want).abs().max() <= 2.0**-6 * want.abs().max()
    assert torch.equal(_bits(C.moe_quantize(x, xs.expand(experts), r, E4M3)),
                       _bits(RG.moe_quantize(x, xs.expand(experts), r, E4M3)))
