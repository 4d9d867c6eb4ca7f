"""Folders written by ``save_pretrained``, loaded by software we did not write: transformers with
compressed-tensors (``AutoModel.from_pretrained(folder)`` on CPU), compared with dbr_quant's converted model.

Three levels of evidence:

* **Per layer, exact.** Every linear of the transformers-loaded model holds dbr_quant's FP8 bytes and
  scales (fp32 MiniLM: bit for bit; bf16 Llama: scales rounded to bf16, which is what transformers does
  with a float32 scale) and computes ``fp8(x / s_in)·s_in × (q·s_w)ᵀ + b``, checked against plain torch on
  dbr_quant's own tensors.
* **The quantize: x·(1/s) against x/s.** dbr_quant quantizes an activation as ``x · (1/s)`` (the reciprocal
  rounded once, then one multiply: vLLM's static per-tensor quantize kernel), compressed-tensors as the
  correctly rounded ``x / s``. The two give different FP8 codes (one step apart) only where ``x / s`` sits
  within an fp32 rounding of a midpoint between two FP8 values; inputs built to sit there (``fp8_ties``) show
  it on a MiniLM layer, and that with the same codes the layer's output is the loaded one's bit for bit.
* **End to end, bit for bit where no activation is at such a tie, on dbr_quant's fp32 CPU GEMM path.** Its
  reference linear dequantizes both operands before an fp32 ``F.linear`` (``kernels.cpu.backend.dequantize_operand``),
  which is compressed-tensors' arithmetic; everything else (quantized ops, scales, fusion points: GELU
  before fc2's quantize, residual after the bias; LayerNorm, GELU, attention mask) agrees. The test's
  sentences put no activation at a tie (checked), so the embeddings are equal; other text can (an outside
  suite's 32 sentences: 3 codes flipped, max |Δ| 0.088, min cosine 0.99974).
* **The other orders: an FP8 noise floor, not a deviation.** dbr_quant's GPU kernels (and its reference kernels,
  like vLLM's and ``torch._scaled_mm``) multiply the fp32 accumulator of the FP8 products by ``s_in·s_w``
  in the epilogue. The two scale orders round each GEMM output differently by ~1 ulp (2.3e-7 relative on
  MiniLM), and FP8 re-quantization turns that into whole FP8 steps that cascade: 3 of 140,928 FP8 codes
  differ at layer 0's attention-output input, 127 at its fc2 input, 0.08-4 % of a linear's input codes in
  layer 1, 7-17 % in layer 2, 37-52 % in layers 4-5 (``benchmarks/checkpoint_agreement.py`` prints these
  figures). Any 1-ulp change lands at the same level: the loaded model against itself with ``y - b + b`` at
  every linear gives min embedding cosine 0.99902; the accumulator order against the loaded model 0.99897
  (mean 0.99946). dbr_quant's bf16 CPU GEMM path (the CPU default where the CPU has BF16 dot products) also
  rounds each GEMM output to bf16 (1.6e-3 relative per linear; torch has no bf16 GEMM with fp32 output on
  CPU): measured 0.99799 (mean 0.99890). The bounds below leave ~0.001 for another CPU's GEMM rounding.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from ckpt_models import LM_HEAD_HP, convert_hf, fp8_linears, gpt2, ids, input_scale, llama, twice
from fp8_ties import codes_by_division, codes_by_reciprocal, tie_inputs
from transformers import AutoModel, AutoModelForCausalLM

import dbr_quant as dq
from dbr_quant.examples import minilm
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.quantize.weights import fp8_weight_of

pytest.importorskip("compressed_tensors")


def _capture_linears(model):
    seen, handles = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            handles.append(mod.register_forward_hook(
                lambda m, i, o, name=name: seen.__setitem__(name, (i[0].detach(), o.detach()))))
    return seen, handles


def _fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' KV cache fake quantization: ``x / s`` in x's own dtype (bf16 here), torch's cast."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * scale


def test_minilm_loads_with_transformers_and_matches(minilm_converted, minilm_folder):
    c = minilm_converted
    loaded = AutoModel.from_pretrained(minilm_folder).eval()
    ours = fp8_linears(c.converted)
    assert len(ours) == 37  # 6 layers × (q, k, v, attention out, fc1, fc2) + the pooler
    seen, _ = _capture_linears(loaded)
    with torch.no_grad():
        emb_ct = minilm.sentence_embeddings(loaded, c.eval_inputs)
    ties = {"real": 0, "padding": 0}
    for name, mod in ours.items():
        ct = loaded.get_submodule(name)
        w = fp8_weight_of(mod)
        s_in = input_scale(c.converted, name)
        assert torch.equal(ct.weight_scale.flatten(), w.scale) and torch.equal(ct.input_scale, s_in.reshape(1)), name
        x, y = seen[name]  # the loaded layer's own input and output
        expected = F.linear(_fake_quant(x, s_in), w.qdata.float() * w.scale[:, None], mod.bias)
        assert torch.equal(y, expected), name
        tie = codes_by_division(x, s_in).view(torch.uint8) != codes_by_reciprocal(x, s_in).view(torch.uint8)
        real = c.eval_inputs["attention_mask"].bool()[..., None] if x.dim() == 3 else torch.ones(1, dtype=torch.bool)
        ties["real"] += int((tie & real).sum())
        ties["padding"] += int((tie & ~real).sum())
    # these sentences put no real token's activation at an x·(1/s) vs x/s tie (the test below builds them); a
    # padding token's may be (here: one, at layer 5's fc2 input), which attention and the mean pooling never read
    assert ties["real"] == 0, ties
    emb_fp32 = minilm.sentence_embeddings(c.model, c.eval_inputs)
    with dq.kernels.use_cpu_gemm("fp32"):  # compressed-tensors' arithmetic and no tie: the same embeddings
        emb_fp32_path = minilm.sentence_embeddings(c.converted, c.eval_inputs)
    assert torch.equal(emb_fp32_path, emb_ct)
    with dq.kernels.use_cpu_gemm("bf16"):
        emb_bf16 = minilm.sentence_embeddings(c.converted, c.eval_inputs)
    # the reference backend: fp32 GEMMs with the scales on the accumulator, what dbr_quant's GPU kernels compute
    with dq.kernels.use_backend("reference"):
        emb_exact = minilm.sentence_embeddings(c.converted, c.eval_inputs)
    cos = {k: (emb_ct * e).sum(-1) for k, e in (("fp32", emb_fp32_path), ("bf16", emb_bf16), ("exact", emb_exact))}
    own_gap = (emb_exact * emb_bf16).sum(-1)  # dbr_quant's two kernel orders
    print("MiniLM transformers-loaded vs dbr_quant, min / mean embedding cosine: " + "; ".join(
        f"{k} {v.min():.5f} / {v.mean():.5f}" for k, v in cos.items())
          + f"; dbr_quant exact vs bf16 {own_gap.min():.5f}")
    assert cos["fp32"].min() >= 0.9995
    assert cos["exact"].min() >= 0.998 and cos["exact"].mean() >= 0.9993
    assert cos["bf16"].min() >= 0.997 and cos["bf16"].mean() >= 0.9985
    assert cos["bf16"].min() > (emb_ct * emb_fp32).sum(-1).min()  # closer to dbr_quant's FP8 model than to fp32


def test_minilm_layer_on_built_ties_differs_from_transformers_only_in_the_quantize(minilm_converted, minilm_folder):
    """A MiniLM linear fed inputs built so that x·(1/s) and x/s round to different FP8 codes: dbr_quant's
    quantize gives torch's cast of x·reciprocal(s) (vLLM's static quantize arithmetic), the transformers-loaded
    layer the codes of x/s, one step apart at every such input, so the outputs differ there (the end-to-end
    "bit for bit" holds only where no activation is at a tie). Given the loaded layer's own codes, dbr_quant's
    fp32-path linear reproduces its output bit for bit: the quantize is the only difference."""
    name = "encoder.layer.0.attention.self.query"
    c = minilm_converted
    loaded = AutoModel.from_pretrained(minilm_folder).eval()
    mod, s = fp8_linears(c.converted)[name], input_scale(c.converted, name)
    w = fp8_weight_of(mod)
    ties = tie_inputs(float(s))
    assert ties.numel() >= 16
    g = torch.Generator().manual_seed(0)
    k = mod.in_features
    tie_rows = ties[torch.randint(0, ties.numel(), (3, k), generator=g)]
    x = torch.cat([tie_rows, torch.randn(2, k, generator=g)])  # 3 rows of ties, 2 ordinary rows
    with torch.no_grad():
        minilm.sentence_embeddings(loaded, c.eval_inputs)  # the first forward decompresses the weights
        y_ct = loaded.get_submodule(name)(x)
    ref = cpu_backend  # what the converted model runs on the CPU
    ours = ref.quantize(x, s, FP8Format.E4M3)
    theirs = codes_by_division(x, s)
    assert torch.equal(ours.view(torch.uint8), codes_by_reciprocal(x, s).view(torch.uint8))
    step = (ours.view(torch.uint8).int() - theirs.view(torch.uint8).int()).abs()
    assert torch.equal(step[:3], torch.ones_like(step[:3]))
    with dq.kernels.use_cpu_gemm("fp32"), torch.no_grad():
        y_ours = ref.fp8_linear(ours, s, w.qdata, w.scale, bias=mod.bias)
        y_their_codes = ref.fp8_linear(theirs, s, w.qdata, w.scale, bias=mod.bias)
    assert torch.equal(y_their_codes, y_ct)
    assert not torch.equal(y_ours[:3], y_ct[:3])
    assert torch.equal(y_ours[3:], y_ct[3:]) == torch.equal(step[3:], torch.zeros_like(step[3:]))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_bf16_llama_loads_with_transformers(llama_converted, tmp_path):
    c = llama_converted
    dq.save_pretrained(c.converted, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"] and qc["kv_cache_scheme"] is None
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.dtype == torch.bfloat16 and not hasattr(loaded.lm_head, "weight_scale")
    assert torch.equal(loaded.lm_head.weight, c.converted.lm_head.weight)
    for name, mod in fp8_linears(c.converted).items():
        ct, w = loaded.get_submodule(name), fp8_weight_of(mod)
        # transformers creates scale parameters in the model's dtype and rounds the float32 scale into it
        assert torch.equal(ct.weight_scale.flatten(), w.scale.to(torch.bfloat16)), name
        assert torch.equal(ct.input_scale, input_scale(c.converted, name).reshape(1).to(torch.bfloat16)), name
        # still compressed until the first forward: dbr_quant's FP8 bytes
        assert ct.weight.dtype == torch.float8_e4m3fn and torch.equal(ct.weight.view(torch.uint8),
                                                                        w.qdata.view(torch.uint8)), name
    # gate and up were one stacked buffer in dbr_quant; the file holds each module's own rows
    gate = fp8_weight_of(c.converted.model.layers[0].mlp.gate_proj)
    up = fp8_weight_of(c.converted.model.layers[0].mlp.up_proj)
    assert gate.qdata.untyped_storage().data_ptr() == up.qdata.untyped_storage().data_ptr()
    with torch.no_grad():
        logits_ct = loaded(**c.eval_inputs).logits
        logits_dbr = c.converted(**c.eval_inputs).logits
        logits_hp = c.model(**c.eval_inputs).logits
    err, fp8_err = _rel(logits_ct, logits_dbr), _rel(logits_dbr, logits_hp)
    print(f"bf16 Llama transformers-loaded vs dbr_quant logits: {err:.4f} relative (dbr_quant vs bf16: {fp8_err:.4f})")
    assert err <= 0.02 and err < 0.8 * fp8_err


def test_sharded_folder_loads_the_same(llama_converted, tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    dq.save_pretrained(llama_converted.converted, one)
    dq.save_pretrained(llama_converted.converted, many, max_shard_size="30KB")
    index = json.loads((many / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in many.glob("model-*.safetensors"))
    assert len(shards) >= 4 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards) and not (many / "model.safetensors").exists()
    # a module's tensors stay in one shard
    for name in index["weight_map"]:
        if name.endswith(".weight_scale"):
            assert index["weight_map"][name] == index["weight_map"][name.replace("_scale", "")]
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(one).eval()(**llama_converted.eval_inputs).logits
        b = AutoModelForCausalLM.from_pretrained(many).eval()(**llama_converted.eval_inputs).logits
    assert torch.equal(a, b)
    dq.save_pretrained(llama_converted.converted, many)  # saving again with one shard removes the old shards
    assert sorted(p.name for p in many.glob("model*")) == ["model.safetensors"]


def test_fp8_attention_writes_kv_cache_scales_transformers_uses(tmp_path):
    c = convert_hf(llama(), dq.QConfig(quantize_attention=True, overrides=LM_HEAD_HP.overrides))
    with pytest.warns(UserWarning, match="q is not quantized by loaders"):
        dq.save_pretrained(c.converted, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                                     "dynamic": False, "group_size": None, "observer": "minmax"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    record = c.converted.__dict__["_dbr_record"]
    for i, layer in enumerate(loaded.model.layers):
        st = next(s for s in record.states if s.fqn == f"model.layers.{i}.self_attn")
        op = next(op for op in st.seen_ops if op.kind == "sdpa")
        assert layer.self_attn.k_scale.shape == (1,)
        assert torch.equal(layer.self_attn.k_scale, st.scale(op, "k").reshape(1).to(torch.bfloat16))
        assert torch.equal(layer.self_attn.v_scale, st.scale(op, "v").reshape(1).to(torch.bfloat16))
    seen = []  # compressed-tensors' KV cache module: (key, value) in, quantized (key, value) out
    for layer in loaded.model.layers:
        layer.self_attn.kv_cache.register_forward_hook(
            lambda m, args, out, attn=layer.self_attn: seen.append((args[:2], out, attn.k_scale, attn.v_scale)))
    with torch.no_grad():
        err = _rel(loaded(**c.eval_inputs).logits, c.converted(**c.eval_inputs).logits)
    assert len(seen) == 2
    for (k, v), (k_q, v_q), k_scale, v_scale in seen:  # the cached keys/values are on our scales' FP8 grids
        assert torch.equal(k_q, _fake_quant(k, k_scale)) and torch.equal(v_q, _fake_quant(v, v_scale))
        assert not torch.equal(k_q, k)
    print(f"FP8 attention: transformers-loaded vs dbr_quant logits {err:.4f}")
    assert err <= 0.03


def test_per_head_attention_scales_write_per_kv_head_scales_transformers_uses(tmp_path):
    """attention_scales="head": k_scale / v_scale [num_key_value_heads, 1, 1] (compressed-tensors' attn_head
    shape, which vLLM flattens to its [num_kv_heads]) and kv_cache_scheme strategy attn_head; transformers +
    compressed-tensors load them and quantize each cached kv head with its own scale. The model is GQA (4 query
    heads, 2 kv heads) and is calibrated both with kv heads as they are (no mask: SDPA's enable_gqa) and
    repeated to 4 (a padding mask: transformers' repeat_kv); the file holds one value per kv head either way."""
    model = llama()
    with torch.no_grad():
        for layer in model.model.layers:  # kv head 1's keys 8x larger: its own scale
            layer.self_attn.k_proj.weight[16:] *= 8
    qconfig = dq.QConfig(quantize_attention=True, attention_scales="head", overrides=LM_HEAD_HP.overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, example_kwargs={"input_ids": ids(2, 12, 1)}, qconfig=qconfig)
        mask = torch.ones(4, 32, dtype=torch.long)
        mask[0, :5] = 0
        dq.calibrate(prepared, [{"input_ids": ids(4, 32, 2)}, {"input_ids": ids(4, 32, 3), "attention_mask": mask}],
                     progress=False)
        converted = dq.convert(prepared)
    with pytest.warns(UserWarning, match="q is not quantized by loaders"):
        dq.save_pretrained(converted, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "attn_head", "symmetric": True,
                                     "dynamic": False, "group_size": None, "observer": "minmax"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    record = converted.__dict__["_dbr_record"]
    for i, layer in enumerate(loaded.model.layers):
        st = next(s for s in record.states if s.fqn == f"model.layers.{i}.self_attn")
        op = next(op for op in st.seen_ops if op.kind == "sdpa")
        k, v = st.scale(op, "k"), st.scale(op, "v")
        assert k.shape == v.shape == (2,) and k[1] > 4 * k[0]  # per kv head, calibrated on 2 and on 4 heads
        assert layer.self_attn.k_scale.shape == layer.self_attn.v_scale.shape == (2, 1, 1)
        assert torch.equal(layer.self_attn.k_scale.flatten(), k.to(torch.bfloat16))
        assert torch.equal(layer.self_attn.v_scale.flatten(), v.to(torch.bfloat16))
    seen = []
    for layer in loaded.model.layers:
        layer.self_attn.kv_cache.register_forward_hook(
            lambda m, args, out, attn=layer.self_attn: seen.append((args[:2], out, attn.k_scale, attn.v_scale)))
    inputs = {"input_ids": ids(4, 32, 5)}
    with torch.no_grad():
        err = _rel(loaded(**inputs).logits, converted(**inputs).logits)
    assert len(seen) == 2
    for (k, v), (k_q, v_q), k_scale, v_scale in seen:  # each kv head on its own scale's FP8 grid
        assert k.shape[1] == 2
        assert torch.equal(k_q, _fake_quant(k, k_scale)) and torch.equal(v_q, _fake_quant(v, v_scale))
    print(f"FP8 attention, per-head scales: transformers-loaded vs dbr_quant logits {err:.4f}")
    assert err <= 0.03


def test_mixed_schemes_get_one_config_group_each(tmp_path):
    """A per-module override (dynamic per-token activations, per-tensor weights for down_proj) becomes a
    second config group naming those modules; transformers applies each module's own scheme."""
    qconfig = dq.QConfig(overrides=(
        dq.Override(pattern="^lm_head$", skip=True),
        dq.Override(pattern=r"down_proj$", dynamic=True, activation=dq.TensorQConfig(granularity="token"),
                    weight=dq.TensorQConfig(granularity="tensor"))))
    c = convert_hf(llama(), qconfig)
    dq.save_pretrained(c.converted, tmp_path)
    groups = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]
    assert groups["group_0"]["targets"] == ["Linear"]
    assert groups["group_1"]["targets"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert groups["group_1"]["weights"]["strategy"] == "tensor"
    assert groups["group_1"]["input_activations"]["dynamic"] is True
    assert groups["group_1"]["input_activations"]["strategy"] == "token"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    down, gate = loaded.model.layers[1].mlp.down_proj, loaded.model.layers[1].mlp.gate_proj
    assert down.quantization_scheme.input_activations.dynamic is True and not hasattr(down, "input_scale")
    assert down.weight_scale.shape == (1,) and gate.weight_scale.shape == (128, 1)
    with torch.no_grad():
        err = _rel(loaded(**c.eval_inputs).logits, c.converted(**c.eval_inputs).logits)
    assert err <= 0.02


def test_gpt2_conv1d_is_written_dequantized_and_ignored(tmp_path):

    c = convert_hf(gpt2(), dq.QConfig(overrides=(dq.Override(pattern="^lm_head$", untie=True),)))  # test_tied.py
    with pytest.warns(UserWarning, match="Conv1D layers have no compressed-tensors form"):
        dq.save_pretrained(c.converted, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "transformer.h.0.attn.c_attn" in config["quantization_config"]["ignore"]
    assert config["tie_word_embeddings"] is False  # lm_head is FP8, the token embedding is not
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    conv = loaded.transformer.h[0].attn.c_attn
    assert torch.equal(conv.weight, fp8_weight_of(c.converted.transformer.h[0].attn.c_attn).dequantize())
    assert hasattr(loaded.lm_head, "weight_scale")
    with torch.no_grad():
        err = _rel(loaded(**c.eval_inputs).logits, c.converted(**c.eval_inputs).logits)
        fp8_err = _rel(c.converted(**c.eval_inputs).logits, c.model(**c.eval_inputs).logits)
    assert err < fp8_err  # Conv1D activations run in high precision there, the weights are the FP8 ones


def test_e5m2_is_refused_before_writing(tmp_path):
    c = convert_hf(llama(), dq.QConfig(weight=dq.TensorQConfig(format="e5m2", granularity="channel")))
    with pytest.raises(dq.CheckpointError, match="E5M2; the compressed-tensors format stores FP8 weights as E4M3"):
        dq.save_pretrained(c.converted, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    c = convert_hf(llama(), dq.QConfig(activation=dq.TensorQConfig(format="e5m2")))
    with pytest.raises(dq.CheckpointError, match="E4M3 activations only"):
        dq.save_pretrained(c.converted, tmp_path / "out")


def test_warns_what_loaders_run_differently(tmp_path):

    c = twice()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dq.save_pretrained(c.converted, tmp_path)
    text = " ".join(str(w.message) for w in caught)
    assert "1 linear(s) run at several call sites" in text and "proj" in text
    assert not (tmp_path / "config.json").exists()  # not a Hugging Face model: tensors + dbr_quant.json only


def test_warns_when_vllm_fused_siblings_differ(tmp_path):
    c = convert_hf(llama(), dq.QConfig(overrides=(dq.Override(pattern=r"layers\.1\.self_attn\.k_proj$", skip=True),)))
    with pytest.warns(UserWarning, match=r"q_proj/k_proj/v_proj of 'model\.layers\.1\.self_attn' differ .* vLLM"):
        dq.save_pretrained(c.converted, tmp_path)
    ignore = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.1.self_attn.k_proj" in ignore
