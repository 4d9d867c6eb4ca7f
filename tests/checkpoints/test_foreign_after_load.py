"""A foreign FP8 folder (compressed-tensors FP8_DYNAMIC, the Hub's most common layout, written by compressed-tensors)
after loading: streamed from the folder alone (the architecture on the meta device), recalibrated to static input
scales and saved, inspected, rewritten and compiled; and bad folders refused naming the tensor or setting, the
model untouched."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from ckpt_models import LLAMA, ids
from ct_folders import ct_folder
from safetensors.torch import load_file, save_file
from test_compressed_tensors import TINY
from transformers import LlamaConfig, LlamaForCausalLM

import dbr_quant as dq
import dbr_quant.inspect as dqi
from dbr_quant.quantize.weights import fp8_weight_of

pytest.importorskip("compressed_tensors")
INPUTS = {"input_ids": ids(2, 16, 5)}


@pytest.fixture(scope="module")
def model():
    """Built in fp32 (not cast from bf16, which would leave bf16-rounded rotary tables that a model built from
    the folder's config.json does not have)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **TINY})).eval()


@pytest.fixture(scope="module")
def dynamic_folder(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8_dynamic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct_folder(copy.deepcopy(model), folder, "FP8_DYNAMIC", ["lm_head"], [{"input_ids": ids(4, 32, 2)}])
    return folder


def test_streamed_load_builds_the_architecture_from_the_folder(model, dynamic_folder):
    streamed = dq.load_pretrained(dynamic_folder)  # no model: built from config.json with meta parameters
    given = dq.load_pretrained(dynamic_folder, model)
    assert not any(p.is_meta for p in streamed.parameters())
    with torch.no_grad():
        assert torch.equal(streamed(**INPUTS).logits, given(**INPUTS).logits)


def test_recalibrate_turns_dynamic_into_static_and_saves(model, dynamic_folder, tmp_path):
    prepared = dq.load_pretrained(dynamic_folder, model, recalibrate=True)
    dq.calibrate(prepared, [{"input_ids": ids(4, 32, s)} for s in (2, 3)], progress=False)
    static = dq.convert(prepared)
    stored = load_file(dynamic_folder / "model.safetensors")
    record = static.__dict__["_dbr_record"]
    linears = [(st, op) for st in record.states for op in st.seen_ops if op.kind == "linear" and op.quantize]
    assert len(linears) == 14 and not any(op.qconfig.dynamic for _, op in linears)
    for _, op in linears:  # the weights are the file's bytes, untouched by convert
        w = fp8_weight_of(static.get_submodule(op.weight_owner))
        assert torch.equal(w.qdata.view(torch.uint8), stored[f"{op.weight_owner}.weight"].view(torch.uint8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dq.save_pretrained(static, tmp_path / "static")
    qc = json.loads((tmp_path / "static" / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["input_activations"]["dynamic"] is False and group["weights"]["strategy"] == "channel"
    back = dq.load_pretrained(tmp_path / "static", model)
    with torch.no_grad():
        dynamic_out = dq.load_pretrained(dynamic_folder, model)(**INPUTS).logits
        static_out, hp = static(**INPUTS).logits, model(**INPUTS).logits
        assert torch.equal(back(**INPUTS).logits, static_out)
    cos = torch.nn.functional.cosine_similarity
    assert cos(static_out.flatten(0, 1), hp.flatten(0, 1)).mean() > 0.999
    assert cos(static_out.flatten(0, 1), dynamic_out.flatten(0, 1)).mean() > 0.999


def test_inspect_and_compile_a_loaded_folder(dynamic_folder, model):
    loaded = dq.load_pretrained(dynamic_folder, model)
    config = "all:\n  layers: {name_regex: '.'}\n  features:\n    LogFP8Stats: {}\n"
    with dqi.session(loaded, config) as s, torch.no_grad():
        loaded(**INPUTS)
    assert {r["layer"] for r in s.records} >= {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"}
    gm = dq.fx_rewriter.rewrite(loaded, example_kwargs=INPUTS)
    torch._dynamo.reset()
    compiled = torch.compile(gm, fullgraph=True)
    # no cached compiled graphs: inductor's cache key does not cover the lowering's choices (tests/fx_rewriter)
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        want = loaded(**INPUTS).logits
        assert torch.equal(gm(**INPUTS).logits, want)
        assert torch.allclose(compiled(**INPUTS).logits, want, atol=1e-4, rtol=1e-3)


def _edit(folder, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _config(folder, change) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg["quantization_config"])
    (folder / "config.json").write_text(json.dumps(cfg))


Q = "model.layers.0.self_attn.q_proj"
CASES = {
    "missing scale": (lambda f: _edit(f, lambda t: t.pop(f"{Q}.weight_scale")),
                      rf"{Q}\.weight_scale: missing from the compressed-tensors checkpoint"),
    "wrong shape": (lambda f: _edit(f, lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"][:64]})),
                    rf"{Q}\.weight_scale: the checkpoint holds float32 \[64, 1\], the model needs \[128, 1\]"),
    "wrong dtype": (lambda f: _edit(f, lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].float()})),
                    rf"{Q}\.weight_scale: a scale for '{Q}\.weight', which the file holds as float32"),
    "non-finite scale": (lambda f: _edit(f, lambda t: t[f"{Q}.weight_scale"].__setitem__(3, float("inf"))),
                         rf"{Q}\.weight_scale: a scale must be a positive finite number"),
    "truncated shard": (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-100]),
                        r"in .*model\.safetensors: its bytes end at \d+ but the file has \d+ bytes \(truncated"),
    "unknown scheme": (lambda f: _config(f, lambda qc: qc.update(quant_method="awq")),
                       r"quant_method 'awq'; dbr_quant\.load_pretrained reads"),
    "int8 weights": (lambda f: _config(f, lambda qc: qc["config_groups"]["group_0"]["weights"].update(type="int")),
                     r"'model\.layers\.0\.[a-z_.]+' \(.*config\.json: quantization_config\): "
                     r"compressed-tensors weights: int 8-bit values \(not FP8\)"),
    "weight-only, block weights": (
        lambda f: _config(f, lambda qc: qc["config_groups"]["group_0"].update(
            input_activations=None, weights={**qc["config_groups"]["group_0"]["weights"], "strategy": "block",
                                             "block_structure": [128, 128]})),
        r"'model\.layers\.0\.[a-z_.]+' .*weight-only FP8 with block weights"),
}


def test_weight_only_folder_runs_the_weight_only_gemm(model, dynamic_folder, tmp_path):
    """A compressed-tensors folder without input_activations (vLLM's CompressedTensorsW8A16Fp8 layout) loads as
    QConfig(weight_only=True): every FP8 linear runs fp8_weight_only_linear on its high-precision input, which is
    x·(w_q·s)ᵀ — compared with the same model holding the folder's dequantized weights."""
    import shutil

    folder = tmp_path / "w8a16"
    shutil.copytree(dynamic_folder, folder)
    _config(folder, lambda qc: qc["config_groups"]["group_0"].update(input_activations=None))
    loaded = dq.load_pretrained(folder, copy.deepcopy(model))
    tensors = load_file(folder / "model.safetensors")
    ref = copy.deepcopy(model)
    for name, mod in ref.named_modules():
        if f"{name}.weight_scale" in tensors:
            w = tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"].float()
            mod.weight.data.copy_(w)
    ids = torch.randint(1, 100, (2, 9))
    with torch.no_grad(), dq.kernels.count_launches() as launches:
        got = loaded(input_ids=ids).logits
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    assert launches["fp8_weight_only_linear"] > 0 and launches["quantize"] == 0 and launches["fp8_linear"] == 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_folder_names_the_tensor_and_leaves_the_model(model, dynamic_folder, tmp_path, case):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(dynamic_folder, folder)
    damage, message = CASES[case]
    damage(folder)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(dq.CheckpointError, match=message):
        dq.load_pretrained(folder, model)
    assert "_dbr_record" not in model.__dict__
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
