"""The Triton grouped FP8 GEMM (MoE experts) in the CPU interpreter against the reference (exact) and an
fp64 oracle, and compiled ahead of time for Hopper and Ada.

Random routings draw experts without tokens, top_k up to 3 and single-token decode; the test config uses
16×16×32 tiles, so experts span several ragged row tiles and outputs several column tiles. The fp32 dot
sums in another order than torch, so high-precision outputs get a tolerance relative to the accumulator's
magnitude and FP8 outputs may differ by one step where a value sits on a rounding boundary.
"""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_grouped_reference import _block_oracle, _case, magnitude, moe_weights, random_topk
from test_triton_gemm import _jit_signature, _Recorder

from dbr_quant import kernels as K
from dbr_quant.formats import FP8Format, safe_scale
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.reference import grouped as RG
from dbr_quant.kernels.routing import moe_route
from dbr_quant.kernels.triton import aot
from dbr_quant.kernels.triton import gemm as G
from dbr_quant.kernels.triton import grouped_gemm as TG

SMALL = G.GemmConfig("test", 16, 16, 32, GROUP_M=2)
E4M3 = FP8Format.E4M3
ACTS = [None, *R.ACTIVATIONS, *R.GATED]
OUTS = [torch.float32, torch.bfloat16, torch.float16, FP8Format.E4M3, FP8Format.E5M2, "scatter", "scatter-det"]


def assert_fp8_close(got, want):
    """Equal bytes except where a value sits on a rounding boundary: those may be one FP8 step apart."""
    def ordinal(q):
        b = q.view(torch.uint8).to(torch.int32)
        return torch.where(b >= 128, -(b - 128), b)

    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (ordinal(got) - ordinal(want)).abs()
    assert diff.max().item() <= 1 if diff.numel() else True
    assert int((diff != 0).sum()) <= max(1, got.numel() // 100)


@settings(max_examples=40, deadline=None)
@given(tokens=st.sampled_from([1, 2, 5, 17]), experts=st.sampled_from([1, 3, 8]), top_k=st.integers(1, 3),
       k=st.sampled_from([16, 33, 64]), n=st.integers(1, 40), fmt_x=st.sampled_from(list(FP8Format)),
       fmt_w=st.sampled_from(list(FP8Format)), x_kind=st.sampled_from(["tensor", "expert", "row"]),
       w_kind=st.sampled_from(["tensor", "expert", "channel"]), has_bias=st.booleans(),
       activation=st.sampled_from(ACTS), out=st.sampled_from(OUTS), x_sorted=st.booleans(),
       per_expert_out=st.booleans(), n_empty=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_grouped_linear_matches_reference(tokens, experts, top_k, k, n, fmt_x, fmt_w, x_kind, w_kind, has_bias,
                                          activation, out, x_sorted, per_expert_out, n_empty, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k = min(top_k, experts)
    empty = tuple(range(min(n_empty, experts - top_k)))
    ids, r, x_in, xs, x_slot, xs_slot, w_q, ws, bias = _case(gen, tokens, experts, top_k, k, n, activation, x_kind,
                                                             w_kind, has_bias, x_sorted, empty, fmt_x, fmt_w)
    kw = dict(x_sorted=x_sorted, bias=bias, activation=activation)
    if isinstance(out, FP8Format):
        amax = R.amax(RG.fp8_grouped_linear(x_in, xs, w_q, ws, r, **kw))
        scale = amax / out.max * (0.5 + torch.rand(experts if per_expert_out else (), generator=gen)) + 1e-6
        kw.update(out_scale=scale, out_fmt=out)
    elif isinstance(out, str):
        kw.update(topk_weights=torch.rand(tokens, top_k, generator=gen))
    else:
        kw.update(out_dtype=out)
    want = RG.fp8_grouped_linear(x_in, xs, w_q, ws, r, **kw)
    with use_backend("triton-interpret"):
        got = TG.fp8_grouped_linear(x_in, xs, w_q, ws, r, config=SMALL, deterministic=out == "scatter-det", **kw)
    if isinstance(out, FP8Format):
        assert_fp8_close(got, want)
        return
    assert got.shape == want.shape and got.dtype == want.dtype
    mag = magnitude(x_slot, xs_slot, w_q, ws, bias, activation, ids) * (top_k if isinstance(out, str) else 1)
    tol = 1e-5 * (mag + want.abs().max().item()) + 1e-30
    step = 0.0 if got.dtype == torch.float32 else want.float().abs() * 2.0 ** -(8 if out == torch.bfloat16 else 11)
    assert torch.all((got.float() - want.float()).abs() <= tol + step)


@pytest.mark.parametrize("tokens,top_k,experts,x_scale_kind", [
    (1, 2, 8, "dynamic"),  # decode: one token, two experts, six experts idle
    (16, 2, 8, "expert"),
    (9, 3, 6, "tensor"),
])
def test_moe_block_in_three_launches_matches_fp64(tokens, top_k, experts, x_scale_kind):
    """The whole block through the entry point and the default (wrapper-picked) tile configs."""
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter = 64, 48
    x = torch.randn(tokens, hidden, generator=gen)
    ids = random_topk(gen, tokens, experts, top_k, empty=(experts - 1,))
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    w13, ws13, w2, ws2 = moe_weights(gen, experts, hidden, inter)
    amax = safe_scale(x.abs().amax(), E4M3)
    per_expert = amax * (0.6 + torch.rand(experts, generator=gen))
    x_scale = {"dynamic": None, "tensor": amax, "expert": per_expert}[x_scale_kind]
    h_scale = 0.03 + 0.04 * torch.rand(experts, generator=gen) if x_scale_kind != "tensor" else torch.tensor(0.05)
    want = _block_oracle(x, ids, weights, w13, ws13, w2, ws2, h_scale, x_scale, E4M3)
    r = moe_route(ids, experts)
    with use_backend("triton-interpret"), K.count_launches() as launches:
        got = K.fp8_moe_block(x, r, weights, w13, ws13, w2, ws2, h_scale, x_scale=x_scale)
    assert sum(launches.values()) == 3 and launches["fp8_grouped_linear"] == 2
    # fp32 throughout (no bf16 fast path): only an FP8 value of h on a rounding boundary could differ
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
    with use_backend("triton-interpret"), K.count_launches() as launches:
        det = K.fp8_moe_block(x, r, weights, w13, ws13, w2, ws2, h_scale, x_scale=x_scale, deterministic=True)
    assert sum(launches.values()) == (4 if top_k > 1 else 3)
    assert torch.allclose(det, got, rtol=1e-6, atol=1e-7 * got.abs().max().item())
    if top_k <= 2:  # two adds onto zero commute: the atomic combine is bit-identical to the ordered one
        assert torch.equal(det, got)


def test_many_experts_span_several_schedule_chunks():
    """130 experts (three 64-expert chunks of the in-kernel tile schedule), most without tokens."""
    gen = torch.Generator().manual_seed(7)
    experts, tokens = 130, 6
    ids = torch.tensor([[0, 129], [64, 65], [129, 1], [127, 128], [63, 64], [100, 0]])
    r = moe_route(ids, experts)
    x_q, w_q = (torch.randn(tokens, 32, generator=gen) * 4).to(torch.float8_e4m3fn), \
        (torch.randn(experts, 2 * 20, 32, generator=gen) * 4).to(torch.float8_e4m3fn)
    xs, ws = torch.rand(tokens, 1, generator=gen) * 0.1, torch.rand(experts, 40, generator=gen) * 0.1
    h_scale = 0.02 + torch.rand(experts, generator=gen) * 0.02
    want = RG.fp8_grouped_linear(x_q, xs, w_q, ws, r, activation="swiglu", out_scale=h_scale)
    x = torch.randn(tokens, 50, generator=gen)
    x_scale = torch.rand(experts, generator=gen) * 0.02 + 1e-3
    with use_backend("triton-interpret"):
        got = TG.fp8_grouped_linear(x_q, xs, w_q, ws, r, activation="swiglu", out_scale=h_scale, config=SMALL)
        q = TG.moe_quantize(x, x_scale, r, E4M3)
    assert_fp8_close(got, want)
    assert torch.equal(q.view(torch.uint8), RG.moe_quantize(x, x_scale, r, E4M3).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", list(FP8Format))
def test_moe_quantize_is_bit_exact(dtype, fmt):
    gen = torch.Generator().manual_seed(11)
    ids = random_topk(gen, 9, 5, 2, empty=(2,))
    r = moe_route(ids, 5)
    x = (torch.randn(9, 1100, generator=gen) * 30).to(dtype)  # > one 1024-column block
    x[0, :3] = torch.tensor([float("inf"), -0.0, 1e30])
    scale = torch.rand(5, generator=gen) * 0.05 + 1e-3
    with use_backend("triton-interpret"):
        got = TG.moe_quantize(x, scale, r, fmt)
    assert torch.equal(got.view(torch.uint8), RG.moe_quantize(x, scale, r, fmt).view(torch.uint8))


def test_empty_routing_and_rejections():
    r = moe_route(torch.zeros(0, 2, dtype=torch.long), 4)
    w_q = torch.zeros(4, 8, 16, dtype=torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    with use_backend("triton-interpret"):
        out = TG.fp8_grouped_linear(torch.zeros(0, 16, dtype=torch.float8_e4m3fn), one, w_q, one, r,
                                    topk_weights=torch.zeros(0, 2))
        assert out.shape == (0, 8)
        r = moe_route(torch.tensor([[0, 3]]), 4)
        with pytest.raises(TypeError, match="x_q"):
            TG.fp8_grouped_linear(torch.zeros(1, 16), one, w_q, one, r)
        with pytest.raises(ValueError, match="bias must be"):
            TG.fp8_grouped_linear(torch.zeros(1, 16, dtype=torch.float8_e4m3fn), one, w_q, one, r,
                                  bias=torch.zeros(8))
        with pytest.raises(ValueError, match="topk_weights must be"):
            TG.fp8_grouped_linear(torch.zeros(1, 16, dtype=torch.float8_e4m3fn), one, w_q, one, r,
                                  topk_weights=torch.ones(2))


# ---------------------------------------------------------------------------------------------------
# AOT table: it lists what the wrappers launch, and the MoE block's variants compile to FP8 tensor cores


def test_aot_configs_cover_wrapper_launches(monkeypatch):
    rec_gemm, rec_quant = _Recorder(TG.GROUPED_KERNEL), _Recorder(TG.MOE_QUANTIZE_KERNEL)
    monkeypatch.setattr(TG, "GROUPED_KERNEL", rec_gemm)
    monkeypatch.setattr(TG, "MOE_QUANTIZE_KERNEL", rec_quant)
    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 300):  # decode and large configs
        ids = random_topk(gen, tokens, 8, 2)
        r = moe_route(ids, 8)
        x = torch.randn(tokens, 64, generator=gen)
        w13, ws13, w2, ws2 = moe_weights(gen, 8, 64, 32)
        with use_backend("triton-interpret"):
            for x_scale in (None, torch.tensor(0.01), torch.rand(8) * 0.01):
                K.fp8_moe_block(x.bfloat16(), r, torch.rand(tokens, 2), w13, ws13, w2, ws2, torch.rand(8),
                                x_scale=x_scale, bias13=torch.randn(8, 64), deterministic=x_scale is None)
            TG.fp8_grouped_linear(x.to(torch.float8_e5m2), torch.rand(tokens, 1), w13.to(torch.float8_e5m2), ws13,
                                  r, activation="gelu", out_dtype=torch.bfloat16)
    table = [(e[2], e[3], e[4]) for e in TG.AOT_CONFIGS]
    for rec in (rec_gemm, rec_quant):
        assert rec.launches
        for args, kwargs in rec.launches:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
            sig, consts = _jit_signature(rec.kernel, args, kwargs)
            assert (rec.kernel, sig, consts) in table, f"launch not in AOT_CONFIGS: {sig} {consts}"


def test_aot_table_is_complete_and_unique():
    keys = [(e[0], tuple(sorted(e[3].items())), tuple(sorted((k, str(v)) for k, v in e[4].items())))
            for e in TG.AOT_CONFIGS]
    assert len(set(keys)) == len(keys) and len({e[1] for e in TG.AOT_CONFIGS}) == len(keys)
    grouped = [e for e in TG.AOT_CONFIGS if e[0] == "_fp8_grouped_gemm_kernel"]
    assert len(grouped) == len(G.CONFIGS) * 4 * len(ACTS) * 2 * 2 * 7
    assert "grouped_gemm" in aot.kernel_modules()


def _block_variants():
    """What an MoE block launches for E4M3 on the large config: gate_up (gated, gathered rows, FP8 out)
    and down (sorted rows, scatter-add); the covering subset of the AOT tool compiles the other options."""
    want = ("large-gated .* e4m3xe4m3 act=swiglu bias=0 rows=gathered out=fp8e4m3",
            "large .* e4m3xe4m3 act=None bias=0 rows=sorted out=scatter_add")
    picked = [e for e in TG.AOT_CONFIGS if any(re.fullmatch(w, e[1]) for w in want)]
    assert len(picked) == len(want)
    return picked


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 89])
@pytest.mark.parametrize("entry", _block_variants(), ids=lambda e: e[1].split(" | ")[1].replace(" ", ","))
def test_moe_block_kernels_compile_to_fp8_mma_without_spills(entry, arch):
    result = aot.compile_one(TG, entry, arch)
    assert result.ok, result
    assert result.fp8_mma > 0 and result.spill_bytes == 0
    assert result.shared_bytes <= 99 * 1024  # Ada's per-block limit
