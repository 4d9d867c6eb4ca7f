"""The Triton grouped weight-only FP8 GEMM (kernels/triton/grouped_weight_only_gemm.py: MoE experts, W8A16) in the
CPU interpreter against kernels.reference.grouped.fp8_grouped_weight_only_linear, and its ahead-of-time rows for
sm_80 (bf16 MMA present, no spills).

Random routings draw experts without tokens, top_k up to 3 and single-token decode; 16×16×32 tiles make experts
span several ragged row tiles and outputs several column tiles. The fp32 dot sums in another order than torch, so
outputs get a tolerance relative to the output's magnitude (the reference computes the fp32 x the kernel rounds to
bf16 from that bf16 x, as the dense kernel's test does).
"""

from __future__ import annotations

import re

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from test_grouped_reference import ACTS, random_topk
from test_triton_gemm import _jit_signature, _Recorder
from triton.backends.compiler import GPUTarget

from dbr_quant import kernels as K
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.reference import grouped as RG
from dbr_quant.kernels.routing import moe_route
from dbr_quant.kernels.triton import aot
from dbr_quant.kernels.triton import grouped_weight_only_gemm as TGW
from dbr_quant.kernels.triton.gemm_core import GemmConfig

SMALL = GemmConfig("test", 16, 16, 32, GROUP_M=2)
OUTS = [torch.float32, torch.bfloat16, torch.float16, "scatter", "scatter-det"]


def _weights(gen, experts, n_w, k, w_kind):
    w_q = (torch.randn(experts, n_w, k, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = {"tensor": (), "expert": (experts,), "channel": (experts, n_w)}[w_kind]
    return w_q, torch.rand(shape, generator=gen) * 0.02 + 0.002


def _check(got, want, out_dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = float(want.float().abs().amax().clamp(min=1.0))
    tol = 1e-5 if out_dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


@settings(max_examples=30, deadline=None)
@given(tokens=st.sampled_from([1, 2, 5, 17]), experts=st.sampled_from([1, 3, 8]), top_k=st.integers(1, 3),
       k=st.sampled_from([16, 33, 64]), n=st.integers(1, 40), x_dtype=st.sampled_from([torch.bfloat16, torch.float16,
                                                                                        torch.float32]),
       w_kind=st.sampled_from(["tensor", "expert", "channel"]), has_bias=st.booleans(),
       activation=st.sampled_from(ACTS), out=st.sampled_from(OUTS), x_sorted=st.booleans(), n_empty=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_grouped_weight_only_linear_matches_reference(tokens, experts, top_k, k, n, x_dtype, w_kind, has_bias,
                                                      activation, out, x_sorted, n_empty, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k = min(top_k, experts)
    ids = random_topk(gen, tokens, experts, top_k, empty=tuple(range(min(n_empty, experts - top_k))))
    r = moe_route(ids, experts)
    n_w = 2 * n if activation in R.GATED else n
    w_q, ws = _weights(gen, experts, n_w, k, w_kind)
    bias = torch.randn(experts, n_w, generator=gen) if has_bias else None
    x = (torch.randn(tokens * top_k if x_sorted else tokens, k, generator=gen) * 2).to(x_dtype)
    combine = isinstance(out, str)
    out_dtype = torch.float32 if combine else out
    kw = dict(x_sorted=x_sorted, bias=bias, activation=activation, out_dtype=out_dtype,
              topk_weights=torch.rand(tokens, top_k, generator=gen) if combine else None)
    with use_backend("triton-interpret"):
        got = TGW.fp8_grouped_weight_only_linear(x, w_q, ws, r, deterministic=out == "scatter-det", config=SMALL, **kw)
    x_mma = x.bfloat16() if x_dtype == torch.float32 else x  # what the kernel multiplies (documented)
    _check(got, RG.fp8_grouped_weight_only_linear(x_mma, w_q, ws, r, **kw), out_dtype)


def test_entry_point_runs_the_kernel_on_the_triton_backend_and_counts_the_ordered_combine():
    gen = torch.Generator().manual_seed(3)
    ids = random_topk(gen, 6, 4, 3)
    r = moe_route(ids, 4)
    w_q, ws = _weights(gen, 4, 24, 32, "channel")
    x, topk = torch.randn(6, 32, generator=gen).bfloat16(), torch.rand(6, 3, generator=gen)
    with use_backend("triton-interpret"), K.count_launches() as counts:
        got = K.fp8_grouped_weight_only_linear(x, w_q, ws, r, topk_weights=topk, deterministic=True)
    assert counts == {"fp8_grouped_weight_only_linear": 1, "moe_sum": 1}
    _check(got, RG.fp8_grouped_weight_only_linear(x, w_q, ws, r, topk_weights=topk), torch.float32)


def test_rejections_name_the_op_and_the_tensor():
    r = moe_route(torch.tensor([[0], [1]]), 2)
    w_q = torch.zeros(2, 8, 16, dtype=torch.float8_e4m3fn)
    with use_backend("triton-interpret"):
        with pytest.raises(TypeError, match="fp8_grouped_weight_only_linear: w_q must be float8_e4m3fn"):
            TGW.fp8_grouped_weight_only_linear(torch.zeros(2, 16), w_q.to(torch.float8_e5m2), torch.ones(2), r)
        with pytest.raises(TypeError, match="fp8_grouped_weight_only_linear: x must be"):
            TGW.fp8_grouped_weight_only_linear(torch.zeros(2, 16, dtype=torch.float64), w_q, torch.ones(2), r)
        with pytest.raises(ValueError, match="fp8_grouped_weight_only_linear: bias must be"):
            TGW.fp8_grouped_weight_only_linear(torch.zeros(2, 16), w_q, torch.ones(2), r, bias=torch.zeros(8))
        empty = TGW.fp8_grouped_weight_only_linear(torch.zeros(0, 16), w_q, torch.ones(2),
                                                   moe_route(torch.zeros(0, 1, dtype=torch.long), 2))
    assert empty.shape == (0, 8)


# ---------------------------------------------------------------------------------------------------
# AOT: the table lists what the wrapper launches; sm_80 compiles to bf16 MMA without spills


def test_aot_configs_cover_wrapper_launches(monkeypatch):
    rec = _Recorder(TGW.GROUPED_WEIGHT_ONLY_KERNEL)
    monkeypatch.setattr(TGW, "GROUPED_WEIGHT_ONLY_KERNEL", rec)
    monkeypatch.setattr(TGW, "on_interpreter", lambda: False)  # launch as on a GPU: bf16 tiles into the MMA
    gen = torch.Generator().manual_seed(5)
    with use_backend("triton-interpret"):
        for tokens, dtype, act, kind in [(1, torch.bfloat16, "swiglu", torch.bfloat16),
                                         (40, torch.float16, "gelu", "scatter-det"),
                                         (300, torch.float32, None, "scatter")]:
            r = moe_route(random_topk(gen, tokens, 8, 2), 8)
            n_w = 512 if act == "swiglu" else 256
            w_q, ws = _weights(gen, 8, n_w, 384, "channel" if tokens != 40 else "expert")
            combine = isinstance(kind, str)
            TGW.fp8_grouped_weight_only_linear(
                torch.randn(tokens * 2 if combine else tokens, 384).to(dtype), w_q, ws, r, x_sorted=combine,
                bias=torch.randn(8, n_w), activation=act, out_dtype=torch.float32 if combine else kind,
                topk_weights=torch.rand(tokens, 2) if combine else None, deterministic=kind == "scatter-det")
    table = [(e[2], e[3], e[4]) for e in TGW.AOT_CONFIGS]
    assert len(rec.launches) == 3
    for args, kwargs in rec.launches:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        sig, consts = _jit_signature(rec.kernel, args, kwargs)
        assert (rec.kernel, sig, consts) in table, f"launch not in AOT_CONFIGS: {sig} {consts}"


def test_aot_rows_are_unique_and_for_ampere_only():
    keys = [(e[0], tuple(sorted(e[3].items())), tuple(sorted((k, str(v)) for k, v in e[4].items())))
            for e in TGW.AOT_CONFIGS]
    assert len(set(keys)) == len(keys) and len({e[1] for e in TGW.AOT_CONFIGS}) == len(keys)
    rows = aot.all_configs("grouped_weight_only")
    assert rows and aot.for_arch(rows, 80) == rows and aot.for_arch(rows, 90) == []


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [r"large-gated .* x=bf16 act=swiglu bias=1 rows=gathered out=bf16",
                                     r"decode .* x=fp16 act=None bias=0 rows=sorted out=scatter_add"])
def test_moe_block_variants_compile_to_bf16_mma_without_spills_on_sm_80(pattern):
    entry = next(e for e in TGW.AOT_CONFIGS if re.fullmatch(pattern, e[1]))
    src = triton.compiler.ASTSource(fn=entry[2].jit, signature=entry[3], constexprs=entry[4],
                                    attrs=TGW.aot_attrs(entry))
    ptx = triton.compile(src, target=GPUTarget("cuda", 80, 32), options=TGW.aot_options(entry)).asm["ptx"]
    assert re.search(r"mma\.sync[^\n;]*\.(bf16\.bf16|f16\.f16)", ptx) and aot.fp8_mma_count(ptx, 80) > 0
    assert not re.search(r"\be4m3\b|cvt[^\n;]*e4m3", ptx)  # decoded by integer moves: no FP8 conversion on sm_80
    assert aot.ptxas_stats(ptx, 80)[1] == 0  # spill bytes
