"""``load_pretrained`` rebuilds the converted model bit for bit from a fresh high-precision architecture, and
refuses a bad folder with an error naming the tensor while the model it was given stays untouched."""

from __future__ import annotations

import copy
import json
import pickle
import struct

import pytest
import torch
from ckpt_models import LLAMA, convert_hf, fp8_linears, gpt2, llama, twice
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

import dbr_quant as dq
from dbr_quant.checkpoints import CheckpointError
from dbr_quant.ops.tags import tag_of
from dbr_quant.quantize.weights import fp8_weight_of


def _outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state if hasattr(out, "last_hidden_state") \
        else out


def _scale_buffers(model) -> dict[str, torch.Tensor]:
    return {f"{st.fqn}.{n}": b for st in model.__dict__["_dbr_record"].states for n, b in st.named_buffers()
            if n.startswith("scale_")}


def assert_same_converted(a, b, inputs) -> None:
    """Same FP8 bytes and scales per linear, same activation scales, same gate/up stacking, same outputs."""
    wa = {n: fp8_weight_of(m) for n, m in a.named_modules() if fp8_weight_of(m) is not None}
    wb = {n: fp8_weight_of(m) for n, m in b.named_modules() if fp8_weight_of(m) is not None}
    assert wa.keys() == wb.keys() and wa
    for n in wa:
        assert torch.equal(wa[n].qdata.view(torch.uint8), wb[n].qdata.view(torch.uint8)), n
        assert torch.equal(wa[n].scale, wb[n].scale) and wa[n].dtype == wb[n].dtype, n
        assert wa[n].transposed == wb[n].transposed
    sa, sb = _scale_buffers(a), _scale_buffers(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    stacked = lambda m: sorted(n for n, mod in m.named_modules()  # noqa: E731
                               if getattr(tag_of(mod), "stacked_after", None) is not None)
    assert stacked(a) == stacked(b)
    hp_a = {k: v for k, v in a.state_dict().items() if "_auto_quant_state" not in k and v.dtype.is_floating_point
            and not k.endswith(("weight_scale",)) and v.dtype.itemsize > 1}
    hp_b = b.state_dict()
    assert all(torch.equal(v, hp_b[k]) for k, v in hp_a.items())
    assert torch.equal(_outputs(a, inputs), _outputs(b, inputs))


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _untouched(model, before) -> None:
    after = model.state_dict()
    assert "_dbr_record" not in model.__dict__ and before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_llama_round_trip_is_bit_exact(llama_converted, tmp_path):
    dq.save_pretrained(llama_converted.converted, tmp_path, max_shard_size="50KB")
    fresh = llama()  # new random weights: every value must come from the folder
    before = _snapshot(fresh)
    loaded = dq.load_pretrained(tmp_path, fresh)
    _untouched(fresh, before)
    assert_same_converted(llama_converted.converted, loaded, llama_converted.eval_inputs)
    gate, up = (fp8_weight_of(loaded.model.layers[1].mlp.gate_proj), fp8_weight_of(loaded.model.layers[1].mlp.up_proj))
    assert up.qdata.data_ptr() == gate.qdata.data_ptr() + gate.qdata.numel()  # stacked again, one buffer


def test_minilm_round_trip_is_bit_exact(minilm_converted, minilm_folder):
    from dbr_quant.examples import minilm

    fresh, _ = minilm.load_minilm()
    loaded = dq.load_pretrained(minilm_folder, fresh)
    assert_same_converted(minilm_converted.converted, loaded, minilm_converted.eval_inputs)


@pytest.mark.parametrize("case", ["gpt2_conv1d_dynamic_per_token", "two_call_sites_per_tensor", "fp8_attention",
                                  "fp8_attention_per_head"])
def test_other_round_trips_are_bit_exact(case, tmp_path):
    if case == "gpt2_conv1d_dynamic_per_token":
        c = convert_hf(gpt2(), dq.QConfig(dynamic=True, activation=dq.TensorQConfig(granularity="token")))
        fresh = type(c.model)(c.model.config).eval()
    elif case == "two_call_sites_per_tensor":
        c = twice(dq.QConfig(weight=dq.TensorQConfig(granularity="tensor")))
        torch.manual_seed(1)
        fresh = type(c.model)().eval()
    else:
        scales = "head" if case.endswith("per_head") else "tensor"
        c = convert_hf(llama(), dq.QConfig(quantize_attention=True, attention_scales=scales))
        fresh = llama()
    with pytest.warns(UserWarning):
        dq.save_pretrained(c.converted, tmp_path)
    assert_same_converted(c.converted, dq.load_pretrained(tmp_path, fresh), c.eval_inputs)


def test_non_hf_model_folder_holds_tensors_and_json_only(tmp_path):
    c = twice()
    with pytest.warns(UserWarning, match="several call sites"):
        files = dq.save_pretrained(c.converted, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dbr_quant.json", "model.safetensors"]
    assert len(files) == 2
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        site_scales = [st.scale(op, "input") for st in c.converted.__dict__["_dbr_record"].states
                       for op in st.seen_ops if op.weight_owner == "proj"]
        assert len(site_scales) == 2 and site_scales[0] != site_scales[1]
        assert torch.equal(f.get_tensor("proj.input_scale"), torch.stack(site_scales).max().reshape(1))
    assert keys == {"proj.weight", "proj.weight_scale", "proj.input_scale", "proj.bias", "out.weight",
                    "out.weight_scale", "out.input_scale", "out.bias", "offset"}
    meta = json.loads((tmp_path / "dbr_quant.json").read_text())
    assert meta["quantization_config"]["config_groups"]["group_0"]["targets"] == ["Linear"]


def test_no_pickle_on_save_or_load(llama_converted, tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("pickle used")

    for mod, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"),
                      (pickle, "dump"), (pickle, "dumps"), (torch, "save")]:
        monkeypatch.setattr(mod, name, refuse)
    dq.save_pretrained(llama_converted.converted, tmp_path)
    dq.load_pretrained(tmp_path, llama())


# ----------------------------------------------------------------------------------------- bad folders
def _rewrite(folder, fn) -> None:
    """Rewrite the (single) shard with fn(tensors dict) applied, through the safetensors package."""
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


DOWN = "model.layers.0.mlp.down_proj.weight"
BAD = {
    "wrong shape": (lambda t: t.__setitem__(DOWN, t[DOWN][:, :64].contiguous()),
                    r"model\.layers\.0\.mlp\.down_proj\.weight: the checkpoint holds float8_e4m3fn \[64, 64\], "
                    r"the model needs float8_e4m3fn \[64, 128\]"),
    "wrong dtype": (lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].float()),
                    r"model\.norm\.weight: the checkpoint holds float32 \[64\], the model needs bfloat16 \[64\]"),
    "fp8 stored as bf16": (lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight",
                                                   t["model.layers.0.self_attn.q_proj.weight"].bfloat16()),
                           r"q_proj\.weight: the checkpoint holds bfloat16 \[64, 64\], the model needs float8_e4m3fn"),
    "missing scale": (lambda t: t.pop("model.layers.1.self_attn.o_proj.weight_scale"),
                      r"model\.layers\.1\.self_attn\.o_proj\.weight_scale: missing from the checkpoint"),
    "missing tensor": (lambda t: t.pop("model.embed_tokens.weight"),
                       r"model\.embed_tokens\.weight: missing"),
    "nan scale": (lambda t: t["model.layers.0.mlp.up_proj.weight_scale"].__setitem__((3, 0), float("nan")),
                  r"model\.layers\.0\.mlp\.up_proj\.weight_scale: a scale must be a positive finite number, the "
                  r"checkpoint holds \[nan\]"),
    "inf input scale": (lambda t: t["model.layers.0.mlp.down_proj.input_scale"].fill_(float("inf")),
                        r"down_proj\.input_scale: a scale must be a positive finite number"),
    "zero scale": (lambda t: t["model.layers.0.self_attn.k_proj.weight_scale"].zero_(),
                   r"k_proj\.weight_scale: a scale must be a positive finite number, the checkpoint holds \[0\.0"),
    "nan fp8 byte": (lambda t: t["model.layers.1.mlp.gate_proj.weight"].view(torch.uint8).__setitem__((0, 0), 0x7F),
                     r"model\.layers\.1\.mlp\.gate_proj\.weight: the FP8 weight holds NaN bytes"),
    "unexpected tensor": (_set("model.layers.0.extra", torch.zeros(3)),
                          r"model\.layers\.0\.extra: in the checkpoint but not in the model"),
    "input scale disagrees": (lambda t: t["model.layers.0.self_attn.v_proj.input_scale"].mul_(2),
                              r"v_proj\.input_scale: the file holds .*dbr_quant\.json implies"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tensor_is_an_error_naming_it(case, llama_converted, tmp_path):
    dq.save_pretrained(llama_converted.converted, tmp_path)
    fn, message = BAD[case]
    _rewrite(tmp_path, fn)
    fresh = llama()
    before = _snapshot(fresh)
    with pytest.raises(CheckpointError, match=message):
        dq.load_pretrained(tmp_path, fresh)
    _untouched(fresh, before)


KV = "model.layers.1.self_attn.k_scale"


@pytest.mark.parametrize("case, fn, message", [
    ("one head's scale changed", lambda t: t[KV][1].mul_(2),
     r"model\.layers\.1\.self_attn\.k_scale: the file holds .*dbr_quant\.json implies"),
    ("per tensor instead of per head", _set(KV, torch.ones(1)),
     r"k_scale: the checkpoint holds float32 \[1\], the model needs .*\[2, 1, 1\]"),
])
def test_per_head_kv_scales_are_checked_head_by_head(case, fn, message, tmp_path):
    c = convert_hf(llama(), dq.QConfig(quantize_attention=True, attention_scales="head"))
    with pytest.warns(UserWarning):
        dq.save_pretrained(c.converted, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor(KV).shape == (2, 1, 1)  # one per kv head (GQA: 4 query heads, 2 kv heads)
    _rewrite(tmp_path, fn)
    with pytest.raises(CheckpointError, match=message):
        dq.load_pretrained(tmp_path, llama())


def test_truncated_shard_names_the_tensor(llama_converted, tmp_path):
    dq.save_pretrained(llama_converted.converted, tmp_path, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    path = tmp_path / last
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    victim = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    path.write_bytes(data[:-10])
    fresh = llama()
    before = _snapshot(fresh)
    with pytest.raises(CheckpointError, match=rf"{victim} in .*{last}: its bytes end at .* \(truncated file\)"):
        dq.load_pretrained(tmp_path, fresh)
    _untouched(fresh, before)
    (tmp_path / last).unlink()
    with pytest.raises(CheckpointError, match="listed in model.safetensors.index.json but missing"):
        dq.load_pretrained(tmp_path, fresh)


def test_other_architecture_or_folder_is_refused(llama_converted, tmp_path):
    dq.save_pretrained(llama_converted.converted, tmp_path)
    wider = LlamaForCausalLM(LlamaConfig(**{**LLAMA, "intermediate_size": 96})).to(torch.bfloat16).eval()
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: the checkpoint holds "
                                              r"float8_e4m3fn \[128, 64\], the model needs float8_e4m3fn \[96, 64\]"):
        dq.load_pretrained(tmp_path, wider)
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight: the checkpoint holds bfloat16 "
                                              r"\[256, 64\], the model needs float32"):
        dq.load_pretrained(tmp_path, llama().float())
    with pytest.raises(TypeError, match="high-precision"):
        dq.load_pretrained(tmp_path, llama_converted.converted)
    meta = json.loads((tmp_path / "dbr_quant.json").read_text())
    meta["states"][1]["ops"][0]["scales"]["input"] = float("nan")
    (tmp_path / "dbr_quant.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="dbr_quant.json: .*scale 'input': a scale must be a positive finite"):
        dq.load_pretrained(tmp_path, llama())
    (tmp_path / "dbr_quant.json").unlink()  # now a compressed-tensors folder of another tool (issue #22): it loads
    as_foreign = dq.load_pretrained(tmp_path, llama())
    for name, mod in fp8_linears(llama_converted.converted).items():
        a, b = fp8_weight_of(mod), fp8_weight_of(as_foreign.get_submodule(name))
        assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8)), name
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no dbr_quant.json and no quantization_config in config.json"):
        dq.load_pretrained(tmp_path, llama())


def test_trace_that_differs_from_the_saved_one_is_refused(llama_converted, tmp_path):
    dq.save_pretrained(llama_converted.converted, tmp_path)
    meta = json.loads((tmp_path / "dbr_quant.json").read_text())
    op = meta["states"][1]["ops"][0]
    op["fusion"] = "made_up"
    (tmp_path / "dbr_quant.json").write_text(json.dumps(meta))
    fresh = llama()
    before = _snapshot(fresh)
    with pytest.raises(CheckpointError, match=rf"did not reproduce the saved model: op {op['fqn']} .*fusion saved "
                                              "'made_up'"):
        dq.load_pretrained(tmp_path, fresh)
    _untouched(fresh, before)


def test_example_inputs_can_be_given(llama_converted, tmp_path):
    dq.save_pretrained(llama_converted.converted, tmp_path)
    meta = json.loads((tmp_path / "dbr_quant.json").read_text())
    meta["example"] = None
    (tmp_path / "dbr_quant.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="pass example_inputs= / example_kwargs="):
        dq.load_pretrained(tmp_path, llama())
    example = copy.deepcopy(llama_converted.converted.__dict__["_dbr_record"].example[1])
    loaded = dq.load_pretrained(tmp_path, llama(), example_kwargs=example)
    assert torch.equal(_outputs(loaded, llama_converted.eval_inputs),
                       _outputs(llama_converted.converted, llama_converted.eval_inputs))


@pytest.mark.parametrize("damage", ["drop states", "op without scales", "unknown layout"])
def test_damaged_json_is_an_error_naming_the_entry(damage, llama_converted, tmp_path):
    dq.save_pretrained(llama_converted.converted, tmp_path)
    meta = json.loads((tmp_path / "dbr_quant.json").read_text())
    if damage == "drop states":
        del meta["states"]
    elif damage == "op without scales":
        del meta["states"][1]["ops"][0]["scales"]
    else:
        meta["linears"]["model.layers.0.mlp.up_proj"]["layout"] = "int4"
    (tmp_path / "dbr_quant.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="dbr_quant.json: malformed entry"):
        dq.load_pretrained(tmp_path, llama())


def test_architecture_on_the_meta_device_loads_and_shares_nothing_with_the_given_model(llama_converted, tmp_path):
    """The loaded model is built from the folder: an architecture on the meta device is enough (when it has no
    non-persistent buffers), and a real one is neither copied nor shares a tensor with the result."""
    c = twice()
    with pytest.warns(UserWarning, match="several call sites"):
        dq.save_pretrained(c.converted, tmp_path / "twice")
    with torch.device("meta"):
        skeleton = type(c.model)().eval()
    assert_same_converted(c.converted, dq.load_pretrained(tmp_path / "twice", skeleton), c.eval_inputs)
    dq.save_pretrained(llama_converted.converted, tmp_path / "llama")
    fresh = llama()
    loaded = dq.load_pretrained(tmp_path / "llama", fresh)
    given = {t.untyped_storage().data_ptr() for t in fresh.state_dict().values()}
    assert not given & {t.untyped_storage().data_ptr() for t in loaded.state_dict().values()}
    with torch.device("meta"):
        on_meta = llama()
    with pytest.raises(CheckpointError, match=r"rotary_emb\.inv_freq: on the meta device and not in the checkpoint"):
        dq.load_pretrained(tmp_path / "llama", on_meta)
