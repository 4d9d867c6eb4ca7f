"""Dense MoE experts in FP8: transformers' ``Llama4TextExperts`` runs every expert on every token
(``torch.bmm`` on hidden states [E·T, H] viewed [E, T, H], each expert's block pre-scaled by its router score,
zero where the router did not pick it). dbr_quant runs it as one FP8 MoE block whose routing sends row r to
expert r // T with weight 1, with one gate_up input scale per expert (dbr_quant/moe/experts.py), and keeps the
router (``Llama4Router``, an ``nn.Linear`` subclass) high precision. Tiny Llama 4, random weights.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as hf
from safetensors import safe_open
from test_moe_own_gate import _as_gemm_gives, _fp8, batches, no_warnings  # tests/ is on sys.path (conftest)
from torch import nn
from transformers.utils import logging as hf_logging

import dbr_quant as dq
from dbr_quant.moe.experts import EXPERTS, MoeState
from dbr_quant.moe.trace import ROUTER_REASON
from dbr_quant.quantize.weights import FP8Weight

hf_logging.set_verbosity_error()

HIDDEN, INTER, LAYERS, NUM_EXPERTS = 32, 48, 2, 4


def build() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return hf.Llama4ForCausalLM(hf.Llama4TextConfig(
            vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, intermediate_size_mlp=64,
            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_local_experts=NUM_EXPERTS, num_experts_per_tok=1, interleave_moe_layer_step=1,
            no_rope_layers=[1, 1], attention_chunk_size=64, max_position_embeddings=64, initializer_range=0.05,
            pad_token_id=0)).eval()


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "Llama4TextExperts"]


def convert(model: nn.Module, calibration_hook=None) -> nn.Module:
    prepared = dq.prepare(model, example_kwargs=batches(1, (1, 4), 1)[0])
    hooks = [m.register_forward_pre_hook(calibration_hook) for m in _experts_modules(prepared)] \
        if calibration_hook else []
    dq.calibrate(prepared, batches(8, (4, 16), 2), progress=False)  # 2 × 32 tokens clip layer 1's inputs: 0.126
    for h in hooks:
        h.remove()
    return dq.convert(prepared)


@pytest.fixture(scope="module")
def converted() -> tuple[nn.Module, nn.Module]:
    model = build()
    with no_warnings():  # no weight stays high precision but the routers (by design: no warning)
        return model, convert(model)


def _call(model: nn.Module, mod: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    seen: dict = {}
    handle = mod.register_forward_hook(lambda m, a, o: seen.update(x=a[0], out=o))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    return seen["x"], seen["out"]


def test_the_experts_are_fp8_with_per_expert_input_scales_and_the_router_high_precision(converted):
    _, conv = converted
    rows = dq.report(conv)
    experts = [r for r in rows if r["kind"] == EXPERTS]
    assert len(experts) == 2 * LAYERS and all(r["fp8"] and r["fusion"] == f"moe_block[{NUM_EXPERTS} experts]"
                                              for r in experts), experts
    routers = [r for r in rows if r["fqn"].endswith("feed_forward.router")]
    assert len(routers) == LAYERS and all(not r["fp8"] and r["reason"] == ROUTER_REASON for r in routers), routers
    bmm_rows = [r for r in rows if r["kind"] == "matmul" and ".experts" in r["fqn"]]
    assert not bmm_rows, "the experts' torch.bmm is no op of its own any more"
    for mod in _experts_modules(conv):
        st: MoeState = mod._auto_quant_state
        assert all(st.frozen_scale(op, "input").shape == (NUM_EXPERTS,) for op in st.seen_ops)
        assert all(type(mod._parameters[n]) is FP8Weight for n in ("gate_up_proj", "down_proj"))


# Measured 1.4e-7: fp32 arithmetic only (see the derivation of test_moe_own_gate.EXACT).
EXACT = 1e-5


def test_the_experts_call_equals_a_per_expert_fp64_emulation(converted):
    """Each expert's block of rows quantized with its own input scale, through its dequantized FP8 weights,
    ``up·silu(gate)``, quantized with its own down-input scale, through its down weights: the converted call."""
    model, conv = converted
    mod = _experts_modules(conv)[0]
    st = mod._auto_quant_state
    x, out = _call(conv, mod, batches(1, (3, 16), 7)[0])
    g, d = mod.gate_up_proj, mod.down_proj
    xs, hs = (st.frozen_scale(op, "input").double() for op in st.seen_ops)
    t = x.shape[0] // NUM_EXPERTS
    ref = torch.empty_like(x, dtype=torch.float64)
    for e in range(NUM_EXPERTS):
        rows = slice(e * t, (e + 1) * t)
        gu = _as_gemm_gives(_fp8(x[rows].double() / xs[e]) @ g.qdata[e].double().T, g.qdata[e], t) * xs[e] * \
            g.scale[e].double()
        gate, up = gu.chunk(2, dim=-1)
        h = up * torch.nn.functional.silu(gate)
        ref[rows] = _as_gemm_gives(_fp8(h / hs[e]) @ d.qdata[e].double().T, d.qdata[e], t) * hs[e] * \
            d.scale[e].double()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < EXACT, err
    with torch.no_grad():
        hp = _experts_modules(model)[0](x)
    assert ((hp.double() - ref).norm() / ref.norm()).item() > 0.01  # for scale: FP8 is a few % off fp32


def _zero_expert_0(module: nn.Module, args: tuple) -> tuple:
    x = args[0].clone()
    x[: x.shape[0] // NUM_EXPERTS] = 0  # as if the router picked expert 0 for no token
    return (x,)


def test_an_expert_without_calibration_rows_takes_the_max_scales_and_runs(close_to_reference):
    model = build()
    conv = convert(model, _zero_expert_0)
    for mod in _experts_modules(conv):
        st = mod._auto_quant_state
        assert st.fallback == [0]
        for op in st.seen_ops:
            s = st.frozen_scale(op, "input")
            assert s[0] == s[1:].max()
    rows = [r for r in dq.report(conv) if r["kind"] == EXPERTS]
    assert all(r["reason"].startswith("1/4 experts got no calibration tokens (0)") for r in rows), rows
    batch = batches(1, (4, 16), 9)[0]
    for mod, orig in zip(_experts_modules(conv), _experts_modules(model)):
        x, out = _call(conv, mod, batch)
        assert bool(x[: x.shape[0] // NUM_EXPERTS].ne(0).any())  # expert 0 has rows now
        with torch.no_grad():
            # measured (layers 0 / 1): relative error 0.0631 / 0.0765, cosine ≥ 0.99709 (calibrated on every
            # expert: 0.0631 / 0.0814; a per-call max-scaled fake quantization: 0.062 / 0.062)
            close_to_reference(out, orig(x), max_rel=0.115, min_cos=0.994)


def test_save_and_load_round_trip_bit_for_bit_with_per_expert_input_scales(converted, tmp_path):
    _, conv = converted
    with pytest.warns(UserWarning, match="vLLM"):
        dq.save_pretrained(conv, tmp_path)
    mod = _experts_modules(conv)[0]
    fqn = next(n for n, m in conv.named_modules() if m is mod)
    xs = mod._auto_quant_state.frozen_scale(mod._auto_quant_state.seen_ops[0], "input")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        for e in range(NUM_EXPERTS):
            for name, rows in (("gate_proj", slice(0, INTER)), ("up_proj", slice(INTER, 2 * INTER))):
                prefix = f"{fqn}.{e}.{name}"
                assert torch.equal(f.get_tensor(f"{prefix}.weight").view(torch.uint8),
                                   mod.gate_up_proj.qdata[e, rows].view(torch.uint8))
                assert f.get_tensor(f"{prefix}.input_scale").float().item() == xs[e].item()
    assert "interleaved" not in json.loads((tmp_path / "dbr_quant.json").read_text())["experts"][fqn]
    batch = batches(1, (2, 11), 4)[0]
    loaded = dq.load_pretrained(tmp_path, build(), example_kwargs=batches(1, (1, 4), 1)[0])
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, conv(**batch).logits)


def test_inspect_session_equals_the_converted_model_and_sensitivity_measures_the_experts(converted):
    """dq.inspect computes the experts call expert by expert with each expert's own gate_up input scale: an
    all-FP8 session gives the converted logits bit for bit; sensitivity on the prepared model (scales from the
    per-expert observers) measures both expert tensors of each layer."""
    import dbr_quant.inspect as dqi

    model, conv = converted
    b = batches(1, (3, 9), 7)[0]
    cfg = "experts:\n  layers: {kind: experts}\n  features:\n    LogFP8Stats: {tensors: [input], stats: [sqnr_db]}\n"
    with torch.no_grad():
        want = conv(**b).logits
        with dqi.session(conv, cfg) as s:
            got = conv(**b).logits
    assert torch.equal(got, want)
    assert len(s.records) == 2 * LAYERS and all(20 < r["value"] < 80 for r in s.records)  # measured 30.7 … 31.9 dB
    prepared = dq.prepare(model, example_kwargs=batches(1, (1, 4), 1)[0])
    dq.calibrate(prepared, batches(2, (2, 16), 2), progress=False)
    sens = [r for r in dqi.sensitivity(prepared, [b], output_fn=lambda m, x: m(**x).logits) if r.kind == EXPERTS]
    assert len(sens) == 2 * LAYERS and all(20 < r.sqnr_db < 80 for r in sens)  # measured 46.8 … 51.1 dB


def test_transformers_loads_the_saved_folder_to_the_same_logits(converted, tmp_path):
    """The per-expert folder ([gate; up] split in halves) is one transformers' compressed-tensors loader maps back
    onto Llama4TextExperts (no warning that it would not, as for GPT-OSS's interleaved experts)."""
    pytest.importorskip("compressed_tensors")
    _, conv = converted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dq.save_pretrained(conv, tmp_path)
    assert not any("from_pretrained" in str(w.message) for w in caught)
    batch = batches(1, (2, 11), 4)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = hf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ours, got = conv(**batch).logits, theirs(**batch).logits
    # measured: cosine 1 − 3e-15 (the same FP8 bytes and scales, their arithmetic order)
    assert torch.nn.functional.cosine_similarity(got.flatten().double(), ours.flatten().double(), 0) >= 0.99999
