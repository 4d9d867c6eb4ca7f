"""The Hub's ``fp8``, ``fbgemm_fp8`` and ModelOpt folders (built to the published layout: ``published_folders.py``)
loaded by ``load_pretrained``, compared with an independent plain-torch model of the folder (dequantized weights,
fake-quantized inputs): the same distance to the high-precision model (mean cosine of the logits within 0.0005)
and agreement above it. Measured on the random fp32 Llama (hidden 128; `pytest -s` prints them): distances
0.99939–0.99941 for both, differences ≤ 1.1e-5, agreement 0.99986–0.99991; ModelOpt with k/v scales (dbr_quant's
FP8 attention; the reference keeps attention in high precision) 0.99919 vs 0.99940, agreement 0.99952."""

from __future__ import annotations

import copy

import pytest
import torch
from ckpt_models import ids, llama
from published_folders import FORMATS, published_folder, reference
from safetensors.torch import load_file
from test_compressed_tensors import TINY, compare

import dbr_quant as dq
from dbr_quant.quantize.weights import fp8_weight_of


@pytest.fixture(scope="module")
def tiny_llama():
    return llama(**TINY).float()


def calibration() -> list[dict]:
    return [{"input_ids": ids(4, 32, s)} for s in (2, 3)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_published_layout_loads_and_matches_the_plain_torch_model(tiny_llama, tmp_path, fmt):
    folder = tmp_path / fmt
    published_folder(tiny_llama, folder, fmt, calibration())
    before = copy.deepcopy(tiny_llama.state_dict())
    loaded = dq.load_pretrained(folder, tiny_llama)
    assert all(torch.equal(v, tiny_llama.state_dict()[k]) for k, v in before.items())
    stored = load_file(folder / "model.safetensors")
    fp8 = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 14 and fp8_weight_of(loaded.lm_head) is None
    for name in fp8:
        w = fp8_weight_of(loaded.get_submodule(name.removesuffix(".weight")))
        assert w is not None and torch.equal(w.qdata.view(torch.uint8), stored[name].view(torch.uint8)), name
    record = loaded.__dict__["_dbr_record"]
    sdpa = [(st, op) for st in record.states for op in st.seen_ops if op.kind == "sdpa"]
    assert all(op.quantize == (fmt == "modelopt-kv") for _, op in sdpa)
    for st, op in sdpa if fmt == "modelopt-kv" else []:
        assert torch.equal(st.scale(op, "k").reshape(()), stored[f"{st.fqn}.k_proj.k_scale"]), st.fqn
    inputs = {"input_ids": ids(4, 32, 5)}
    with torch.no_grad():
        compare(loaded(**inputs).logits, reference(tiny_llama, folder)(**inputs).logits,
                tiny_llama(**inputs).logits, fmt, "plain torch")
