"""Weight-only FP8 (W8A16): the reference against fp64, the CPU backend against the reference, the dispatcher's choice.

* reference: ``x · (w_q·s)ᵀ + bias`` in fp64 from the exact FP8 values, per channel and per tensor, every epilogue.
* CPU backend: fp32 x within an fp32 ulp-scale tolerance (W dequantized first); bf16 x on the bf16 GEMM path within
  one bf16 rounding of the GEMM result; x is never rounded to bf16 when it is fp32.
* dispatch: the op's Triton kernel is chosen on a CUDA device without FP8 tensor cores (resolve_backend's rule),
  while the FP8 ops keep the CPU backend's torch path there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dbr_quant import kernels
from dbr_quant.kernels import dispatch, table
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.cpu.features import use_cpu_gemm
from dbr_quant.kernels.reference import weight_only as RW


def weight(n: int, k: int, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k) * torch.linspace(0.1, 3, n)[:, None]
    scale = (w.abs().amax(1) / 448) if per_channel else w.abs().amax() / 448
    q = kernels.quantize(w, scale[:, None] if per_channel else scale, kernels.reference.FP8Format.E4M3)
    return q, scale


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("activation", [None, "gelu_tanh", "swiglu"])
def test_reference_against_fp64(per_channel, activation):
    n = 40
    q, s = weight(n, 72, per_channel)
    x = torch.randn(3, 4, 72)
    bias = torch.randn(n)
    residual = torch.randn(3, 4, n // 2 if activation == "swiglu" else n)
    got = RW.fp8_weight_only_linear(x, q, s, bias=bias, activation=activation, residual=residual)
    w = q.double() * (s.double()[:, None] if per_channel else s.double())
    y = (x.double() @ w.T + bias.double()).float()
    if activation == "swiglu":
        g, u = y.chunk(2, -1)
        y = F.silu(g) * u
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    torch.testing.assert_close(got, y + residual, rtol=1e-5, atol=1e-4)


def test_reference_checks_operands():
    q, s = weight(8, 16)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        RW.fp8_weight_only_linear(torch.randn(2, 16).to(torch.float8_e4m3fn), q, s)
    with pytest.raises(ValueError, match="N×K with K = 12"):
        RW.fp8_weight_only_linear(torch.randn(2, 12), q, s)


@pytest.mark.parametrize("path", ["fp32", "bf16"])
def test_cpu_backend_against_reference(decode, path):
    q, s = weight(96, 256)
    bias = torch.randn(96)
    x32 = torch.randn(5, 256)
    with use_cpu_gemm(path):
        got = cpu_backend.fp8_weight_only_linear(x32, q, s, bias=bias, activation="silu")
        want = RW.fp8_weight_only_linear(x32, q, s, bias=bias, activation="silu")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 x: an fp32 GEMM on either path
        xb = x32.bfloat16()
        got_b = cpu_backend.fp8_weight_only_linear(xb, q, s, bias=bias, out_dtype=torch.bfloat16)
    want_b = RW.fp8_weight_only_linear(xb, q, s, bias=bias, out_dtype=torch.float32)
    torch.testing.assert_close(got_b.float(), want_b, rtol=2**-7, atol=2e-2)


def test_entry_point_runs_the_cpu_backend_on_cpu():
    q, s = weight(16, 32)
    x = torch.randn(2, 32)
    with kernels.count_launches() as counts:
        y = kernels.fp8_weight_only_linear(x, q, s)
    assert counts["fp8_weight_only_linear"] == 1
    torch.testing.assert_close(y, RW.fp8_weight_only_linear(x, q, s), rtol=1e-5, atol=1e-5)


def test_dispatch_gives_weight_only_triton_on_gpus_without_fp8_tensor_cores(monkeypatch):
    """An sm_80 device: the FP8 ops take the CPU backend's torch path, the weight-only GEMM its Triton kernel."""
    ampere = torch.device("cuda", 0)
    monkeypatch.setattr(dispatch, "fp8_tensor_cores", lambda device: False)
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    assert dispatch.resolve_backend(ampere) == "cpu"
    assert dispatch.resolve_backend(ampere, needs_fp8_tensor_cores=False) == "triton"
    assert dispatch.resolve_backend(torch.device("cpu"), needs_fp8_tensor_cores=False) == "cpu"
    assert not table.fp8_weight_only_linear.fp8_tensor_cores and table.fp8_linear.fp8_tensor_cores
