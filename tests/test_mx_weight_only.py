"""MXFP8 (``QConfig.mxfp8()``) and weight-only FP8 (``QConfig.fp8_weight_only()``) end to end: prepare → calibrate →
convert → the kernels, on dimensions that are not multiples of 32.

Expected values come from outside the code under test: MX scale codes from ``torch.log2`` of each 32-block's amax
(OCP floor rule), the weight-only model against the fp32 model whose weights are the dequantized FP8 weights (the
activations are exact there, so only fp32 rounding separates them), fused paths against ``fuse=False``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

# the block-granularity tests' model and sizes (ragged against 32-wide MX blocks too)
from test_block_granularity import HIDDEN, Block, D
from torch import nn

import dbr_quant as dq
from dbr_quant.quantize.weights import FP8Weight, adjacent_rows

LINEARS = ("fc1", "fc2", "gate", "up", "down", "head")


def _model(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    m = Block().eval()
    with torch.no_grad():
        m.fc1.weight.mul_(torch.exp(torch.randn(1, D)))
    return m


def _x(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, D, generator=g) * 2


def _convert(m: nn.Module, qc: dq.QConfig) -> nn.Module:
    p = dq.prepare(m, (_x(2, 5),), qc)
    return dq.convert(p)


def log2_codes(w: torch.Tensor) -> torch.Tensor:
    """OCP floor rule with torch.log2 (exact for these normal fp32 amaxes): floor(log2(amax)) - 8 + 127 per block."""
    n, k = w.shape
    kb = math.ceil(k / 32)
    a = F.pad(w.abs(), (0, kb * 32 - k)).reshape(n, kb, 32).amax(-1)
    return (torch.floor(torch.log2(a)) - 8 + 127).to(torch.uint8)


# ----------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs, match", [
    (dict(weight=dq.TensorQConfig(granularity="mx"), dynamic=True), "MX scales go on both GEMM operands"),
    (dict(activation=dq.TensorQConfig(granularity="mx"), dynamic=True), "MX scales go on both GEMM operands"),
    (dict(weight=dq.TensorQConfig(granularity="mx"), activation=dq.TensorQConfig(granularity="mx")),
     "computed at run time: set dynamic=True"),
    (dict(weight=dq.TensorQConfig(granularity="block"), weight_only=True), "per-channel or per-tensor weights"),
    (dict(weight_only=True, quantize_attention=True), "choose one"),
])
def test_invalid_combinations_are_refused_with_a_reason(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dq.QConfig(**kwargs)


def test_presets():
    mx = dq.QConfig.mxfp8()
    assert (mx.weight.granularity, mx.activation.granularity, mx.dynamic) == ("mx", "mx", True)
    assert dq.QConfig.mxfp8(scale_rounding="ceil").activation.mx_scale_rounding == "ceil"
    with pytest.raises(ValueError, match="mx_scale_rounding must be 'floor' or 'ceil'"):
        dq.TensorQConfig(granularity="mx", mx_scale_rounding="nearest")
    with pytest.raises(ValueError, match="observer MSE is not supported"):
        dq.TensorQConfig(granularity="mx", observer=dq.MSE())
    with pytest.raises(ValueError, match="weight_rounding='gptq' supports per-channel"):
        dq.QConfig.mxfp8(weight_rounding="gptq")
    wo = dq.QConfig.fp8_weight_only()
    assert wo.weight_only and wo.dynamic and wo.weight.granularity == "channel"
    assert dq.QConfig(weight_only=True).dynamic  # nothing to calibrate
    assert dq.QConfig.fp8_weight_only("tensor").for_op("fc1", ()).weight_only
    over = dq.QConfig.fp8_weight_only(overrides=(dq.Override(pattern="fc1", dynamic=False),))
    assert over.for_op("fc1", ()).dynamic  # weight-only ops never observe their input


# ----------------------------------------------------------------------------------------- MXFP8
def test_mx_convert_stores_e8m0_weights_and_runs_the_mx_kernels(close_to_reference):
    m = _model()
    c = _convert(m, dq.QConfig.mxfp8())
    for name in LINEARS:
        w, orig = getattr(c, name).weight, getattr(m, name).weight.detach()
        n, k = orig.shape
        assert isinstance(w, FP8Weight) and w.block == (1, 32) and w.scale.dtype == torch.uint8
        assert w.scale.shape == (n, math.ceil(k / 32)) and torch.equal(w.scale, log2_codes(orig))
        per_elem = torch.exp2(w.scale.double() - 127).repeat_interleave(32, 1)[:, :k]
        assert torch.equal(w.dequantize().double(), w.qdata.double() * per_elem)
    assert adjacent_rows(c.gate.weight.qdata, c.up.weight.qdata) is not None  # [gate; up] stacked
    x = _x(4, 9)
    with dq.kernels.count_launches() as counts, torch.no_grad():
        out = c(x)
        ref = m(x)
    assert dict(counts) == {"fp8_mx_linear": 5, "mx_quantize": 5}  # [gate|up] one GEMM
    close_to_reference(out, ref, min_cos=0.999, max_rel=0.08)
    single = _convert(m, dq.QConfig.mxfp8(fuse=False))
    with torch.no_grad():
        assert torch.equal(out, single(x))


def test_mx_ceil_rounding_reaches_weights_and_activations():
    m = _model()
    c = _convert(m, dq.QConfig.mxfp8(scale_rounding="ceil"))
    orig = m.fc1.weight.detach()
    floor = log2_codes(orig)
    amax = F.pad(orig.abs(), (0, 32 * 7 - D)).reshape(HIDDEN, 7, 32).amax(-1)
    want = floor + (amax > 448 * torch.exp2(floor.float() - 127)).to(torch.uint8)
    assert torch.equal(c.fc1.weight.scale, want) and not torch.equal(want, floor)
    x = _x(2, 3)
    with dq.kernels.count_launches() as counts, torch.no_grad():
        out = c(x)
    assert counts["mx_quantize"] == 5
    x_q, x_s = dq.kernels.mx_quantize(m.norm1(x), round_up=True)  # fc1's input, as the run quantizes it
    floor_x = dq.kernels.mx_quantize(m.norm1(x))[1]
    assert not torch.equal(x_s, floor_x)  # the activations took the ceil rule too (some block rounds up)
    with torch.no_grad():
        torch.testing.assert_close(out, _convert(m, dq.QConfig.mxfp8(scale_rounding="ceil", fuse=False))(x),
                                   rtol=0, atol=0)


def test_mx_state_dict_holds_uint8_weight_scale_and_loads_back():
    m = _model()
    c = _convert(m, dq.QConfig.mxfp8())
    sd = c.state_dict()
    assert sd["fc1.weight_scale"].dtype == torch.uint8 and sd["fc1.weight_scale"].shape == (HIDDEN, 7)
    c2 = _convert(_model(seed=3), dq.QConfig.mxfp8())
    c2.load_state_dict(sd)
    x = _x(2, 3)
    with torch.no_grad():
        assert torch.equal(c2(x), c(x))


def test_mx_weight_edit_requantizes_with_mx_scales():
    c = _convert(_model(), dq.QConfig.mxfp8())
    w = c.fc2.weight
    with torch.no_grad():
        w.mul_(4.0)  # powers of two move every code by 2, the FP8 bytes stay
    orig = _model().fc2.weight.detach()
    assert torch.equal(w.scale, log2_codes(orig * 4.0))


# ----------------------------------------------------------------------------------------- weight-only
def test_weight_only_is_the_model_with_dequantized_weights(close_to_reference):
    m = _model()
    c = _convert(m, dq.QConfig.fp8_weight_only())
    dequantized = _model()
    with torch.no_grad():
        for name in LINEARS:
            w = getattr(c, name).weight
            assert isinstance(w, FP8Weight) and w.block is None and w.scale.shape == (getattr(m, name).out_features,)
            getattr(dequantized, name).weight.copy_(w.dequantize())
    x = _x(3, 7)
    with dq.kernels.count_launches() as counts, torch.no_grad():
        out = c(x)
    assert dict(counts) == {"fp8_weight_only_linear": 5}  # no activation quantized; [gate|up] one GEMM
    with torch.no_grad():
        torch.testing.assert_close(out, dequantized(x), rtol=1e-4, atol=1e-4)
        close_to_reference(out, m(x), min_cos=0.9995, max_rel=0.04)
        single = _convert(m, dq.QConfig.fp8_weight_only(fuse=False))
        torch.testing.assert_close(single(x), out, rtol=1e-5, atol=1e-5)


def test_weight_only_per_tensor_in_bf16():
    m = _model().to(torch.bfloat16)
    c = dq.convert(dq.prepare(m, (_x(2, 5).bfloat16(),), dq.QConfig.fp8_weight_only("tensor")))
    assert c.fc1.weight.scale.dim() == 0
    x = _x(2, 3).bfloat16()
    with torch.no_grad():
        out = c(x)
        ref = m(x)
    assert out.dtype == torch.bfloat16
    assert F.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0) > 0.999


@pytest.mark.parametrize("qconfig, op", [(dq.QConfig.mxfp8(), "fp8_mx_linear"),
                                         (dq.QConfig.fp8_weight_only(), "fp8_weight_only_linear")])
def test_rewritten_graph_runs_the_ops_and_equals_eager(qconfig, op):
    from dbr_quant.fx_rewriter import rewrite

    c = _convert(_model(), qconfig)
    g = rewrite(c)
    ops = [n.target._name for n in g.graph.nodes if n.op == "call_function" and hasattr(n.target, "_name")
           and n.target._name.startswith("dbr_quant::")]
    assert ops.count(f"dbr_quant::{op}") == 5 and "dbr_quant::fp8_linear" not in ops
    with torch.no_grad():
        for x in (_x(2, 5), _x(3, 8, seed=7)):  # the traced shape and another
            assert torch.equal(g(x), c(x))


def test_moe_experts_under_both_schemes():
    """Mixtral experts (3-D FP8 weights) run the scheme asked for (tests/test_moe_schemes.py checks the numbers):
    MX experts hold E8M0 codes per 1×32 block, weight-only experts FP8 weights and no activation quantization;
    convert does not warn. Measured logits cosine: 0.9968 (MX), 0.9981 (weight-only; W8A8 dynamic: 0.9976)."""
    import warnings

    from test_moe import _mixtral

    torch.manual_seed(0)
    m = _mixtral("eager").eval()
    ids = torch.randint(1, 128, (2, 8))
    with torch.no_grad():
        ref = m(ids).logits
    for qc in (dq.QConfig.mxfp8(), dq.QConfig.fp8_weight_only()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c = dq.convert(dq.prepare(m, (ids[:1, :2],), qc))
        rows = [r for r in dq.report(c) if r["module"] == "model.layers.0.mlp.experts" and r["fp8"]]
        assert len(rows) == 2 and not any("no grouped MoE kernel" in r["reason"] for r in rows)
        with torch.no_grad():
            out = c(ids).logits
        assert F.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.99, qc
        experts = c.model.layers[0].mlp.experts
        w = next(p for p in experts.parameters() if isinstance(p, FP8Weight))
        if qc.weight.granularity == "mx":
            assert w.block == (1, 32) and w.scale.dtype == torch.uint8
        else:
            assert w.block is None and w.scale.dtype == torch.float32


# ----------------------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_minilm_end_to_end_on_cpu():
    """all-MiniLM-L6-v2, held-out sentences: embedding cosine to fp32 (measured: MXFP8 mean 0.9953 / min 0.9904,
    weight-only 0.9986 / 0.9981)."""
    from dbr_quant.examples.minilm import (
        CALIBRATION_SENTENCES,
        EVAL_SENTENCES,
        encode,
        load_minilm,
        sentence_embeddings,
    )

    model, tok = load_minilm()
    batch = encode(tok, EVAL_SENTENCES[:32])
    ref = sentence_embeddings(model, batch)
    example = encode(tok, CALIBRATION_SENTENCES[:4])
    for qc, min_mean, min_min in ((dq.QConfig.mxfp8(), 0.993, 0.985), (dq.QConfig.fp8_weight_only(), 0.998, 0.997)):
        c = dq.convert(dq.prepare(model, example_kwargs=example, qconfig=qc))
        cos = (sentence_embeddings(c, batch) * ref).sum(-1)
        assert cos.mean() > min_mean and cos.min() > min_min, (qc, cos.mean(), cos.min())
