"""``dbr_quant.inspect`` on a small Mixtral (tests/test_moe.py): each 3-D expert tensor (``….experts.gate_up_proj``,
``….experts.down_proj``) is a layer of kind ``experts`` — selectable in YAML, with its own statistics and its
own sensitivity. Independent references: the converted model's fused FP8 MoE block (eager, outside any
session), ``dbr_quant.disabled()``, and the tensors entering the experts module captured by a forward hook."""

from __future__ import annotations

import pytest
import torch
from test_moe import EXAMPLE, EXPERTS_N, HIDDEN, LAYERS, TOP_K, batches, build, logits  # tests/ on sys.path

import dbr_quant as dq
import dbr_quant.inspect as dqi
from dbr_quant.inspect.config import InspectConfigError
from dbr_quant.inspect.sensitivity import layer_flops

EXPERT_LAYERS = [f"model.layers.{i}.mlp.experts.{p}" for i in range(LAYERS) for p in ("gate_up_proj", "down_proj")]


def _fn(model, batch):
    return logits(model(**batch))


@pytest.fixture(scope="module")
def mixtral():
    with torch.random.fork_rng():
        model = build("mixtral", "grouped_mm")
        prepared = dq.prepare(model, example_kwargs=batches(1, EXAMPLE, 1)[0])
        dq.calibrate(prepared, batches(2, (2, 16), 2), progress=False)
    return prepared, batches(2, (2, 12), 7)


def test_each_expert_tensor_has_its_own_sensitivity(mixtral):
    prepared, ev = mixtral
    sens = {s.layer: s for s in dqi.sensitivity(prepared, ev, output_fn=_fn)}
    assert sorted(n for n, s in sens.items() if s.kind == "experts") == sorted(EXPERT_LAYERS)
    for name in EXPERT_LAYERS:  # only this tensor in FP8: a small, measurable error
        assert 20 < sens[name].sqnr_db < 80 and 0.99 < sens[name].cosine < 1.0, sens[name]
    values = {round(sens[n].sqnr_db, 6) for n in EXPERT_LAYERS}
    assert len(values) == len(EXPERT_LAYERS), "each expert tensor measured on its own"
    rows = EXAMPLE[0] * EXAMPLE[1] * TOP_K  # traced: 2 tokens, top-2 → 4 routed rows per experts call
    for i in range(LAYERS):  # [E, 2I, H] = [8, 128, 32] and [E, H, I] = [8, 32, 64]
        assert sens[f"model.layers.{i}.mlp.experts.gate_up_proj"].flops == 2 * rows * 128 * HIDDEN
        assert sens[f"model.layers.{i}.mlp.experts.down_proj"].flops == 2 * rows * HIDDEN * 64


def test_fp8_share_of_linear_flops_counts_the_experts(mixtral):
    """auto_fallback's "FP8 share of linear FLOPs" on an MoE model: the experts hold most of them. By hand at
    the traced shapes (2 tokens): every nn.Linear 2·T·in·out, the router (``F.linear`` on its [E, H] weight,
    high precision) 2·T·E·H, each expert tensor 2·T·top_k·N·K."""
    prepared, ev = mixtral
    model = build("mixtral", "grouped_mm")
    tokens = EXAMPLE[0] * EXAMPLE[1]
    linears = {n: 2 * tokens * m.in_features * m.out_features for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    assert not any(n.endswith("mlp.gate") for n in linears)
    router = LAYERS * 2 * tokens * EXPERTS_N * HIDDEN
    experts = LAYERS * 2 * tokens * TOP_K * (128 * HIDDEN + HIDDEN * 64)
    total = sum(linears.values()) + router + experts
    assert experts / total > 0.6  # ignoring them would misstate the share badly
    assert dqi.linear_flops(prepared) == total  # auto_fallback's max_high_precision_flops budget denominator
    assert dqi.fp8_flop_fraction(prepared) == pytest.approx((total - router) / total, rel=1e-12)
    assert dqi.fp8_flop_fraction(prepared, EXPERT_LAYERS) == pytest.approx((total - router - experts) / total,
                                                                           rel=1e-12)
    half = EXPERT_LAYERS[:2]  # layer 0's gate_up and down
    assert dqi.fp8_flop_fraction(prepared, half) == pytest.approx((total - router - experts / 2) / total, rel=1e-12)
    sens = [dqi.LayerSensitivity(n, "experts", 0.9, 10.0, 0) for n in EXPERT_LAYERS]  # a given ranking
    res = dqi.auto_fallback(prepared, ev[:1], target=-1.0, output_fn=_fn, full_curve=False, sensitivity=sens)
    assert res.fallback == () and res.fp8_flop_fraction == pytest.approx((total - router) / total, rel=1e-12)


def test_session_on_converted_matches_the_fused_block_and_logs_each_expert_tensor(mixtral):
    prepared, ev = mixtral
    converted = dq.convert(prepared)
    seen = {}
    hooks = [converted.get_submodule(f"model.layers.{i}.mlp.experts").register_forward_hook(
        lambda m, a, o, i=i: seen.__setitem__(i, a[0].detach())) for i in range(LAYERS)]
    cfg = """
experts:
  layers: {kind: experts}
  features:
    LogTensorStats: {tensors: [input, weight, output], stats: [amax]}
    LogFP8Stats: {tensors: [input], stats: [sqnr_db]}
"""
    with torch.no_grad():
        want = _fn(converted, ev[0])  # the fused FP8 MoE block (kernels.fp8_moe_block), no session
        with dqi.session(converted, cfg) as s:
            got = _fn(converted, ev[0])  # expert by expert through the inspector, each tensor in FP8
    for h in hooks:
        h.remove()
    assert torch.equal(got, want)  # measured bit-equal on the CPU reference kernels
    assert sorted(s.plan) == sorted(EXPERT_LAYERS)
    rec = {(r["layer"], r["tensor"], r["stat"]): r["value"] for r in s.records}
    for i in range(LAYERS):
        fqn = f"model.layers.{i}.mlp.experts"
        # gate_up's input: every routed row of the hidden states entering the experts (top-2 copies of tokens)
        assert rec[(f"{fqn}.gate_up_proj", "input", "amax")] == pytest.approx(seen[i].abs().max().item(), rel=1e-6)
        for p in ("gate_up_proj", "down_proj"):
            w = converted.get_submodule(fqn)._parameters[p]
            assert rec[(f"{fqn}.{p}", "weight", "amax")] == pytest.approx(w.dequantize().abs().max().item(), rel=1e-6)
            assert 15 < rec[(f"{fqn}.{p}", "input", "sqnr_db")] < 60


def test_expert_tensors_in_high_precision_equal_disabled(mixtral, close_to_reference):
    prepared, ev = mixtral
    cfg = "all:\n  layers: {name_regex: '.'}\n  features:\n    DisableFP8: {}\n"
    with torch.no_grad():
        with dq.disabled():
            want = _fn(prepared, ev[1])
        with dqi.session(prepared, cfg):
            got = _fn(prepared, ev[1])
        with dqi.session(prepared, "e:\n  layers: {kind: experts}\n  features:\n    FakeQuant: {}\n"):
            fake = _fn(prepared, ev[1])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)  # expert by expert vs the model's grouped_mm
    assert not torch.allclose(fake, want, rtol=1e-5, atol=1e-6)  # fake-quantized experts do change it
    close_to_reference(fake, want, min_cos=0.99, max_rel=0.09)  # measured 0.056


def test_scaling_an_expert_tensor_is_a_clear_error(mixtral):
    prepared, ev = mixtral
    cfg = "s:\n  layers: {kind: experts}\n  features:\n    Scaling: {input_format: E5M2}\n"
    with pytest.raises(NotImplementedError, match="expert tensor"), torch.no_grad(), dqi.session(prepared, cfg):
        _fn(prepared, ev[0])
    with pytest.raises(InspectConfigError, match="kind must be"):
        dqi.session(prepared, "s:\n  layers: {kind: expert}\n  features:\n    DisableFP8: {}\n").__enter__()



@pytest.mark.parametrize("style", ["gated", "switch"])
def test_module_list_experts_share_their_traced_flops_evenly(style):
    """The 2-token example reaches ≤ 4 of 8 ModuleList experts per layer; the others' records are copies. Each
    expert linear gets 1/8 of what the trace routed to its layer's experts (tokens × top_k rows, by hand), not
    a copy of a reached sibling's FLOPs (that counted 2.25× / 6× the routed FLOPs)."""
    model = build(style)
    prepared = dq.prepare(model, example_kwargs=batches(1, EXAMPLE, 1)[0])
    rows = EXAMPLE[0] * EXAMPLE[1] * (TOP_K if style == "gated" else 1)  # routed (token, slot) pairs per layer
    flops = layer_flops(prepared)
    expert = next(iter(model.moes[0].experts.children()))
    per_row = {rel: 2 * m.in_features * m.out_features for rel, m in expert.named_modules()
               if isinstance(m, torch.nn.Linear)}
    for i in range(LAYERS):
        for name in model.moes[i].experts._modules:
            for rel, f in per_row.items():
                assert flops[f"moes.{i}.experts.{name}.{rel}"] == rows * f // EXPERTS_N, (i, name, rel)
    others = sum(2 * EXAMPLE[0] * EXAMPLE[1] * m.in_features * m.out_features for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and ".experts." not in n)  # routers and head
    experts_per_layer = rows * sum(per_row.values())
    total = others + LAYERS * experts_per_layer
    assert sum(flops.values()) == total == dqi.linear_flops(prepared)
    layer0 = [n for n in flops if n.startswith("moes.0.experts.")]
    assert dqi.fp8_flop_fraction(prepared, layer0) == pytest.approx(1 - experts_per_layer / total, rel=1e-12)


@pytest.mark.parametrize("qconfig", [dq.QConfig.mxfp8(), dq.QConfig.fp8_weight_only()], ids=["mxfp8", "weight_only"])
def test_session_matches_convert_under_mx_and_weight_only(qconfig):
    """Every layer logged (attention linears, experts, lm_head): the same bits as the converted model, prepared or
    converted. MX expert tensors take E8M0 codes on both operands; weight-only experts read their input as it is
    (moe/compute.py), so it has no FP8 stats, like a weight-only linear's."""
    with torch.random.fork_rng():
        prepared = dq.prepare(build("mixtral", "grouped_mm"), example_kwargs=batches(1, EXAMPLE, 1)[0],
                              qconfig=qconfig)
    batch = batches(1, (2, 12), 7)[0]
    converted = dq.convert(prepared)
    cfg = "all:\n  layers: {name_regex: '.'}\n  features:\n    LogFP8Stats: {stats: [sqnr_db]}\n"
    with torch.no_grad():
        want = _fn(converted, batch)
        for model in (converted, prepared):
            with dqi.session(model, cfg) as s:
                got = _fn(model, batch)
            assert torch.equal(got, want)
    logged = {(r["layer"], r["tensor"]) for r in s.records}
    for layer in (EXPERT_LAYERS[0], "model.layers.0.self_attn.q_proj"):
        assert ((layer, "input") in logged) == (qconfig.weight.granularity == "mx"), layer
    assert (EXPERT_LAYERS[0], "weight") in logged
