"""The sm_90 TMA persistent linear (kernels/triton/tma_gemm.py) on a Hopper GPU against the reference on the same
device (skipped without an sm_90 GPU). It is opt-in (``tma_gemm.AUTO_TMA`` off), so the dispatched tests in
test_gpu_kernels.py never run it; here each call passes ``kernel="tma"``, which raises rather than fall back.

Both tiles: "tma-wide" (128×128×128, epilogue on two column halves) for dense ungated linears, "tma" (128×64×128)
for gated and block-scaled ones. Same checks as the pointer kernel's: exact on small-integer sums (each K step
promoted to fp32), within :func:`gpu_bounds.gemm_bound` on random operands, epilogues within
:func:`gpu_bounds.epilogue_bound`, FP8 out equal to the kernel's own fp32 result rounded by torch.
"""

from __future__ import annotations

import pytest
import torch
from gpu_bounds import epilogue_bound, gemm_bound, magnitudes, record

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.triton import block_gemm as TB
from dbr_quant.kernels.triton import gemm as TG

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU")]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _operands(m, n, k):
    x_q = (torch.randn(m, k, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_q = (torch.randn(n, k, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    return x_q, torch.rand(m, 1, device="cuda") * 0.01 + 1e-3, w_q, torch.rand(n, device="cuda") * 0.01 + 1e-3


def _tma(x_q, x_s, w_q, w_s, **kw):
    with kernels.use_backend("triton"):
        out = TG.fp8_linear(x_q, x_s, w_q, w_s, kernel="tma", **kw)
    torch.cuda.synchronize()
    return out


def _reference(x_q, x_s, w_q, w_s, **kw):
    with kernels.use_backend("reference"):
        return kernels.fp8_linear(x_q, x_s, w_q, w_s, **kw)


@pytest.mark.parametrize("m,n,k", [(300, 1000, 1024), (2048, 4096, 4096)])
def test_tma_linear_within_the_fp32_bound(m, n, k):
    x_q, x_s, w_q, w_s = _operands(m, n, k)
    err = (_tma(x_q, x_s, w_q, w_s) - _reference(x_q, x_s, w_q, w_s)).abs()
    rel = float((err / magnitudes(x_q, x_s, w_q, w_s)).max())
    record(f"tma fp8_linear {m}x{n}x{k}: max |err| / sum|products|", rel)
    assert (err <= gemm_bound(x_q, x_s, w_q, w_s)).all()


@pytest.mark.parametrize("gated", [False, True])
def test_tma_linear_exact_on_small_integer_sums(gated):
    """As test_gpu_kernels' pointer-kernel case: every 128-wide K step sums to < 2^11, the row to < 2^17."""
    m, n, k = 512, 384, 4096
    gen = torch.Generator(device="cuda").manual_seed(5)
    x_q = torch.randint(1, 5, (m, k), device="cuda", generator=gen).float().to(torch.float8_e4m3fn)
    w_q = torch.randint(1, 5, (2 * n if gated else n, k), device="cuda", generator=gen).float().to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    if gated:  # gate sums are ≥ 4096, where silu(g) = g·sigmoid(g) = g in fp32: only the product rounds
        got = _tma(x_q, one, w_q, one, activation="swiglu")
        want = _reference(x_q, one, w_q, one, activation="swiglu")
        torch.testing.assert_close(got, want, rtol=2.0**-20, atol=0.0)  # silu's libm may differ, the sums may not
    else:
        assert torch.equal(_tma(x_q, one, w_q, one), x_q.double().mm(w_q.double().t()).float())


@pytest.mark.parametrize("activation", [None, "gelu", "swiglu"])
@pytest.mark.parametrize("out", ["fp32", "fp8"])
def test_tma_epilogues(activation, out):
    """The heaviest epilogues of each tile: bias + activation + fp32 residual (fp32 out), and FP8 out."""
    m, n, k = 333, 640, 768
    x_q, x_s, w_q, w_s = _operands(m, 2 * n if activation == "swiglu" else n, k)
    bias = torch.randn(w_q.shape[0], device="cuda")
    kw = dict(bias=bias, activation=activation, out_dtype=torch.float32)
    if out == "fp8":
        out_scale = torch.tensor(0.05, device="cuda")
        y32 = _tma(x_q, x_s, w_q, w_s, **kw)
        got = _tma(x_q, x_s, w_q, w_s, **kw, out_scale=out_scale)
        want = (y32 * torch.reciprocal(out_scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    residual = torch.randn(m, n, device="cuda")
    err = (_tma(x_q, x_s, w_q, w_s, residual=residual, **kw) - _reference(x_q, x_s, w_q, w_s, residual=residual,
                                                                           **kw)).abs()
    bound = epilogue_bound(x_q, x_s, w_q, w_s, bias, activation) + 2.0**-22 * residual.abs()
    record(f"tma fp8_linear epilogue {activation}: max |err| / bound", float((err / bound).max()))
    assert (err <= bound).all()


def test_tma_block_linear():
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = kernels.block_quantize_weight(torch.randn(768, 1024, device="cuda"))
    x_q, x_s = kernels.group_quantize(x, 128, FP8Format.E4M3)
    with kernels.use_backend("triton"):
        got = TB.fp8_block_linear(x_q, x_s, w_q, w_s, out_dtype=torch.float32, kernel="tma")
    with kernels.use_backend("reference"):
        want = kernels.fp8_block_linear(x_q, x_s, w_q, w_s, out_dtype=torch.float32)
    bound = sum(gemm_bound(x_q[:, j * 128:(j + 1) * 128], x_s[:, j:j + 1],
                           w_q[:, j * 128:(j + 1) * 128], w_s[:, j].repeat_interleave(128)[:w_q.shape[0]])
                for j in range(x_s.shape[-1]))
    err = (got - want).abs()
    record("tma fp8_block_linear 300x768x1024: max |err| / bound", float((err / bound).max()))
    assert (err <= bound).all()
