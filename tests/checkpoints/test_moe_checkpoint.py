"""``save_pretrained`` / ``load_pretrained`` for MoE models whose experts are one module with 3-D FP8 weights
(small Mixtral and Qwen2-MoE of tests/test_moe.py): written per expert as the Hugging Face hub checkpoints
name them, read back bit for bit, and loadable by what serves them.

The names follow the loaders that read them:

* vLLM ``vllm/model_executor/layers/fused_moe/layer.py``, ``FusedMoE.make_expert_params_mapping``: a
  checkpoint tensor ``…experts.<e>.<ckpt name>.<suffix>`` loads into ``…experts.w13_<suffix>`` (gate = shard
  ``w1``, up = ``w3``) or ``…experts.w2_<suffix>`` (down), expert ``e``; the ckpt names are ``w1``/``w2``/``w3``
  in ``models/mixtral.py`` (whose MoE block is ``block_sparse_moe``) and ``gate_proj``/``down_proj``/``up_proj``
  in ``models/qwen2_moe.py`` (``Qwen2MoeModel.get_expert_mapping``).
* vLLM ``quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_w8a8_fp8.py``,
  ``CompressedTensorsW8A8Fp8MoEMethod.create_weights``: ``w13_weight`` fp8 [E, 2I, H], ``w2_weight`` [E, H, I];
  per channel ``w13_weight_scale`` [E, 2I, 1] / ``w2_weight_scale`` [E, H, 1], per tensor [E, 2] / [E]
  (one value per shard); static ``w13_input_scale`` / ``w2_input_scale`` [E], one [1] value per expert,
  reduced to their max in ``process_weights_after_loading``. Its ``__init__`` accepts (tensor weights,
  tensor activations) or (channel weights, dynamic token activations) only.
* transformers ``conversion_mapping.py`` ("mixtral": ``.block_sparse_moe.`` → ``.mlp.``, ``.experts.*.w1/w3``
  → ``gate_up_proj``; "qwen2_moe": ``mlp.experts.*.gate_proj/up_proj`` → ``gate_up_proj``) with
  ``integrations/compressed_tensors.py`` ``DecompressExperts`` (FP8 experts dequantized to bf16 while merging).
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from safetensors import safe_open
from test_moe import EXPERTS_N, LAYERS, batches, build, logits, pipeline  # tests/ is on sys.path (conftest)

import dbr_quant as dq
from dbr_quant.moe.experts import MoeState
from dbr_quant.quantize.weights import FP8Weight

CKPT_NAMES = {"mixtral": ("w1", "w2", "w3", "block_sparse_moe"), "qwen2_moe": ("gate_proj", "down_proj", "up_proj",
                                                                               "mlp")}
PER_TENSOR = dq.QConfig(weight=dq.TensorQConfig(granularity="tensor"))
DYNAMIC = dq.QConfig(dynamic=True, activation=dq.TensorQConfig(granularity="token"))


def _save(converted, folder) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dq.save_pretrained(converted, folder)
    return [str(w.message) for w in caught]


def _tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _vllm_expert_params(tensors: dict[str, torch.Tensor], gate: str, down: str, up: str, num_experts: int):
    """What vLLM's loader builds from the file: FusedMoE.make_expert_params_mapping's renaming
    (``name.replace(f"experts.{e}.{ckpt}.", "experts.w13_" | "experts.w2_")``), then the FusedMoE weight
    loader's placement: w1 rows [0, I), w3 rows [I, 2I) of w13; a per-tensor scale per shard; a [1] input
    scale per expert. Returns {vLLM parameter name: {expert: {shard: tensor}}} and the tensors left over."""
    mapping = [("experts.w13_" if name in (gate, up) else "experts.w2_", f"experts.{e}.{name}.", e, shard)
               for e in range(num_experts) for shard, name in (("w1", gate), ("w2", down), ("w3", up))]
    params: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    rest = {}
    for key, t in tensors.items():
        for param_prefix, weight_name, e, shard in mapping:
            if weight_name in key:
                params.setdefault(key.replace(weight_name, param_prefix), {}).setdefault(e, {})[shard] = t
                break
        else:
            rest[key] = t
    return params, rest


def _w13(by_expert: dict[int, dict[str, torch.Tensor]], num_experts: int) -> torch.Tensor:
    return torch.stack([torch.cat([by_expert[e]["w1"], by_expert[e]["w3"]], 0) for e in range(num_experts)])


@pytest.mark.parametrize("name,impl,qconfig", [
    ("mixtral", "grouped_mm", None), ("qwen2_moe", "eager", PER_TENSOR), ("qwen2_moe", "batched_mm", DYNAMIC),
], ids=["mixtral", "qwen2_moe-tensor", "qwen2_moe-dynamic"])
def test_experts_are_written_as_vllm_reads_them_and_round_trip_bit_for_bit(tmp_path, name, impl, qconfig):
    _, _, converted = pipeline(name, impl, qconfig=qconfig)
    notes = _save(converted, tmp_path)
    gate, down, up, block = CKPT_NAMES[name]
    tensors = _tensors(tmp_path)
    params, rest = _vllm_expert_params(tensors, gate, down, up, EXPERTS_N)
    assert not [k for k in rest if re.search(r"\.experts\.\d+\.", k)], "expert tensors vLLM would not map"
    states = [st for st in converted.__dict__["_dbr_record"].states if isinstance(st, MoeState)]
    assert len(states) == LAYERS
    static = qconfig is not DYNAMIC
    per_tensor = qconfig is PER_TENSOR
    for st in states:
        module = converted.get_submodule(st.fqn)
        w13, w2 = module.gate_up_proj, module.down_proj
        assert type(w13) is FP8Weight and type(w2) is FP8Weight
        layer = st.fqn.removesuffix(".mlp.experts")
        base = f"{layer}.{block}.experts"
        expected = {f"{base}.w13_weight", f"{base}.w13_weight_scale", f"{base}.w2_weight", f"{base}.w2_weight_scale"}
        if static:
            expected |= {f"{base}.w13_input_scale", f"{base}.w2_input_scale"}
        assert {k for k in params if k.startswith(base + ".")} == expected
        # weights: fp8 [I, H] per gate / up, [H, I] per down, stacked by the loader into our [E, N, K] bytes
        got13, got2 = _w13(params[f"{base}.w13_weight"], EXPERTS_N), torch.stack(
            [params[f"{base}.w2_weight"][e]["w2"] for e in range(EXPERTS_N)])
        assert got13.dtype == got2.dtype == torch.float8_e4m3fn
        assert torch.equal(got13.view(torch.uint8), w13.qdata.view(torch.uint8))
        assert torch.equal(got2.view(torch.uint8), w2.qdata.view(torch.uint8))
        s13, s2 = params[f"{base}.w13_weight_scale"], params[f"{base}.w2_weight_scale"]
        if per_tensor:  # [1] per shard → vLLM's [E, 2] and [E]; gate and up share our per-expert scale
            assert all(s13[e][k].shape == (1,) for e in range(EXPERTS_N) for k in ("w1", "w3"))
            assert torch.equal(torch.stack([torch.cat([s13[e]["w1"], s13[e]["w3"]]) for e in range(EXPERTS_N)]),
                               w13.scale.expand(-1, 2))
            assert torch.equal(torch.stack([s2[e]["w2"] for e in range(EXPERTS_N)]), w2.scale)
        else:  # [out, 1] per shard → vLLM's [E, 2I, 1] and [E, H, 1]
            assert torch.equal(_w13(s13, EXPERTS_N), w13.scale.unsqueeze(-1))
            assert torch.equal(torch.stack([s2[e]["w2"] for e in range(EXPERTS_N)]), w2.scale.unsqueeze(-1))
        if static:  # one [1] float32 value per expert and shard; gate/up: the shared input scale
            xs, hs = (st.scale(op, "input").float() for op in st.seen_ops)
            a13, a2 = params[f"{base}.w13_input_scale"], params[f"{base}.w2_input_scale"]
            assert all(a13[e][k].shape == (1,) and a13[e][k].dtype == torch.float32
                       and torch.equal(a13[e][k], xs.reshape(1)) for e in range(EXPERTS_N) for k in ("w1", "w3"))
            assert torch.equal(torch.cat([a2[e]["w2"] for e in range(EXPERTS_N)]), hs.reshape(-1).expand(EXPERTS_N))
        assert f"{layer}.{block}.gate.weight" in rest  # the router, high precision, in the same block
    # the scheme vLLM picks for the experts: the "Linear" group (the experts' layer names + ".0.gate_proj")
    group0 = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group0["targets"] == ["Linear"]
    want = ("tensor" if per_tensor else "channel", "token" if not static else "tensor", not static)
    assert (group0["weights"]["strategy"], group0["input_activations"]["strategy"],
            group0["input_activations"]["dynamic"]) == want
    refused = any("vLLM's FP8 MoE takes per-channel weights only with dynamic" in n for n in notes)
    assert refused == (not per_tensor and static)  # vLLM's two accepted combinations are not flagged
    # load_pretrained: the same converted model, bit for bit
    loaded = dq.load_pretrained(tmp_path, build(name, impl))
    for st in states:
        a, b = converted.get_submodule(st.fqn), loaded.get_submodule(st.fqn)
        for p in ("gate_up_proj", "down_proj"):
            wa, wb = a._parameters[p], b._parameters[p]
            assert type(wb) is FP8Weight and torch.equal(wa.qdata.view(torch.uint8), wb.qdata.view(torch.uint8))
            assert torch.equal(wa.scale, wb.scale)
    ev = batches(1, (3, 9), 4)[0]
    with torch.no_grad():
        assert torch.equal(logits(converted(**ev)), logits(loaded(**ev)))


@pytest.mark.parametrize("name,impl", [("mixtral", "grouped_mm"), ("qwen2_moe", "eager")])
def test_transformers_with_compressed_tensors_loads_the_folder(tmp_path, name, impl, close_to_reference):
    """transformers merges the per-expert tensors into its 3-D parameters, dequantizing the FP8 experts to
    bf16 (DecompressExperts: ``(q·s).to(bfloat16)``): each expert value must be ours, rounded to bf16."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    _, _, converted = pipeline(name, impl)
    _save(converted, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for i in range(LAYERS):
        ours = converted.model.layers[i].mlp.experts
        theirs = loaded.model.layers[i].mlp.experts
        for p in ("gate_up_proj", "down_proj"):
            w = ours._parameters[p]
            want = (w.qdata.float() * w.scale.float().unsqueeze(-1)).to(torch.bfloat16)
            assert torch.equal(getattr(theirs, p).to(torch.bfloat16), want)
        assert torch.equal(loaded.model.layers[i].mlp.gate.weight, converted.model.layers[i].mlp.gate.weight)
    ev = batches(1, (3, 9), 4)[0]
    with torch.no_grad():
        a, b = logits(loaded(**ev)), logits(converted(**ev))
    # measured 0.9994 / 0.9992: bf16 expert weights and compressed-tensors' own fake-quantized linears
    close_to_reference(a, b, min_cos=0.998, max_rel=0.05)  # measured 0.031 / 0.025
