"""compressed-tensors folders written by compressed-tensors itself (``ct_folders.py``: its presets FP8, FP8_DYNAMIC,
FP8_BLOCK and a per-channel static scheme, with and without a ``kv_cache_scheme``) loaded by ``load_pretrained``
into a model running dbr_quant's kernels, compared with transformers loading the same folder
(``from_pretrained``: compressed-tensors decompresses on CPU and fake-quantizes the inputs and k/v).

Figures: mean cosine over tokens of the logits (the real MiniLM: of the sentence embeddings) against the
high-precision model — ``distance`` for each loader — and between the two loaders (``agreement``). Asserted:
the two distances within 0.0005, and the loaders agree with each other more closely than either agrees with
the high-precision model (the FP8 noise floor: they differ only by rounding, not by what they quantize).
Measured on a random fp32 Llama (hidden 128, 2 layers; `pytest -s` prints them): distances 0.99939–0.99940
for both loaders in every scheme without kv (differences ≤ 1.2e-5), agreement 0.99988–0.99992; with the
kv_cache_scheme (dbr_quant's FP8 attention also rounds q with vLLM's 1.0 and the probabilities, transformers
only k and v) distances 0.99919–0.99922 / 0.99928–0.99929, agreement 0.99965. The real MiniLM (sentence
embeddings): FP8 0.99767 / 0.99766 (agreement 0.99886), FP8_DYNAMIC 0.99778 / 0.99777 (0.99890), FP8_BLOCK
0.99779 / 0.99788 (0.99903).
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from ckpt_models import ids, llama
from ct_folders import ct_folder
from safetensors.torch import load_file

import dbr_quant as dq
from dbr_quant.quantize.weights import fp8_weight_of

pytest.importorskip("compressed_tensors")

TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
GRANULARITY = {"FP8": "tensor", "FP8_DYNAMIC": "channel", "FP8_BLOCK": "block", "FP8_CHANNEL_STATIC": "channel"}


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten(0, -2).float(), b.flatten(0, -2).float(), dim=-1).mean().item()


def compare(ours: torch.Tensor, theirs: torch.Tensor, hp: torch.Tensor, label: str,
            other: str = "transformers") -> None:
    d_ours, d_theirs, agree = mean_cosine(ours, hp), mean_cosine(theirs, hp), mean_cosine(ours, theirs)
    print(f"{label}: distance to high precision dbr_quant {d_ours:.6f} {other} {d_theirs:.6f}; "
          f"agreement {agree:.6f}")
    assert abs(d_ours - d_theirs) <= 5e-4
    assert agree > max(d_ours, d_theirs)


@pytest.fixture(scope="module")
def tiny_llama():
    return llama(**TINY).float()


def _check_tensors(loaded, folder) -> int:
    """Every FP8 weight of the file is an FP8 weight of the loaded model with the file's bytes and scale."""
    stored = load_file(folder / "model.safetensors")
    n = 0
    for name, t in stored.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        w = fp8_weight_of(loaded.get_submodule(name.removesuffix(".weight")))
        assert w is not None and torch.equal(w.qdata.view(torch.uint8), t.view(torch.uint8)), name
        s = stored[name + "_scale"].float()  # a per-tensor scale is expanded per row when gate/up are stacked
        assert torch.equal(w.scale.flatten(), s.flatten().expand(w.scale.numel()) if s.numel() == 1 else s.flatten())
        n += 1
    return n


@pytest.mark.parametrize("scheme, kv", [("FP8", False), ("FP8_DYNAMIC", False), ("FP8_BLOCK", False),
                                        ("FP8_CHANNEL_STATIC", False), ("FP8", True), ("FP8_DYNAMIC", True)])
def test_compressed_tensors_folder_matches_transformers(tiny_llama, tmp_path, scheme, kv):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / scheme
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct_folder(copy.deepcopy(tiny_llama), folder, scheme, ["lm_head"],
                  [{"input_ids": ids(4, 32, s)} for s in (2, 3)], kv_cache=kv)
        theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (qc["kv_cache_scheme"] is not None) == kv and not (folder / "dbr_quant.json").exists()
    before = copy.deepcopy(tiny_llama.state_dict())
    loaded = dq.load_pretrained(folder, tiny_llama)
    assert all(torch.equal(v, tiny_llama.state_dict()[k]) for k, v in before.items())  # the model is untouched
    assert _check_tensors(loaded, folder) == 14 and fp8_weight_of(loaded.lm_head) is None
    record = loaded.__dict__["_dbr_record"]
    ops = [op for st in record.states for op in st.seen_ops]
    linears = [op for op in ops if op.kind == "linear" and op.quantize]
    assert {op.qconfig.weight.granularity for op in linears} == {GRANULARITY[scheme]}
    assert {op.qconfig.dynamic for op in linears} == {scheme in ("FP8_DYNAMIC", "FP8_BLOCK")}
    sdpa = [(st, op) for st in record.states for op in st.seen_ops if op.kind == "sdpa"]
    assert all(op.quantize == kv for _, op in sdpa) and len(sdpa) == 2
    if kv:
        stored = load_file(folder / "model.safetensors")
        for st, op in sdpa:
            assert torch.equal(st.scale(op, "k").reshape(1), stored[f"{st.fqn}.k_scale"].float()), st.fqn
            assert torch.equal(st.scale(op, "v").reshape(1), stored[f"{st.fqn}.v_scale"].float()), st.fqn
    inputs = {"input_ids": ids(4, 32, 5)}
    with torch.no_grad():
        compare(loaded(**inputs).logits, theirs(**inputs).logits, tiny_llama(**inputs).logits,
                f"{scheme}{' + kv_cache_scheme' if kv else ''}")


@pytest.mark.parametrize("scheme", ["FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_real_minilm_folder_matches_transformers(tmp_path, scheme):
    """all-MiniLM-L6-v2 (in_features 384 / 1536: whole 128-groups), its 8 calibration sentences; distances of the
    sentence embeddings."""
    from transformers import AutoModel

    from dbr_quant.examples import minilm

    model, tokenizer = minilm.load_minilm()
    calibration = minilm.encode(tokenizer, minilm.CALIBRATION_SENTENCES)
    evaluation = minilm.encode(tokenizer, minilm.EVAL_SENTENCES)
    folder = tmp_path / scheme
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct_folder(copy.deepcopy(model), folder, scheme, [], [calibration])
        theirs = AutoModel.from_pretrained(folder).eval()
    loaded = dq.load_pretrained(folder, model, example_kwargs=calibration)
    assert _check_tensors(loaded, folder) == 37  # 6 layers × (q, k, v, o, intermediate, output) + pooler
    with torch.no_grad():
        compare(minilm.sentence_embeddings(loaded, evaluation), minilm.sentence_embeddings(theirs, evaluation),
                minilm.sentence_embeddings(model, evaluation), f"MiniLM {scheme}")
