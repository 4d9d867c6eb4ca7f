"""The reference FP8 kernels against torch's own casts and an fp64 computation on FP8 values (the CPU backend's
tolerance against them: test_cpu_backend.py)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dbr_quant.formats import FP8Format, safe_scale
from dbr_quant.kernels.cpu import backend as C
from dbr_quant.kernels.reference import dense as R

FORMATS = [FP8Format.E4M3, FP8Format.E5M2]


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=64),
    log_scale=st.floats(-12, 8),
    fmt=st.sampled_from(FORMATS),
)
def test_quantize_matches_torch_cast_bit_for_bit(values, log_scale, fmt):
    x = torch.tensor(values, dtype=torch.float32)
    scale = torch.tensor(2.0**log_scale * 1.37)
    got = R.quantize(x, scale, fmt)
    want = (x * torch.reciprocal(scale)).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    assert got.dtype == fmt.dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_quantize_saturates_and_rounds_the_known_carry_case():
    fmt = FP8Format.E4M3
    x = torch.tensor([126.7, 1e9, -1e9, float("inf"), float("-inf"), 0.0, -0.0])
    q = R.quantize(x, torch.tensor(1.0), fmt).float()
    assert q.tolist()[:5] == [128.0, 448.0, -448.0, 448.0, -448.0]
    assert q[5] == 0 and q[6] == 0


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 70), n=st.integers(1, 40), per_channel=st.booleans(),
       act=st.sampled_from([None, "relu", "gelu", "gelu_tanh", "silu"]), bias=st.booleans(),
       residual=st.booleans())
def test_linear_is_fp32_accurate_and_the_cpu_backend_within_bf16_rounding(m, k, n, per_channel, act, bias,
                                                                           residual):
    fmt = FP8Format.E4M3
    x, w = torch.randn(m, k) * 3, torch.randn(n, k)
    xs = safe_scale(x.abs().amax(), fmt)
    ws = safe_scale(w.abs().amax(1), fmt) if per_channel else safe_scale(w.abs().amax(), fmt)
    xq = R.quantize(x, xs, fmt)
    wq = R.quantize(w, ws.unsqueeze(1) if per_channel else ws, fmt)
    b = torch.randn(n) if bias else None
    r = torch.randn(m, n) if residual else None
    exact = R.fp8_linear(xq, xs, wq, ws, bias=b, activation=act, residual=r)
    fast = C.fp8_linear(xq, xs, wq, ws, bias=b, activation=act, residual=r)
    # ground truth: fp64 products of the FP8 values, scales after
    acc = xq.double() @ wq.double().t() * (xs.double() * ws.double())
    if b is not None:
        acc = acc + b.double()
    ref = R.apply_activation(acc, act)
    ref = ref + r.double() if r is not None else ref
    tol = 1e-5 * (ref.abs().max().item() + 1)
    assert (exact.double() - ref).abs().max().item() <= tol
    # the CPU backend's bf16 path rounds the GEMM result once to bf16: relative 2**-8 of the accumulator's size
    acc_size = (xq.double().abs() @ wq.double().abs().t() * (xs * ws).double()).max().item()
    assert (fast.double() - ref).abs().max().item() <= 2**-8 * acc_size * 1.1 + tol


@pytest.mark.parametrize(("gated", "act"), [("swiglu", F.silu), ("geglu", F.gelu),
                                            ("geglu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
def test_gated_epilogue_equals_activation_times_up(gated, act):
    fmt = FP8Format.E4M3
    x, w = torch.randn(5, 16), torch.randn(2 * 8, 16)
    xs, ws = safe_scale(x.abs().amax(), fmt), safe_scale(w.abs().amax(1), fmt)
    xq, wq = R.quantize(x, xs, fmt), R.quantize(w, ws.unsqueeze(1), fmt)
    full = R.fp8_linear(xq, xs, wq, ws)
    for backend in (R, C):
        y = backend.fp8_linear(xq, xs, wq, ws, activation=gated)
        assert torch.allclose(y, act(full[:, :8]) * full[:, 8:], rtol=1e-2, atol=1e-2), (gated, backend.__name__)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_fp8_attention_matches_sdpa_on_fp8_inputs(causal, gqa):
    fmt = FP8Format.E4M3
    q = torch.randn(2, 4, 7, 16)
    k = torch.randn(2, 2 if gqa else 4, 9, 16)
    v = torch.randn_like(k)
    mask = None if causal else (torch.rand(2, 1, 7, 9) > 0.2)
    scales = [safe_scale(t.abs().amax(), fmt) for t in (q, k, v)]
    qq, kq, vq = (R.quantize(t, s, fmt) for t, s in zip((q, k, v), scales))
    out = R.fp8_attention(qq, scales[0], kq, scales[1], vq, scales[2], attn_mask=mask, is_causal=causal)
    deq = [t.float() * s for t, s in zip((qq, kq, vq), scales)]
    ref = F.scaled_dot_product_attention(*deq, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    # P is rounded to E4M3 (relative 2**-4 per probability): outputs agree to a few percent of |v|
    assert (out - ref).abs().max() < 0.08 * deq[2].abs().max()
    assert F.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.999


@pytest.mark.parametrize("backend", [R, C], ids=["reference", "cpu"])
@pytest.mark.parametrize("gqa", [False, True])
def test_fp8_attention_per_head_scales_are_per_tensor_attention_on_each_head(backend, gqa):
    """Per-head scales (q, p per query head; k, v per kv head) give, head by head, the bits of per-tensor
    attention on that head alone with its own scales; and they match SDPA on the dequantized inputs."""
    fmt, hq, hkv = FP8Format.E4M3, 4, 2 if gqa else 4
    spread = torch.tensor([1.0, 32.0, 0.125, 4.0]).reshape(1, 4, 1, 1)
    q = torch.randn(2, hq, 7, 16) * spread
    k, v = torch.randn(2, hkv, 9, 16) * spread[:, :hkv], torch.randn(2, hkv, 9, 16) / spread[:, :hkv]
    scales = [safe_scale(t.abs().amax(dim=(0, 2, 3)), fmt) for t in (q, k, v)]
    qq, kq, vq = (R.quantize(t, R.head_view(s), fmt) for t, s in zip((q, k, v), scales))
    ps = torch.tensor([1 / 448, 1 / 64, 1 / 448, 1 / 128])
    out = backend.fp8_attention(qq, scales[0], kq, scales[1], vq, scales[2], is_causal=True, p_scale=ps)
    for h in range(hq):
        g = h // (hq // hkv)
        one = backend.fp8_attention(qq[:, h:h + 1], scales[0][h], kq[:, g:g + 1], scales[1][g], vq[:, g:g + 1],
                                    scales[2][g], is_causal=True, p_scale=ps[h])
        assert torch.equal(out[:, h:h + 1], one), h
    deq = [t.float() * R.head_view(s) for t, s in zip((qq, kq, vq), scales)]
    ref = F.scaled_dot_product_attention(*deq, is_causal=True, enable_gqa=gqa)
    vmax = deq[2].abs().amax(dim=(0, 2, 3), keepdim=True).repeat_interleave(hq // hkv, dim=1)
    assert ((out - ref).abs() <= 0.08 * vmax).all()  # P's E4M3 rounding, relative to each head's own |v|


def test_dynamic_scale_per_token_gives_one_scale_per_row():
    x = torch.tensor([[1.0, -2.0], [0.0, 0.0], [448.0, float("nan")]])
    s = R.dynamic_scale(x, FP8Format.E4M3, per_token=True)
    assert s.shape == (3, 1)
    assert s[:, 0].tolist() == pytest.approx([2 / 448, 1.0, 1.0])
    assert math.isfinite(R.dynamic_scale(torch.zeros(3), FP8Format.E5M2, per_token=False).item())
