"""Issue #23's first slice: the Triton kernels on a real GPU against the reference path on the same device.

Skipped without CUDA (CI has none). Each case runs one kernel entry point under ``use_backend("triton")`` and
under ``use_backend("reference")`` on the same CUDA tensors. Quantization is bit-equal by design (rounding onto
the FP8 grid in fp32 first, then a cast that cannot round again). GEMMs accumulate the same FP8 products in fp32
in another order, so they agree within the fp32 bound below; an FP8 output may then sit one code away.
"""

from __future__ import annotations

import pytest
import torch

from dbr_quant import kernels
from dbr_quant.formats import FP8Format

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E4M3 = FP8Format.E4M3
ACTIVATIONS = [None, "relu", "gelu", "gelu_tanh", "silu", "swiglu"]


def both(fn):
    """``fn()`` on the Triton backend and on the reference backend, with the Triton launch counted."""
    with kernels.use_backend("triton"), kernels.count_launches() as launches:
        fast = fn()
    torch.cuda.synchronize()
    with kernels.use_backend("reference"):
        ref = fn()
    return fast, ref, launches


def fp8_codes_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance, in FP8 codes of the same sign, between two FP8 tensors."""
    ia, ib = a.view(torch.int8).int(), b.view(torch.int8).int()
    return int((ia - ib).abs().max()) if a.numel() else 0


def gemm_bound(x_q, x_scale, w_q, w_scale) -> torch.Tensor:
    """|difference| of two fp32 accumulations of the same FP8 products in different orders: at most K·2⁻²⁴ of
    the sum of the products' magnitudes (per output), plus the fp32 rounding of the scaling."""
    mags = x_q.float().abs() @ w_q.float().abs().t() * (x_scale * w_scale.reshape(1, -1)).abs()
    return mags * (x_q.shape[-1] * 2.0 ** -24 + 2.0 ** -22) + 1e-30


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("shape", [(1, 7), (33, 4096), (4, 128, 96)])
def test_quantize_is_bit_equal(shape):
    x = torch.randn(shape, device="cuda") * 37
    scale = torch.tensor(0.173, device="cuda")
    fast, ref, launches = both(lambda: kernels.quantize(x, scale, E4M3))
    assert torch.equal(fast.view(torch.uint8), ref.view(torch.uint8)) and launches["quantize"] == 1
    assert torch.equal(ref.view(torch.uint8), (x * (1 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn).view(
        torch.uint8))


@pytest.mark.parametrize("per_token", [False, True])
def test_dynamic_quantize_is_bit_equal(per_token):
    x = torch.randn(64, 1000, device="cuda") * torch.logspace(-3, 3, 64, device="cuda")[:, None]
    (fq, fs), (rq, rs), _ = both(lambda: kernels.dynamic_quantize(x, E4M3, per_token))
    assert torch.equal(fs, rs) and torch.equal(fq.view(torch.uint8), rq.view(torch.uint8))


def test_group_quantize_is_bit_equal():
    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
    (fq, fs), (rq, rs), _ = both(lambda: kernels.group_quantize(x, 128, E4M3))
    assert torch.equal(fs, rs) and torch.equal(fq.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("rms", [False, True])
def test_norm_quantize(rms):
    x = torch.randn(50, 768, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(768, device="cuda"), None if rms else torch.randn(768, device="cuda")
    scale = torch.tensor(0.02, device="cuda")
    (fn, fq), (rn, rq), _ = both(lambda: kernels.layer_norm_quantize(x, w, b, 1e-5, scale, E4M3, rms=rms))
    torch.testing.assert_close(fn.float(), rn.float(), rtol=2 ** -7, atol=1e-3)  # bf16 normalized output
    assert fp8_codes_apart(fq, rq) <= 1


def _operands(m, n, k, per_channel):
    x_q = (torch.randn(m, k, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_q = (torch.randn(n, k, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    x_scale = torch.tensor(0.01, device="cuda")
    w_scale = torch.rand(n, device="cuda") * 0.01 + 1e-3 if per_channel else torch.tensor(0.004, device="cuda")
    return x_q, x_scale, w_q, w_scale


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (16, 4096, 4096), (333, 1000, 1024), (2048, 2048, 4096)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_linear_within_the_fp32_bound(m, n, k, per_channel):
    x_q, x_scale, w_q, w_scale = _operands(m, n, k, per_channel)
    fast, ref, launches = both(lambda: kernels.fp8_linear(x_q, x_scale, w_q, w_scale))
    assert launches["fp8_linear"] == 1
    assert ((fast - ref).abs() <= gemm_bound(x_q, x_scale, w_q, w_scale)).all()


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("out", ["bf16", "fp8"])
def test_linear_epilogues(activation, out):
    n = 512
    x_q, x_scale, w_q, w_scale = _operands(64, 2 * n if activation == "swiglu" else n, 768, True)
    bias = torch.randn(w_q.shape[0], device="cuda")
    residual = torch.randn(64, n, device="cuda", dtype=torch.bfloat16)
    kw = dict(bias=bias, activation=activation, residual=residual, out_dtype=torch.bfloat16)
    if out == "fp8":
        kw.update(residual=None, out_scale=torch.tensor(0.05, device="cuda"))
    fast, ref, _ = both(lambda: kernels.fp8_linear(x_q, x_scale, w_q, w_scale, **kw))
    if out == "fp8":
        assert fast.dtype == torch.float8_e4m3fn and fp8_codes_apart(fast, ref) <= 1
    else:
        torch.testing.assert_close(fast.float(), ref.float(), rtol=2 ** -7, atol=2e-2)


def test_block_linear():
    x = torch.randn(96, 1024, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = kernels.block_quantize_weight(torch.randn(768, 1024, device="cuda"))
    x_q, x_s = kernels.group_quantize(x, 128, E4M3)
    fast, ref, launches = both(lambda: kernels.fp8_block_linear(x_q, x_s, w_q, w_s, out_dtype=torch.float32))
    assert launches["fp8_block_linear"] == 1
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_attention(causal):
    q, k, v = (torch.randn(2, 4, 77, 64, device="cuda") for _ in range(3))
    qq, qs = kernels.dynamic_quantize(q, E4M3)
    kq, ks = kernels.dynamic_quantize(k, E4M3)
    vq, vs = kernels.dynamic_quantize(v, E4M3)
    fast, ref, _ = both(lambda: kernels.fp8_attention(qq, qs, kq, ks, vq, vs, is_causal=causal))
    torch.testing.assert_close(fast, ref, rtol=1e-3, atol=1e-3)


def test_attention_per_head_scales():
    """GQA with per-head scales (q, p per query head, k, v per kv head), key ranges 2^12 apart: the GPU kernel
    against the reference, and head by head against per-tensor launches of itself (the same bits)."""
    spread = torch.tensor([2.0**-6, 2.0**6], device="cuda").reshape(1, 2, 1, 1)
    q = torch.randn(2, 8, 77, 64, device="cuda") / spread.repeat_interleave(4, dim=1)
    k, v = torch.randn(2, 2, 77, 64, device="cuda") * spread, torch.randn(2, 2, 77, 64, device="cuda")
    scales = [(t.abs().amax(dim=(0, 2, 3)) / E4M3.max) for t in (q, k, v)]
    qq, kq, vq = (kernels.quantize(t, s.reshape(-1, 1, 1), E4M3) for t, s in zip((q, k, v), scales))
    ps = torch.tensor([1 / 448, 1 / 256] * 4, device="cuda")
    fast, ref, _ = both(lambda: kernels.fp8_attention(qq, scales[0], kq, scales[1], vq, scales[2], is_causal=True,
                                                      p_scale=ps))
    torch.testing.assert_close(fast, ref, rtol=1e-3, atol=1e-3)
    for h in range(8):
        one = kernels.fp8_attention(qq[:, h:h + 1], scales[0][h], kq[:, h // 4:h // 4 + 1], scales[1][h // 4],
                                    vq[:, h // 4:h // 4 + 1], scales[2][h // 4], is_causal=True, p_scale=ps[h])
        assert torch.equal(fast[:, h:h + 1], one), h


@pytest.mark.parametrize("top_k", [1, 2])
def test_grouped_linear(top_k):
    e, t, n, k = 8, 300, 256, 512
    ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(t)])
    routing = kernels.moe_route(ids, e)
    x = torch.randn(t, k, device="cuda")
    w_q = (torch.randn(e, n, k, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_scale = torch.rand(e, n, device="cuda") * 0.01 + 1e-3
    x_scale = torch.rand(e, device="cuda") * 0.02 + 0.01
    weights = torch.rand(t, top_k, device="cuda")

    def run():
        xq = kernels.moe_quantize(x, x_scale, routing, E4M3)
        return kernels.fp8_grouped_linear(xq, x_scale, w_q, w_scale, routing, x_sorted=True, topk_weights=weights,
                                          deterministic=True)
    fast, ref, _ = both(run)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-2)
