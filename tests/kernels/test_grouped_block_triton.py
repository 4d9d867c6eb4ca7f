"""The Triton grouped block-scaled FP8 GEMM (kernels/triton/grouped_block_gemm.py: block-scaled and MXFP8 MoE experts)
in the CPU interpreter against kernels.reference.grouped, and its ahead-of-time rows for sm_89 / sm_90 (FP8 MMA, no
spills).

Random routings draw experts without tokens, top_k up to 3 and single-token decode; 16×16×32 tiles make experts span
several ragged row tiles and outputs several column tiles; K and N are not multiples of the scale blocks. The fp32
sums run in another order than the reference, so outputs get a tolerance relative to the output's magnitude.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_grouped_reference import ACTS, random_topk

from dbr_quant import kernels as K
from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.reference import grouped as RG
from dbr_quant.kernels.routing import moe_route
from dbr_quant.kernels.triton import aot
from dbr_quant.kernels.triton import grouped_block_gemm as TGB
from dbr_quant.kernels.triton.gemm_core import GemmConfig

SMALL = GemmConfig("test", 16, 16, 32, GROUP_M=2)
OUTS = [torch.float32, torch.bfloat16, torch.float16, "scatter"]


def _check(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = float(want.float().abs().amax().clamp(min=1.0))
    tol = 1e-5 if want.dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


@settings(max_examples=25, deadline=None)
@given(tokens=st.sampled_from([1, 2, 5, 17]), experts=st.sampled_from([1, 3, 8]), top_k=st.integers(1, 3),
       k=st.sampled_from([32, 40, 96]), n=st.integers(1, 40), block=st.sampled_from([(16, 32), (8, 64), (1, 32)]),
       fmt=st.sampled_from(list(FP8Format)), has_bias=st.booleans(), activation=st.sampled_from(ACTS),
       out=st.sampled_from(OUTS), x_sorted=st.booleans(), seed=st.integers(0, 2**16))
def test_grouped_block_linear_matches_reference(tokens, experts, top_k, k, n, block, fmt, has_bias, activation, out,
                                                x_sorted, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k = min(top_k, experts)
    r = moe_route(random_topk(gen, tokens, experts, top_k, empty=(0,) if experts > top_k else ()), experts)
    n_w = 2 * n if activation in R.GATED else n
    if activation in R.GATED and n % block[0]:
        n_w, n = 2 * block[0] * -(-n // block[0]), block[0] * -(-n // block[0])  # gate / up: whole row blocks
    bn, bk = block
    kb = -(-k // bk)
    rows_in = tokens * top_k if x_sorted else tokens
    x_q = (torch.randn(rows_in, k, generator=gen) * 4).to(fmt.dtype)
    w_q = (torch.randn(experts, n_w, k, generator=gen) * 4).to(fmt.dtype)
    x_s = torch.rand(rows_in, kb, generator=gen) * 0.1 + 0.01
    w_rows = 2 * -(-n // bn) if activation in R.GATED else -(-n_w // bn)
    w_s = torch.rand(experts, w_rows, kb, generator=gen) * 0.1 + 0.01
    bias = torch.randn(experts, n_w, generator=gen) if has_bias else None
    combine = out == "scatter"
    kw = dict(block=block, x_sorted=x_sorted, bias=bias, activation=activation,
              out_dtype=torch.float32 if combine else out,
              topk_weights=torch.rand(tokens, top_k, generator=gen) if combine else None)
    with use_backend("triton-interpret"):
        got = TGB.fp8_grouped_block_linear(x_q, x_s, w_q, w_s, r, config=SMALL, **kw)
    _check(got, RG.fp8_grouped_block_linear(x_q, x_s, w_q, w_s, r, **kw))


def test_mx_experts_on_the_triton_backend_match_the_reference():
    gen = torch.Generator().manual_seed(2)
    r = moe_route(random_topk(gen, 9, 4, 2), 4)
    with use_backend("reference"):
        x_q, x_codes = K.mx_quantize(torch.randn(9, 80, generator=gen) * 3)
        w_q, w_codes = K.mx_quantize(torch.randn(4, 48, 80, generator=gen))
    topk = torch.rand(9, 2, generator=gen)
    with use_backend("triton-interpret"), K.count_launches() as counts:
        h = K.fp8_grouped_mx_linear(x_q, x_codes, w_q, w_codes, r, activation="swiglu", out_dtype=torch.bfloat16)
        y = K.fp8_grouped_mx_linear(x_q, x_codes, w_q, w_codes, r, topk_weights=topk)
    assert counts == {"fp8_grouped_mx_linear": 2}
    _check(h, RG.fp8_grouped_mx_linear(x_q, x_codes, w_q, w_codes, r, activation="swiglu", out_dtype=torch.bfloat16))
    _check(y, RG.fp8_grouped_mx_linear(x_q, x_codes, w_q, w_codes, r, topk_weights=topk))


def test_rejections_name_the_op_and_the_tensor():
    r = moe_route(torch.tensor([[0], [1]]), 2)
    x_q, w_q = torch.zeros(2, 64, dtype=torch.float8_e4m3fn), torch.zeros(2, 8, 64, dtype=torch.float8_e4m3fn)
    with use_backend("triton-interpret"):
        with pytest.raises(ValueError, match="x_scale must have shape"):
            TGB.fp8_grouped_block_linear(x_q, torch.ones(2, 3), w_q, torch.ones(2, 1, 2), r, block=(8, 32))
        with pytest.raises(ValueError, match="fp8_grouped_block_linear: w_scale must be"):
            TGB.fp8_grouped_block_linear(x_q, torch.ones(2, 2), w_q, torch.ones(1, 2), r, block=(8, 32))
        with pytest.raises(ValueError, match="must be a multiple of 32"):
            TGB.fp8_grouped_block_linear(x_q, torch.ones(2, 4), w_q, torch.ones(2, 1, 4), r, block=(8, 16))
        with pytest.raises(TypeError, match="E8M0"):
            TGB.fp8_grouped_mx_linear(x_q, torch.ones(2, 2), w_q, torch.ones(2, 8, 2), r)


def test_aot_rows_are_unique_and_for_the_default_architectures():
    keys = [(tuple(sorted(e[3].items())), tuple(sorted((k, str(v)) for k, v in e[4].items()))) for e in TGB.AOT_CONFIGS]
    assert len(set(keys)) == len(keys) and len({e[1] for e in TGB.AOT_CONFIGS}) == len(keys)
    rows = aot.all_configs("grouped_block")
    assert rows and aot.for_arch(rows, 90) == rows and aot.for_arch(rows, 89) == rows


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 89])
@pytest.mark.parametrize("pattern", [
    r"medium-gated .* block=128x128 e4m3xe4m3 act=swiglu bias=0 rows=gathered out=bf16",
    r"large-gated .* block=1x32 e4m3xe4m3 act=swiglu bias=1 rows=gathered out=fp32"])
def test_moe_block_variants_compile_to_fp8_mma_without_spills(pattern, arch):
    import re

    entry = next(e for e in TGB.AOT_CONFIGS if re.fullmatch(pattern, e[1]))
    result = aot.compile_one(TGB, entry, arch)
    assert result.ok and result.fp8_mma > 0 and result.spill_bytes == 0, result


def test_aot_configs_cover_wrapper_launches(monkeypatch):
    from test_triton_gemm import _jit_signature, _Recorder

    rec = _Recorder(TGB.GROUPED_BLOCK_KERNEL)
    monkeypatch.setattr(TGB, "GROUPED_BLOCK_KERNEL", rec)
    gen = torch.Generator().manual_seed(5)
    with use_backend("triton-interpret"):
        for tokens, block, act, fmt, out in [(1, (128, 128), "swiglu", FP8Format.E4M3, torch.bfloat16),
                                             (64, (1, 32), None, FP8Format.E5M2, "scatter"),
                                             (600, (128, 128), "gelu", FP8Format.E4M3, torch.float16)]:
            r = moe_route(random_topk(gen, tokens, 4, 2), 4)
            n_w = 512 if act == "swiglu" else 256
            combine = out == "scatter"
            rows = tokens * 2 if combine else tokens
            w_q = (torch.randn(4, n_w, 384, generator=gen) * 4).to(fmt.dtype)
            kb, w_rows = 384 // block[1], -(-n_w // block[0])
            TGB.fp8_grouped_block_linear(
                (torch.randn(rows, 384, generator=gen) * 4).to(fmt.dtype), torch.rand(rows, kb), w_q,
                torch.rand(4, w_rows, kb), r, block=block, x_sorted=combine, bias=torch.randn(4, n_w), activation=act,
                out_dtype=torch.float32 if combine else out, topk_weights=torch.rand(tokens, 2) if combine else None)
    table = [(e[2], e[3], e[4]) for e in TGB.AOT_CONFIGS]
    assert len(rec.launches) == 3
    for args, kwargs in rec.launches:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        sig, consts = _jit_signature(rec.kernel, args, kwargs)
        assert (rec.kernel, sig, consts) in table, f"launch not in AOT_CONFIGS: {sig} {consts}"
