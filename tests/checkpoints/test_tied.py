"""A linear tied to the token embedding (``lm_head.weight is embed_tokens.weight``) stays high precision by
default, as vLLM and llm-compressor keep it: the tie holds, memory does not grow, the report says why, and
the folder loads in transformers. ``Override(untie=True)`` quantizes it anyway and convert warns with the bytes."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from ckpt_models import gpt2, ids, llama
from transformers import AutoModelForCausalLM

import dbr_quant as dq
from dbr_quant.quantize.weights import FP8Weight, fp8_weight_of


def _run(model, qconfig=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = dq.prepare(model, example_kwargs={"input_ids": ids(2, 12, 1)}, qconfig=qconfig)
        dq.calibrate(prepared, [{"input_ids": ids(4, 32, s)} for s in (2, 3)], progress=False)
        converted = dq.convert(prepared)
    return converted, [str(w.message) for w in caught if str(w.message).startswith("dbr_quant")]


def _bytes(model) -> int:
    """Bytes of the model's parameters, each Parameter once (an FP8 weight: its data and scales)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        parts = (p.qdata, p.scale) if type(p) is FP8Weight else (p,)
        total += sum(t.numel() * t.element_size() for t in parts)
    return total


def _tied_llama():
    model = llama(tie_word_embeddings=True).float()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    return model


def test_tied_lm_head_stays_high_precision_and_tied(tmp_path):
    pytest.importorskip("compressed_tensors")
    model = _tied_llama()
    converted, caught = _run(model)
    assert caught == []  # a tie kept by design is reported, not warned about
    assert converted.lm_head.weight is converted.get_input_embeddings().weight
    assert fp8_weight_of(converted.lm_head) is None and fp8_weight_of(converted.model.layers[0].mlp.up_proj) is not None
    # memory: the fp32 model less, per other linear, fp32 weight → E4M3 bytes + one fp32 scale per row
    saved = sum(m.weight.numel() * 3 - m.out_features * 4 for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and n != "lm_head")
    assert _bytes(converted) == _bytes(model) - saved
    rows = {r["fqn"]: r for r in dq.report(converted)}
    assert not rows["lm_head"]["fp8"]
    why = rows["lm_head"]["reason"]
    assert why.startswith("tied to model.embed_tokens.weight: stays high precision so the tie holds")
    assert "Override(pattern=..., untie=True)" in why
    assert rows["model.embed_tokens"]["reason"].startswith("Embedding: a lookup table")

    dq.save_pretrained(converted, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "lm_head" in config["quantization_config"]["ignore"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    batch = {"input_ids": ids(2, 16, 5)}
    with torch.no_grad():
        ours, theirs, fp32 = converted(**batch).logits, loaded(**batch).logits, model(**batch).logits
    # transformers runs the FP8 model (closer to ours than FP8 is to fp32; the scale orders differ by ~1 ulp per
    # GEMM, which FP8 re-quantization turns into whole steps: test_transformers_load.py)
    assert (theirs - ours).norm() < 0.5 * (ours - fp32).norm()


def test_untie_override_quantizes_and_warns_with_bytes():
    model = _tied_llama()
    converted, caught = _run(model, dq.QConfig(overrides=(dq.Override(pattern="^lm_head$", untie=True),)))
    w = fp8_weight_of(converted.lm_head)
    assert w is not None and converted.lm_head.weight is not converted.get_input_embeddings().weight
    vocab, hidden = model.lm_head.weight.shape
    added = (vocab * hidden * 1 + vocab * 4) / 2**20  # E4M3 bytes + one fp32 scale per row
    kept = vocab * hidden * 4 / 2**20
    untied = [m for m in caught if "was tied to model.embed_tokens.weight" in m]
    assert len(untied) == 1, caught
    assert f"its FP8 copy adds {added:.2f} MiB beside the {kept:.2f} MiB high-precision model.embed_tokens.weight" \
        in untied[0]
    assert dq.report(converted)[-1]["fqn"] == "model.embed_tokens"


def test_untied_lm_head_is_still_fp8():
    model = llama().float()
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    converted, _ = _run(model)
    assert fp8_weight_of(converted.lm_head) is not None
    assert next(r for r in dq.report(converted) if r["fqn"] == "lm_head")["fp8"]


def test_gpt2_with_only_a_tied_head_and_conv1d_saves_a_plain_folder(tmp_path):
    """GPT-2: its only nn.Linear is the tied lm_head (kept high precision) and Conv1D layers have no
    compressed-tensors form: no layer is FP8 in the file, so config.json has no quantization_config (an empty one
    makes transformers' compressed-tensors loader fail), and the folder loads as a plain model."""
    model = gpt2()
    converted, _ = _run(model)
    assert converted.lm_head.weight is converted.transformer.wte.weight
    with pytest.warns(UserWarning, match="no layer has a compressed-tensors FP8 form"):
        dq.save_pretrained(converted, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    conv = converted.transformer.h[0].attn.c_attn
    assert torch.equal(loaded.transformer.h[0].attn.c_attn.weight, fp8_weight_of(conv).dequantize())


@pytest.mark.parametrize("untie", [False, True])
def test_load_pretrained_restores_the_tie_or_the_untied_fp8_head(tmp_path, untie):
    qconfig = dq.QConfig(overrides=(dq.Override(pattern="^lm_head$", untie=True),)) if untie else None
    converted, _ = _run(_tied_llama(), qconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # save_pretrained's notes on what loaders run differently
        dq.save_pretrained(converted, tmp_path)
        again = dq.load_pretrained(tmp_path, _tied_llama())
    assert (fp8_weight_of(again.lm_head) is not None) is untie
    assert (again.lm_head.weight is again.get_input_embeddings().weight) is not untie
    x = ids(2, 9, 3)
    with torch.no_grad():
        assert torch.equal(again(input_ids=x).logits, converted(input_ids=x).logits)
