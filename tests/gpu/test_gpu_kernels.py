"""Issue #23: the Triton kernels on a real GPU against the reference path on the same device.

Skipped without CUDA (CI has none). Each case runs one kernel entry point under ``use_backend("triton")`` and
under ``use_backend("reference")`` on the same CUDA tensors.

* Quantization is bit-equal by design (rounding onto the FP8 grid in fp32 first, then a cast that cannot round
  again; scales divided with IEEE division on both sides).
* GEMMs: Hopper's FP8 tensor cores add products at reduced precision (about 14 bits), and the kernels promote
  each BLOCK_K step's partial sum to the fp32 accumulator (see gemm_core.main_loop). Two checks: (1) operands
  whose every partial sum is an integer below 2^11 — exact at any precision of 12 bits or more, and for fp32
  in any order — must give exactly the reference's result (an unpromoted K = 4096 sum of positive products
  exceeds 2^14 and loses bits there, so this fails without promotion); (2) random operands stay within the
  fp32 reordering bound plus one 2^-13 rounding of each 32-product tensor-core step (:func:`gemm_bound`).
  The largest error seen, as a fraction of Σ|products|, goes to $DBR_GPU_STATS for the report.
* An FP8 output may sit one grid step from the reference's (:func:`fp8_steps_apart`, signed grid order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpu_bounds import epilogue_bound, gemm_bound, magnitudes, record

from dbr_quant import kernels
from dbr_quant.formats import FP8Format

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E4M3 = FP8Format.E4M3
E5M2 = FP8Format.E5M2
ACTIVATIONS = [None, "relu", "gelu", "gelu_tanh", "silu", "swiglu"]


def both(fn):
    """``fn()`` on the Triton backend and on the reference backend, with the Triton launch counted."""
    with kernels.use_backend("triton"), kernels.count_launches() as launches:
        fast = fn()
    torch.cuda.synchronize()
    with kernels.use_backend("reference"):
        ref = fn()
    return fast, ref, launches


def fp8_steps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two FP8 tensors in steps of the FP8 grid, counted across zero: codes are
    sign-magnitude, so the position on the grid is ±(code & 0x7F) (+0 and -0 both 0)."""
    def position(t: torch.Tensor) -> torch.Tensor:
        code = t.view(torch.uint8).int()
        return torch.where(code >= 128, -(code & 0x7F), code & 0x7F)
    return int((position(a) - position(b)).abs().max()) if a.numel() else 0


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


def test_in_kernel_reciprocal_is_torch_reciprocal():
    """Static scales are inverted inside the kernels (common.reciprocal_rn, PTX div.rn.f32) where the reference
    calls torch.reciprocal: the same bits on the device, per-row scales over the whole normal range."""
    raw = torch.randint(2**23, 2**31 - 2**23, (4096,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    scale = torch.cat([raw, torch.rand(4096) * 10]).cuda()[:, None]
    x = torch.randn(scale.shape[0], 64, device="cuda") * scale  # every row near its own scale
    fast, ref, _ = both(lambda: kernels.quantize(x, scale, E4M3))
    assert torch.equal(fast.view(torch.uint8), ref.view(torch.uint8))
    ones = torch.ones_like(scale)  # 1 · (1/s) for each s: FP8 of the reciprocal itself, on CPU too
    with kernels.use_backend("triton"):
        q = kernels.quantize(ones, scale, E5M2)
    assert torch.equal(q.view(torch.uint8).cpu(), torch.reciprocal(scale.cpu()).clamp(-E5M2.max, E5M2.max).to(
        torch.float8_e5m2).view(torch.uint8))


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
    assert fp8_steps_apart(fq, rq) <= 1


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
    err = (fast - ref).abs()
    record(f"fp8_linear {m}x{n}x{k} per_channel={per_channel}: max |err| / sum|products|",
           float((err / magnitudes(x_q, x_scale, w_q, w_scale)).max()))
    assert (err <= gemm_bound(x_q, x_scale, w_q, w_scale)).all()


@pytest.mark.parametrize("m", [1, 16, 333, 2048])
def test_linear_exact_on_small_integer_sums(m):
    """Positive integer operands ≤ 4 (exact in E4M3), scales 1: each BLOCK_K ≤ 128 step sums to < 2^11 and the
    whole K = 4096 row to < 2^17 — exact in fp32 in any order, so the result must equal the reference's bits."""
    n, k = 256, 4096
    gen = torch.Generator(device="cuda").manual_seed(m)
    x_q = torch.randint(1, 5, (m, k), device="cuda", generator=gen).float().to(torch.float8_e4m3fn)
    w_q = torch.randint(1, 5, (n, k), device="cuda", generator=gen).float().to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    fast, ref, _ = both(lambda: kernels.fp8_linear(x_q, one, w_q, one))
    assert torch.equal(ref, x_q.double() @ w_q.double().t())  # the reference is exact here
    assert torch.equal(fast, ref), float((fast - ref).abs().max())


def test_unpromoted_sums_lose_bits_on_hopper():
    """GemmConfig(promote=False), the variant benchmarks/gpu.py times against the promoted default: on sm_90 the
    K = 4096 integer sums above (< 2^17) exceed the tensor core's ~14-bit adder and come out inexact, which is why
    the default promotes every BLOCK_K step (its result is exact: the test above)."""
    from dbr_quant.kernels.triton import gemm as triton_gemm

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("sm_89's mma.sync accumulates in fp32")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x_q = torch.randint(1, 5, (256, 4096), device="cuda", generator=gen).float().to(torch.float8_e4m3fn)
    w_q = torch.randint(1, 5, (256, 4096), device="cuda", generator=gen).float().to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    exact = x_q.double() @ w_q.double().t()
    cfg = triton_gemm.pick_config(256)
    promoted = triton_gemm.fp8_linear(x_q, one, w_q, one, config=cfg, kernel="classic")
    fast = triton_gemm.fp8_linear(x_q, one, w_q, one, config=dataclasses.replace(cfg, promote=False),
                                  kernel="classic")
    record("fp8_linear unpromoted K=4096 integer sums: max |err| / sum", float(((fast - exact).abs() / exact).max()))
    assert torch.equal(promoted.double(), exact) and not torch.equal(fast.double(), exact)


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
        # the kernel's own fp32 result (same tiles, same accumulation order), rounded as torch rounds it: the
        # FP8 epilogue must give exactly those bits; the fp32 result itself is checked against the reference's
        out_scale = kw.pop("out_scale")
        with kernels.use_backend("triton"):
            y32 = kernels.fp8_linear(x_q, x_scale, w_q, w_scale, **{**kw, "out_dtype": torch.float32})
        expected = (y32 * torch.reciprocal(out_scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert fast.dtype == torch.float8_e4m3fn and torch.equal(fast.view(torch.uint8), expected.view(torch.uint8))
        with kernels.use_backend("reference"):
            ref32 = kernels.fp8_linear(x_q, x_scale, w_q, w_scale, **{**kw, "out_dtype": torch.float32})
        err = (y32 - ref32).abs()
        bound = epilogue_bound(x_q, x_scale, w_q, w_scale, bias, activation)
        record(f"fp8_linear epilogue {activation}: max |err| / bound", float((err / bound).max()))
        assert (err <= bound).all()
    else:
        torch.testing.assert_close(fast.float(), ref.float(), rtol=2 ** -7, atol=2e-2)


def test_block_linear():
    x = torch.randn(96, 1024, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = kernels.block_quantize_weight(torch.randn(768, 1024, device="cuda"))
    x_q, x_s = kernels.group_quantize(x, 128, E4M3)
    fast, ref, launches = both(lambda: kernels.fp8_block_linear(x_q, x_s, w_q, w_s, out_dtype=torch.float32))
    assert launches["fp8_block_linear"] == 1
    # block scales: bound each 128-wide K block with its own scales, then sum the blocks' bounds
    kb = x_s.shape[-1]
    bound = sum(gemm_bound(x_q[:, j * 128:(j + 1) * 128], x_s[:, j:j + 1],
                           w_q[:, j * 128:(j + 1) * 128], w_s[:, j].repeat_interleave(128)[:w_q.shape[0]])
                for j in range(kb))
    err = (fast - ref).abs()
    record("fp8_block_linear 96x768x1024: max |err| / bound", float((err / bound).max()))
    assert (err <= bound).all()


@pytest.mark.parametrize("causal", [False, True])
def test_attention(causal):
    q, k, v = (torch.randn(2, 4, 77, 64, device="cuda") for _ in range(3))
    qq, qs = kernels.dynamic_quantize(q, E4M3)
    kq, ks = kernels.dynamic_quantize(k, E4M3)
    vq, vs = kernels.dynamic_quantize(v, E4M3)
    fast, ref, _ = both(lambda: kernels.fp8_attention(qq, qs, kq, ks, vq, vs, is_causal=causal))
    # kernel and reference round different P (unnormalised vs normalised) to FP8: each is within
    # 2^-(M+1)·max|v|·(1 + Lk·p_scale·MIN_NORMAL) of exact attention (tests/kernels/test_triton_attention.py)
    vmax = float(vq.float().abs().max() * vs)
    bound = 2 * (2.0 ** -4 * vmax * (1 + 77 / 448 * 2.0 ** -6) + 1e-5 * vmax + 1e-6)
    err = float((fast - ref).abs().max())
    record(f"fp8_attention causal={causal}: max |err| / bound", err / bound)
    assert err <= bound
    cos = torch.nn.functional.cosine_similarity(fast.flatten(), ref.flatten(), dim=0)
    assert cos > 0.999


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("p_scale", [1 / 448, 1 / 1024])
def test_attention_native_cast_is_the_fp32_rounding(masked, p_scale):
    """On sm_90 the kernel turns P into FP8 with the hardware cast (cvt.rn.satfinite: one rounding, saturating)
    instead of round_to_fp8 in fp32: with the same tile, the two must give the same output bits (p_scale 1/1024
    saturates P's largest values). The new wide tile is also checked against the tile the H100 measured."""
    from dbr_quant.kernels.triton import attention as triton_attention

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the native cast is used on sm_90 only")
    q, k, v = (torch.randn(2, 4, 300, 128, device="cuda") for _ in range(3))
    (qq, qs), (kq, ks), (vq, vs) = (kernels.dynamic_quantize(t, E4M3) for t in (q, k, v))
    mask = (torch.rand(2, 1, 300, 300, device="cuda") > 0.2) if masked else None
    tile = triton_attention.gpu_tile(300, 128, 90, masked)
    ps = torch.tensor(p_scale, device="cuda")
    outs = [triton_attention.fp8_attention(qq, qs, kq, ks, vq, vs, attn_mask=mask, is_causal=True, p_scale=ps,
                                           tile=dataclasses.replace(tile, native_cast=native))
            for native in (True, False)]
    assert torch.equal(outs[0], outs[1])
    measured = triton_attention.fp8_attention(qq, qs, kq, ks, vq, vs, attn_mask=mask, is_causal=True, p_scale=ps,
                                              tile=triton_attention.measured_tile(300, 128))
    # different key tiles round different running-max P: each within test_attention's bound of exact attention
    vmax = float(vq.float().abs().max() * vs)
    bound = 2 * (2.0 ** -4 * vmax * (1 + 300 * p_scale * 2.0 ** -6) + 1e-5 * vmax + 1e-6)
    record(f"fp8_attention wide vs measured tile masked={masked}: max |diff| / bound",
           float((outs[0] - measured).abs().max()) / bound)
    assert float((outs[0] - measured).abs().max()) <= bound


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
    # test_attention's bound, per query head with its own max|v|·sv and p_scale
    vmax = (vq.float().abs().amax(dim=(0, 2, 3)) * scales[2]).repeat_interleave(4)
    bound = 2 * (2.0 ** -4 * vmax * (1 + 77 * ps * 2.0 ** -6) + 1e-5 * vmax + 1e-6)
    err = (fast - ref).abs().amax(dim=(0, 2, 3))
    record("fp8_attention per-head scales: max |err| / bound", float((err / bound).max()))
    assert (err <= bound).all()
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
    # per routed (token, expert) pair the fp32 + tensor-core bound of a dense linear, weighted and summed
    bound = torch.zeros_like(ref)
    for j in range(top_k):
        e_ids = ids[:, j]
        xs = x_scale[e_ids]
        xq_t = (x * (1 / xs)[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        mags = (xq_t.float().abs()[:, None, :] * w_q[e_ids].float().abs()).sum(-1) * (xs[:, None] * w_scale[e_ids])
        bound += weights[:, j:j + 1].abs() * mags * (k * 2.0 ** -24 + 2.0 ** -22 + 2.0 ** -13)
    err = (fast - ref).abs()
    record(f"fp8_grouped_linear top_k={top_k}: max |err| / bound", float((err / (bound + 1e-30)).max()))
    assert (err <= bound + 1e-6).all()
