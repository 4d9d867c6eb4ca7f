"""The CPU backend's fp8_linear / quantize in every regime they have, against an emulation from torch's own casts and
fp64 math (#20, point 12: the other kernel tests use shapes ≤ 40×70, so only the small path ran); the reference
against the same emulation.

Regimes: both operands ≤ cpu_e4m3.SMALL elements (one C call, fp32) or not (a torch GEMM: fp32 on operands
dequantized first, or bf16 on the upcast codes with the scales applied to the accumulator; gated activations
as two bf16 GEMMs) — each with the C E4M3 decoder/quantizer and with the torch fallback
($DBR_QUANT_CPU_DECODE=torch)."""

import pytest
import torch
import torch.nn.functional as F

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import backend as C
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3
from dbr_quant.kernels.cpu.features import use_cpu_gemm
from dbr_quant.kernels.reference import dense as R

E4M3 = torch.float8_e4m3fn
SMALL = cpu_e4m3.SMALL
# (m, k, n): x is m×k, w is n×k (2n×k gated)
SHAPES = {
    "small": (8, 64, 24),  # x 512, w 1536 (gated 3072) elements: the C small_linear
    "x_large": (96, 64, 24),  # x 6144 > SMALL
    "w_large": (8, 160, 48),  # w 7680 > SMALL
    "both_large": (72, 160, 80),
}
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}
# (activation, bias, residual, per-channel w scale, per-token x scale, FP8 out)
EPILOGUES = {
    "plain": (None, False, False, False, False, False),
    "gelu_bias_residual": ("gelu", True, True, True, False, False),
    "swiglu_per_token": ("swiglu", True, False, True, True, False),
    "relu_fp8_out": ("relu", True, False, True, False, True),
}


def _cast(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's own saturating cast of t·(1/scale) to E4M3 (the README's stated arithmetic)."""
    return (t * torch.reciprocal(scale)).clamp(-448, 448).to(E4M3)


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return ACTIVATIONS[activation](y)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gemm", ["fp32", "bf16", "reference"])  # the CPU backend's GEMM paths, and the reference
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_fp8_linear_equals_an_emulation_from_torch_casts(shape, gemm, epilogue, decode):
    m, k, n = SHAPES[shape]
    activation, bias, residual, per_channel, per_token, fp8_out = EPILOGUES[epilogue]
    rows = 2 * n if activation == "swiglu" else n
    assert (m * k <= SMALL and rows * k <= SMALL) == (shape == "small")  # the shapes sit where they say
    g = torch.Generator().manual_seed(list(SHAPES).index(shape) * len(EPILOGUES) + list(EPILOGUES).index(epilogue))
    x, w = torch.randn(m, k, generator=g) * 3, torch.randn(rows, k, generator=g) * 0.2
    x_scale = (x.abs().amax(-1, keepdim=True) if per_token else x.abs().amax()) / 448
    w_scale = (w.abs().amax(1) if per_channel else w.abs().amax()) / 448
    x_q, w_q = _cast(x, x_scale), _cast(w, w_scale[:, None] if per_channel else w_scale)
    b = torch.randn(rows, generator=g) if bias else None
    r = torch.randn(m, n, generator=g) if residual else None

    # fp64 on the FP8 values: x_q·sx times (w_q·sw)ᵀ, bias, activation, residual
    w_deq = w_q.double() * (w_scale.double()[:, None] if per_channel else w_scale.double())
    y_lin = (x_q.double() * x_scale.double()) @ w_deq.t()
    y = y_lin + b.double() if b is not None else y_lin
    want = _act(y, activation)
    want = want + r.double() if r is not None else want
    out_scale = (want.abs().max() / 448).float() if fp8_out else None  # the output's range, no saturation
    backend, path = (R, "fp32") if gemm == "reference" else (C, gemm)
    with use_cpu_gemm(path):
        got = backend.fp8_linear(x_q, x_scale, w_q, w_scale, bias=b, activation=activation, residual=r,
                                 out_scale=out_scale, out_fmt=FP8Format.E4M3)
    # rounding allowed in the linear part: the bf16 GEMM's result rounded once to bf16 (2**-8 of itself), and
    # the accumulation's own rounding, of the size of |x_q·sx|·|w_q·sw|ᵀ (fp32 GEMMs: only that, ≈ k·2**-24);
    # an activation's slope is ≤ 1.2; a gated product scales the gate's error by |up| and the up's by |act(gate)|
    envelope = (x_q.double().abs() * x_scale.double()) @ w_deq.abs().t()
    bf16 = gemm == "bf16" and shape != "small"
    linear_err = (2**-8 * 1.01 * y_lin.abs() + 2**-12 * envelope) if bf16 else 2e-5 * envelope
    if activation == "swiglu":
        (gate, up), (err_g, err_u) = y.chunk(2, -1), linear_err.chunk(2, -1)
        bound = 1.2 * err_g * (up.abs() + err_u) + F.silu(gate).abs() * err_u
    else:
        bound = 1.2 * linear_err
    bound = bound + 1e-6
    if fp8_out:  # one more rounding onto E4M3 (half a step: 2**-4 relative, 2**-10·scale below the normals)
        assert got.dtype == E4M3
        got = got.double() * out_scale.double()
        bound = bound + 2**-4 * (want.abs() + bound) + 2**-10 * out_scale.double()
    else:
        assert got.dtype == torch.float32
    assert got.shape == want.shape
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, allowed there {bound.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("shape", [(16, 64), (96, 160), (300, 200)])  # ≤ SMALL and beyond it
@pytest.mark.parametrize("per_row", [False, True])
def test_quantize_equals_torch_cast_at_every_size(shape, per_row, decode):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])  # many binades
    scale = (x.abs().amax(-1, keepdim=True) if per_row else x.abs().amax()) / 448 * 1.37
    for backend in (R, C):
        got = backend.quantize(x, scale, FP8Format.E4M3)
        assert torch.equal(got.view(torch.uint8), _cast(x, scale).view(torch.uint8)), backend.__name__
        # and the exact way back: every code times its scale
        assert torch.equal(backend.dequantize(got, scale), got.float() * scale), backend.__name__
