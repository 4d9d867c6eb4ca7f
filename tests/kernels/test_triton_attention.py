"""The Triton FP8 flash-attention kernel in the CPU interpreter against ``reference.fp8_attention`` and
torch SDPA on the dequantized inputs, and compiled ahead of time for Hopper (wgmma) and Ada (mma.sync).

Error bound. The kernel rounds the unnormalised P = exp(s - m_running) ∈ [0, 1] to FP8 with p_scale, the
reference rounds the normalised softmax; neither is exact. One FP8 rounding of p/p_scale has relative
error ≤ 2^-(M+1) (M mantissa bits: 2^-4 for E4M3) in the normal range and absolute error ≤ half a
subnormal step, 2^-(M+1)·MIN_NORMAL. Summed over the keys with |v_j| ≤ max|v|, weights that sum to 1 and
l ≥ 1 (the row maximum contributes exp(0) = 1):

    |O - O_exact| ≤ BOUND = 2^-(M+1) · max|v|·sv · (1 + Lk · p_scale · MIN_NORMAL)

for the kernel and for the reference alike, so |O_kernel - O_ref| ≤ 2·BOUND. A small slack covers fp32
accumulation order and exp2 vs exp (relative ~1e-6). Cosine similarity (> 0.999) is checked where the
output has enough elements for the per-probability rounding errors to average out (> 0.995 for E5M2).
"""

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.backends.compiler import GPUTarget

from dbr_quant.formats import FP8Format, safe_scale
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import dense as reference
from dbr_quant.kernels.triton import attention as TA
from dbr_quant.kernels.triton.common import fp8_constants

MIN_COSINE_ELEMENTS = 512
# E5M2 keeps 2 mantissa bits, not 3: twice the rounding error, four times the 1 - cosine
MIN_COSINE = {FP8Format.E4M3: 0.999, FP8Format.E5M2: 0.995}


def _quant(x, fmt, per_token=False, per_head=False):
    """(fp8, scale): per tensor (0-d), per token ((B, H, L, 1)) or per head ([H], quantized through its
    (H, 1, 1) view, as the runtime does)."""
    if per_head:
        scale = safe_scale(x.abs().amax(dim=(0, 2, 3)), fmt)
        return reference.quantize(x, reference.head_view(scale), fmt), scale
    scale = safe_scale(x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax(), fmt)
    return reference.quantize(x, scale, fmt), scale


def _kernel(*args, **kwargs):
    with use_backend("triton-interpret"):
        return TA.fp8_attention(*args, **kwargs)


def _bound(v_q, v_scale, lk, p_scale, fmt):
    """BOUND with the largest |v|·sv over every head (per-head scales: a looser bound for the other heads)."""
    c = fp8_constants(fmt)
    vmax = (v_q.float().abs() * reference.head_view(v_scale)).amax().item()
    return 2.0 ** -(c["MANTISSA_BITS"] + 1) * vmax * (1 + lk * p_scale * c["MIN_NORMAL"]) + 1e-5 * vmax + 1e-6


def _keep(mask, causal, shape):
    """(B, Hq, Lq, Lk) bool: which scores survive the masks (False for -inf float entries)."""
    keep = torch.ones(shape, dtype=torch.bool)
    if causal:
        keep &= torch.ones(shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        keep &= mask if mask.dtype == torch.bool else mask != float("-inf")
    return keep


def _check(q, qs, k, ks, v, vs, *, mask=None, causal=False, softmax_scale=None, p_scale=None,
           fmt=FP8Format.E4M3, stats=None, tile=None):
    """Run kernel, reference and SDPA; assert bounds, exact zeros on fully masked rows; return errors."""
    out = _kernel(q, qs, k, ks, v, vs, attn_mask=mask, is_causal=causal, softmax_scale=softmax_scale,
                  p_scale=p_scale, fmt=fmt, tile=tile)
    rep = q.shape[1] // k.shape[1]
    ref = reference.fp8_attention(q, qs, k, ks, v, vs, attn_mask=mask, is_causal=causal,
                                  softmax_scale=softmax_scale, p_scale=p_scale, fmt=fmt)
    qd, kd, vd = (t.float() * reference.head_view(s) for t, s in ((q, qs), (k, ks), (v, vs)))
    sdpa = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, is_causal=causal, scale=softmax_scale,
                                          enable_gqa=rep > 1).nan_to_num(0.0)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    live = _keep(mask, causal, (*q.shape[:3], k.shape[2])).any(-1)
    assert (out[~live] == 0).all() and (ref[~live] == 0).all()
    ps = 1.0 / fmt.max if p_scale is None else p_scale.max().item()
    bound = _bound(v, vs, k.shape[2], ps, fmt)
    err_ref, err_sdpa = (out - ref).abs().max().item(), (out - sdpa).abs().max().item()
    assert err_sdpa <= bound, (err_sdpa, bound)
    assert err_ref <= 2 * bound, (err_ref, bound)
    if out[live].numel() >= MIN_COSINE_ELEMENTS:
        for other in (ref, sdpa):
            cos = F.cosine_similarity(out[live].flatten(), other[live].flatten(), dim=0).item()
            assert cos > MIN_COSINE[fmt], cos
    if stats is not None:
        stats.append((err_ref / bound, err_sdpa / bound))
    return out, ref, sdpa


@st.composite
def attention_cases(draw):
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    lq = draw(st.sampled_from([1, 2, 15, 16, 17, 33, 40]) | st.integers(1, 40))
    lk = draw(st.sampled_from([1, 2, 15, 16, 17, 33, 40]) | st.integers(1, 40))
    return dict(b=b, hkv=hkv, hq=hkv * group, lq=lq, lk=lk, d=draw(st.sampled_from([16, 32])),
                causal=draw(st.booleans()),
                mask=draw(st.sampled_from(["none", "bool", "float", "bool_keys", "float_rows", "bool_2d"])),
                softmax_scale=draw(st.sampled_from([None, 0.3, 1.0])),
                scales=draw(st.sampled_from(["tensor", "token", "head"])),
                p_scale=draw(st.sampled_from([None, 1 / 256, "head"])), seed=draw(st.integers(0, 2**16)))


def _make_mask(kind, b, hq, lq, lk, gen):
    """Masks of every kind, with broadcast dims, some positions masked and the first query row masked
    entirely (it must come out as exact zeros)."""
    if kind == "none":
        return None
    shape = {"bool": (b, hq, lq, lk), "float": (b, 1, lq, lk), "bool_keys": (b, 1, 1, lk),
             "float_rows": (1, hq, lq, 1), "bool_2d": (lq, lk)}[kind]
    keep = torch.rand(shape, generator=gen) > 0.3
    if shape[-2] == lq:
        keep[..., 0, :] = False
    if kind.startswith("bool"):
        return keep
    return torch.where(keep, torch.randn(shape, generator=gen), torch.tensor(float("-inf")))


@settings(max_examples=50, deadline=None)
@given(attention_cases())
def test_matches_reference_and_sdpa(case):
    gen = torch.Generator().manual_seed(case["seed"])
    fmt = FP8Format.E4M3
    b, hq, hkv, lq, lk, d = (case[n] for n in ("b", "hq", "hkv", "lq", "lk", "d"))
    per_token, per_head = case["scales"] == "token", case["scales"] == "head"
    # per head: heads whose ranges differ by up to 2^6 (the case per-head scales are for)
    spread = torch.pow(2.0, torch.randint(0, 7, (1, max(hq, hkv), 1, 1), generator=gen).float())
    q, qs = _quant(torch.randn(b, hq, lq, d, generator=gen) * 2 * spread[:, :hq], fmt, per_token, per_head)
    k, ks = _quant(torch.randn(b, hkv, lk, d, generator=gen) * spread[:, :hkv], fmt, per_token, per_head)
    v, vs = _quant(torch.randn(b, hkv, lk, d, generator=gen) / spread[:, :hkv], fmt, per_head=per_head)
    mask = _make_mask(case["mask"], b, hq, lq, lk, gen)
    p_scale = (None if case["p_scale"] is None else torch.tensor(case["p_scale"]) if case["p_scale"] != "head"
               else torch.pow(2.0, torch.randint(0, 4, (hq,), generator=gen).float()) / fmt.max)  # no saturation
    _check(q, qs, k, ks, v, vs, mask=mask, causal=case["causal"], softmax_scale=case["softmax_scale"],
           p_scale=p_scale)


def _inputs(b=2, hq=4, hkv=2, lq=33, lk=40, d=32, fmt=FP8Format.E4M3):
    q, qs = _quant(torch.randn(b, hq, lq, d) * 2, fmt)
    k, ks = _quant(torch.randn(b, hkv, lk, d), fmt)
    v, vs = _quant(torch.randn(b, hkv, lk, d), fmt)
    return q, qs, k, ks, v, vs


@pytest.mark.parametrize("causal", [False, True])
def test_typical_error_is_far_below_the_bound(causal):
    """Random rounding errors average out: measured errors are a small fraction of the worst case."""
    stats = []
    _check(*_inputs(), causal=causal, stats=stats)
    rel_ref, rel_sdpa = stats[0]
    assert rel_sdpa < 0.5 and rel_ref < 1.0, stats


def test_fully_masked_rows_are_zero_not_nan():
    q, qs, k, ks, v, vs = _inputs(lq=20, lk=20)
    keep = torch.rand(2, 4, 20, 20) > 0.5
    keep[:, :, 3] = False
    keep[1, 2, 19] = False
    float_mask = torch.where(keep, 0.0, float("-inf"))
    for mask in (keep, float_mask):
        out, _, _ = _check(q, qs, k, ks, v, vs, mask=mask, causal=True)
        assert (out[:, :, 3] == 0).all() and (out[1, 2, 19] == 0).all()
    # causal with Lk < Lq: every row keeps key 0, so nothing is masked entirely
    out, _, _ = _check(*_inputs(lq=30, lk=5), causal=True)
    assert (out.abs().amax(-1) > 0).all()


def test_finfo_min_mask_gives_uniform_weights_like_torch():
    """HF-style padding masks use finfo.min: a row masked that way everywhere averages v like softmax does
    (finfo.min · log2 e would overflow to -inf and give zeros without the kernel's clamp)."""
    q, qs, k, ks, v, vs = _inputs(lq=17, lk=19)
    mask = torch.zeros(1, 1, 17, 19)
    mask[..., 5:] = torch.finfo(torch.float32).min
    mask[..., 2, :] = torch.finfo(torch.float32).min
    out, ref, _ = _check(q, qs, k, ks, v, vs, mask=mask)
    assert out[:, :, 2].abs().amax() > 0 and ref[:, :, 2].abs().amax() > 0


def test_zero_stride_and_non_contiguous_inputs():
    """Masks expanded with stride 0 and q/k/v stored as (B, L, H, D) and transposed are read in place."""
    q, qs, k, ks, v, vs = _inputs(lq=18, lk=21)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    mask = (torch.rand(2, 1, 1, 21) > 0.2).expand(2, 4, 18, 21)
    out, _, _ = _check(qt, qs, kt, ks, vt, vs, mask=mask)
    assert torch.equal(out, _kernel(q, qs, k, ks, v, vs, attn_mask=mask.contiguous()))


def test_e5m2_inputs():
    fmt = FP8Format.E5M2
    _check(*_inputs(fmt=fmt, lq=24, lk=35), causal=True, fmt=fmt)


def test_empty_and_single_key():
    q, qs, k, ks, v, vs = _inputs(lq=1, lk=5)
    assert _kernel(q[:, :, :0], qs, k, ks, v, vs).shape == (2, 4, 0, 32)
    assert (_kernel(q, qs, k[:, :, :0], ks, v[:, :, :0], vs) == 0).all()  # no keys at all: zeros, like torch
    # one key: P = 1 exactly, so the output is v itself, up to the scales' fp32 product
    q, qs, k, ks, v, vs = _inputs(lq=7, lk=1)
    out = _kernel(q, qs, k, ks, v, vs)
    want = (v.float() * vs).repeat_interleave(2, dim=1).expand_as(out)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=0)


def test_rejects_unsupported_inputs():
    q, qs, k, ks, v, vs = _inputs(d=32)
    with pytest.raises(ValueError, match="head dim 48"):
        _kernel(*_inputs(d=48))
    with pytest.raises(ValueError, match="multiple"):
        _kernel(q, qs, k[:, :1].repeat(1, 3, 1, 1), ks, v[:, :1].repeat(1, 3, 1, 1), vs)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        _kernel(q.float(), qs, k, ks, v, vs)
    with pytest.raises(ValueError, match="per tensor"):
        _kernel(q, qs, k, ks, v, torch.ones(2, 2, 40, 1))
    with pytest.raises(ValueError, match="q_scale"):
        _kernel(q, torch.ones(3), k, ks, v, vs)
    with pytest.raises(ValueError, match=r"k_scale .* per head \[2\]"):  # k's scales are per kv head
        _kernel(q, qs, k, torch.ones(4), v, vs)
    with pytest.raises(ValueError, match=r"v_scale .* per head \(\[2\]\)"):
        _kernel(q, qs, k, ks, v, torch.ones(4))


def test_per_head_scales_are_per_tensor_attention_on_each_head():
    """One launch with per-head scales (GQA: q and p per query head, k and v per kv head) gives, head by head,
    what per-tensor launches on that head alone give: the kernel reads the right scale for every head."""
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, lq, lk, d = 2, 4, 2, 19, 23, 16
    spread = torch.tensor([1.0, 16.0, 0.25, 4.0]).reshape(1, 4, 1, 1)
    q, qs = _quant(torch.randn(b, hq, lq, d, generator=gen) * spread, FP8Format.E4M3, per_head=True)
    k, ks = _quant(torch.randn(b, hkv, lk, d, generator=gen) * spread[:, 1:3], FP8Format.E4M3, per_head=True)
    v, vs = _quant(torch.randn(b, hkv, lk, d, generator=gen) * spread[:, :2], FP8Format.E4M3, per_head=True)
    ps = torch.tensor([1 / 448, 1 / 256, 1 / 448, 1 / 64])
    out, ref, _ = _check(q, qs, k, ks, v, vs, causal=True, p_scale=ps)
    for h in range(hq):
        g = h // (hq // hkv)
        one = _kernel(q[:, h:h + 1], qs[h], k[:, g:g + 1], ks[g], v[:, g:g + 1], vs[g], is_causal=True,
                      p_scale=ps[h])
        assert torch.equal(out[:, h:h + 1], one), h


def _gpu_tiles() -> list:
    """Every tile gpu_tile picks (any architecture, head dim, query length, mask), with a flag for its masked use."""
    return sorted({(TA.gpu_tile(lq, d, arch, masked), masked) for arch in TA.ARCHS for d in TA.HEAD_DIMS
                   for lq in (1, 10**6) for masked in (False, True)}, key=str)


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("tile,masked", _gpu_tiles(), ids=str)
def test_gpu_tile_sizes_in_the_interpreter(d, tile, masked):
    """The block sizes compiled for the GPU, interpreted on sequences that cross several tiles (P rounded in fp32:
    the interpreter cannot run the hardware cast, which tests/gpu compares with it on a device)."""
    tile = dataclasses.replace(tile, native_cast=False)
    q, qs, k, ks, v, vs = _inputs(b=1, hq=4, hkv=1, lq=150, lk=300, d=d)
    mask = torch.rand(1, 1, 150, 300) > 0.1 if masked else None
    for causal in (False, True):
        _check(q, qs, k, ks, v, vs, mask=mask, causal=causal, tile=tile)


def test_native_cast_is_refused_in_the_interpreter():
    q, qs, k, ks, v, vs = _inputs(lq=9, lk=11, d=16)
    with pytest.raises(ValueError, match="native_cast needs a compiled sm_90 kernel"):
        _kernel(q, qs, k, ks, v, vs, tile=TA.gpu_tile(1000, 16, 90, masked=False))


def test_sm90_tiles_use_wide_mma_without_a_mask_and_keep_the_measured_geometry_with_one():
    """Unmasked sm_90 launches take 128-key steps (wgmma n128 for Q·Kᵀ, not the measured tile's n16); masked ones
    keep the H100-measured geometry; Ada keeps its tiles and the fp32 rounding of P (its cast rounds twice)."""
    for d in TA.HEAD_DIMS:
        for lq in (1, 4096):
            wide = TA.gpu_tile(lq, d, 90, masked=False)
            assert wide.block_n == 128 and wide.native_cast
            masked = TA.gpu_tile(lq, d, 90, masked=True)
            measured = TA.measured_tile(lq, d)
            assert (masked.block_m, masked.block_n, masked.num_warps) == (measured.block_m, measured.block_n,
                                                                         measured.num_warps)
            assert not TA.gpu_tile(lq, d, 89, masked=False).native_cast


def _arch(config) -> int:
    return int(re.search(r"sm_(\d+)", config[1]).group(1))


def _compile(config, arch):
    _, desc, kernel, sig, consts = config
    warps = int(re.search(r"warps=(\d+)", desc).group(1))
    stages = int(re.search(r"stages=(\d+)", desc).group(1))
    src = triton.compiler.ASTSource(fn=kernel.jit, signature=sig, constexprs=consts, attrs=TA.aot_attrs(config))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    fp8 = "e4m3" if "e4m3" in desc else "e5m2"
    mma = "wgmma.mma_async" if arch == 90 else "mma.sync"
    lines = [line for line in ptx.splitlines() if mma in line]
    assert lines and all(f".{fp8}.{fp8}" in line for line in lines), desc
    # both GEMMs: QKᵀ has N = BLOCK_N, P·V has N = BLOCK_D; with two warpgroups on 64 rows each takes
    # half of N, so the wgmma shapes are m64n{N or N/2}k32 (mma.sync on Ada is always m16n8k32)
    if arch == 90:
        shapes = {int(n) for n in re.findall(r"m64n(\d+)k32", ptx)}
        halves = {consts["BLOCK_N"], consts["BLOCK_D"], consts["BLOCK_N"] // 2, consts["BLOCK_D"] // 2}
        assert len(shapes) >= 1 and shapes <= halves, (desc, shapes)
        if consts["BLOCK_N"] == 128 and consts["BLOCK_M"] == 64 * warps // 4:  # one warpgroup per 64 rows
            assert 128 in shapes, (desc, shapes)  # Q·Kᵀ as wgmma n128, not split across warpgroups
    smem_limit = {90: 232448, 89: 101376}[arch]
    assert compiled.metadata.shared <= smem_limit, (desc, compiled.metadata.shared)


def test_aot_configs_cover_every_launch():
    descs = [c[1] for c in TA.AOT_CONFIGS]
    assert len(descs) == len(set(descs))
    want = {(arch, d, kind, TA.gpu_tile(lq, d, arch, kind != "none")) for arch in TA.ARCHS for d in TA.HEAD_DIMS
            for lq in (1, 10**6) for kind in TA.MASK_KINDS}
    got = {(_arch(c), c[4]["HEAD_DIM"], re.search(r"mask=(\w+)", c[1]).group(1),
            TA.AttnTile(c[4]["BLOCK_M"], c[4]["BLOCK_N"], int(re.search(r"warps=(\d+)", c[1]).group(1)),
                        int(re.search(r"stages=(\d+)", c[1]).group(1)), c[4]["NATIVE_CAST"]))
           for c in TA.AOT_CONFIGS}
    assert got == want
    assert len(descs) == 2 * 2 * len(want)  # formats × causal per (arch, head dim, mask kind, tile)


# a representative subset: smallest and largest head dim, both tile sizes, all mask kinds, causal on/off;
# every configuration is compiled (with ptxas spill checks) by
# `python -m dbr_quant.kernels.triton.aot --all --only attn`
SUBSET = [c for c in TA.AOT_CONFIGS if c[1] in {
    "e4m3 D=16 causal=False mask=bool BLOCK_M=64 BLOCK_N=32 warps=8 stages=3 native=1 sm_90",
    "e4m3 D=128 causal=True mask=float BLOCK_M=64 BLOCK_N=32 warps=8 stages=3 native=1 sm_90",
    "e4m3 D=128 causal=True mask=none BLOCK_M=128 BLOCK_N=128 warps=8 stages=2 native=1 sm_90",
    "e4m3 D=32 causal=True mask=none BLOCK_M=64 BLOCK_N=128 warps=4 stages=2 native=1 sm_90",
    "e4m3 D=16 causal=False mask=bool BLOCK_M=64 BLOCK_N=32 warps=4 stages=3 native=0 sm_89",
    "e4m3 D=128 causal=True mask=float BLOCK_M=64 BLOCK_N=32 warps=8 stages=3 native=0 sm_89",
}]


@pytest.mark.parametrize("config", SUBSET, ids=lambda c: c[1])
def test_aot_subset_compiles_to_fp8_mma(config):
    assert len(SUBSET) == 6
    _compile(config, _arch(config))


def test_default_softmax_scale_is_inverse_sqrt_head_dim():
    q, qs, k, ks, v, vs = _inputs(lq=9, lk=11, d=16)
    explicit = _kernel(q, qs, k, ks, v, vs, softmax_scale=1 / math.sqrt(16))
    assert torch.equal(_kernel(q, qs, k, ks, v, vs), explicit)
