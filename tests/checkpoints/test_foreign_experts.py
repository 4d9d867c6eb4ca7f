"""MoE experts in FP8 folders of other tools (``dbr_quant/checkpoints/foreign_experts.py``): compressed-tensors
folders of a tiny Mixtral (``block_sparse_moe.experts.<e>.w1/w3/w2``) and Qwen2-MoE (``mlp.experts.<e>.gate_proj``
…) built to the published layout — compressed-tensors 0.20's ``ModelCompressor`` quantizes ``Linear`` modules
only, and transformers 5 keeps the experts as 3-D parameters, so it writes no experts here; the layout is the one
llm-compressor writes from the per-expert ``Linear`` modules of transformers 4 and vLLM reads
(``fused_moe/layer.py`` ``FusedMoE.make_expert_params_mapping``; ``compressed_tensors_moe_w8a8_fp8.py``): each
projection quantized on its own (amax / 448 per tensor, per channel or per block), a static input scale per
expert and projection measured on the tokens routed to it (as llm-compressor's observers on each expert's
``Linear`` see them).

Loaded by ``load_pretrained`` into dbr_quant's FP8 MoE block and compared with an independent plain-torch model of
the folder as vLLM computes it: dequantized weights, inputs fake-quantized (the gate/up input with the largest
of the experts' scales, vLLM's rule; the down input with each expert's own; dynamic: per token); the FP8 bytes
are the file's, bit for bit, and the dequantized expert weights equal the file's ``weight · weight_scale``.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_compressed_tensors import compare
from test_moe import EXPERTS_N, LAYERS, batches, build, logits
from torch import nn

import dbr_quant as dq
from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.moe.experts import MoeState
from dbr_quant.quantize.weights import FP8Weight

E4M3_MAX = 448.0
# compressed-tensors QuantizationArgs (quant_args.py) of the presets FP8 / FP8_DYNAMIC and a block scheme small
# enough for the tiny model (FP8_BLOCK's 128×128 would exceed its 32 hidden channels)
SCHEMES = {
    "FP8": ({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False}),
    "FP8_DYNAMIC": ({"strategy": "channel"}, {"strategy": "token", "dynamic": True}),
    "FP8_BLOCK16": ({"strategy": "block", "block_structure": [16, 16]},
                    {"strategy": "group", "group_size": 16, "dynamic": True}),
}
# the Hub's ``quant_method: "fp8"`` (DeepSeek-V3 / Qwen3-MoE-FP8 layout, hf_fp8.py): 16×16 blocks, dynamic 1×16
# groups, the scale named ``weight_scale_inv``
SCHEMES["HUB_FP8_BLOCK16"] = SCHEMES["FP8_BLOCK16"]
REL_TO_REFERENCE = 2e-6  # measured 1.3e-7 … 1.9e-7 (fp32 summation order; one flipped FP8 code would be ~1e-3)
NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}


def _args(extra: dict) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, **extra}


def _quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 bytes, dequantization scale in the compressed-tensors layout: [1], [out, 1] or the block grid)."""
    w = w.float()
    if strategy == "block":
        n, k = w.shape
        blocks = w.reshape(n // 16, 16, k // 16, 16)
        s = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
        q = (blocks / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).reshape(n, k).to(torch.float8_e4m3fn)
        return q, s
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    s = (amax / E4M3_MAX).clamp(min=1e-12)
    return (w / (s if strategy == "channel" else s.reshape(()))).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def _weight_scale(stored: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    name = f"{prefix}.weight_scale"
    return stored[name] if name in stored else stored[f"{name}_inv"]


def _dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if s.dim() == 2 and s.shape[1] > 1 or (s.dim() == 2 and s.shape[0] != q.shape[0]):  # block grid
        return q.float() * s.repeat_interleave(16, 0).repeat_interleave(16, 1)
    return q.float() * (s if s.dim() == 2 else s.reshape(()))


def _routed_amax(model: nn.Module, calibration: list[dict]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per experts module: per expert (amax of the hidden states routed to it, amax of its act(gate)·up)."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for fqn, mod in model.named_modules():
        if hasattr(mod, "gate_up_proj") and mod.gate_up_proj.dim() == 3:
            def hook(m, args, fqn=fqn):
                x, ids = args[0], args[1]
                a_in, a_h = seen.get(fqn, (torch.zeros(EXPERTS_N), torch.zeros(EXPERTS_N)))
                inter = m.gate_up_proj.shape[1] // 2
                for e in range(EXPERTS_N):
                    rows = (ids == e).any(-1)
                    if rows.any():
                        xe = x[rows].float()
                        gate, up = (xe @ m.gate_up_proj[e].float().t()).split(inter, -1)
                        a_in[e] = max(a_in[e], xe.abs().amax())
                        a_h[e] = max(a_h[e], (m.act_fn(gate) * up).abs().amax())
                seen[fqn] = (a_in, a_h)
            handles.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        for batch in calibration:
            model(**batch)
    for h in handles:
        h.remove()
    return {fqn: (torch.where(a > 0, a, a.max()), torch.where(h > 0, h, h.max())) for fqn, (a, h) in seen.items()}


def ct_moe_folder(model: nn.Module, name: str, folder: Path, scheme: str, calibration: list[dict]) -> None:
    """The compressed-tensors folder llm-compressor writes for this model with ``scheme`` (module docstring)."""
    w_args, a_args = SCHEMES[scheme]
    strategy, static = w_args["strategy"], not a_args["dynamic"]
    gate, up, down = NAMES[name]
    routed = _routed_amax(model, calibration) if static else {}
    linear_in: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_pre_hook(lambda m, a, fqn=fqn: linear_in.__setitem__(fqn, torch.maximum(
        linear_in.get(fqn, torch.zeros(())), a[0].detach().abs().amax().float())))
        for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for batch in calibration:
            model(**batch)
    for h in handles:
        h.remove()
    block = "block_sparse_moe" if name == "mixtral" else "mlp"
    state: dict[str, torch.Tensor] = {}

    def put_linear(prefix: str, w: torch.Tensor, amax_in: torch.Tensor | None) -> None:
        q, s = _quantize(w, strategy)
        scale_name = "weight_scale_inv" if scheme.startswith("HUB") else "weight_scale"
        state[f"{prefix}.weight"], state[f"{prefix}.{scale_name}"] = q, s
        if static:
            assert amax_in is not None
            state[f"{prefix}.input_scale"] = (amax_in / E4M3_MAX).reshape(1).float()

    for fqn, mod in model.named_modules():
        file_fqn = fqn.replace(".mlp.", f".{block}.") if name == "mixtral" else fqn
        for pname, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if pname in mod._non_persistent_buffers_set:
                continue
            full = f"{file_fqn}.{pname}" if fqn else pname
            if pname == "gate_up_proj" and t.dim() == 3:  # the experts, one Linear-style entry each
                inter = t.shape[1] // 2
                a_in, a_h = routed.get(fqn, (None, None))
                for e in range(t.shape[0]):
                    p = f"{file_fqn}.{e}"
                    put_linear(f"{p}.{gate}", t[e, :inter].detach(), None if a_in is None else a_in[e])
                    put_linear(f"{p}.{up}", t[e, inter:].detach(), None if a_in is None else a_in[e])
                    put_linear(f"{p}.{down}", mod.down_proj[e].detach(), None if a_h is None else a_h[e])
            elif pname == "down_proj" and t.dim() == 3:
                continue
            elif isinstance(mod, nn.Linear) and pname == "weight" and fqn != "lm_head" and t.shape[0] % 16 == 0:
                put_linear(file_fqn, t.detach(), linear_in.get(fqn))
            else:
                state[full] = t.detach().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
                                  "modules_to_not_convert": ["lm_head"]} if scheme.startswith("HUB") else {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _args(w_args),
                                      "input_activations": _args(a_args), "format": "float-quantized"}},
        "ignore": ["lm_head", f"re:.*{block}.gate$", "re:.*shared_expert_gate$"]}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def reference(model: nn.Module, name: str, folder: Path) -> nn.Module:
    """``model`` computing what the folder says as vLLM runs it, in plain torch (module docstring)."""
    stored = load_file(folder / "model.safetensors")
    gate, up, down = NAMES[name]
    block = "block_sparse_moe" if name == "mixtral" else "mlp"
    ref = copy.deepcopy(model).float()

    def fake_quant(x: torch.Tensor, s: torch.Tensor | None, group: int | None) -> torch.Tensor:
        if s is None:
            xs = x.reshape(*x.shape[:-1], -1, group or x.shape[-1])
            s = (xs.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
            return ((xs * (1 / s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s).reshape(x.shape)
        return (x * (1 / s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    group = 16 if "group_size" in json.dumps(qc) or qc.get("weight_block_size") else None
    for fqn, mod in list(ref.named_modules()):
        file_fqn = fqn.replace(".mlp.", f".{block}.") if name == "mixtral" else fqn
        if isinstance(mod, nn.Linear) and f"{file_fqn}.weight" in stored and stored[f"{file_fqn}.weight"].dtype == \
                torch.float8_e4m3fn:
            w = _dequantized(stored[f"{file_fqn}.weight"], _weight_scale(stored, file_fqn))
            s_in = stored.get(f"{file_fqn}.input_scale")

            def linear(x, mod=mod, w=w, s_in=s_in):
                return F.linear(fake_quant(x.float(), s_in, group), w, None if mod.bias is None else mod.bias.float())

            mod.forward = linear
        elif hasattr(mod, "gate_up_proj") and mod.gate_up_proj.dim() == 3:
            p = f"{file_fqn}.{{}}.{{}}"
            w13 = [torch.cat([_dequantized(stored[p.format(e, n) + ".weight"], _weight_scale(stored, p.format(e, n)))
                              for n in (gate, up)]) for e in range(EXPERTS_N)]
            w2 = [_dequantized(stored[p.format(e, down) + ".weight"], _weight_scale(stored, p.format(e, down)))
                  for e in range(EXPERTS_N)]
            static = p.format(0, gate) + ".input_scale" in stored
            s13 = max(float(stored[p.format(e, n) + ".input_scale"]) for e in range(EXPERTS_N) for n in (gate, up)) \
                if static else None
            s2 = [stored[p.format(e, down) + ".input_scale"] if static else None for e in range(EXPERTS_N)]

            def experts(x, ids, weights, mod=mod, w13=w13, w2=w2, s13=s13, s2=s2):
                x = x.float()
                xq = fake_quant(x, None if s13 is None else torch.tensor(s13), group)
                out = torch.zeros_like(x)
                for e in range(EXPERTS_N):
                    tok, slot = torch.where(ids == e)
                    if tok.numel():
                        g, u = (xq[tok] @ w13[e].t()).chunk(2, -1)
                        h = fake_quant(mod.act_fn(g) * u, s2[e], group)
                        out.index_add_(0, tok, (h @ w2[e].t()) * weights[tok, slot, None].float())
                return out

            mod.forward = experts
    return ref


@pytest.mark.parametrize("name,scheme,impl", [("mixtral", "FP8", "eager"), ("mixtral", "FP8_DYNAMIC", "grouped_mm"),
                                              ("qwen2_moe", "FP8", "batched_mm"), ("mixtral", "FP8_BLOCK16", "eager"),
                                              ("qwen2_moe", "FP8_DYNAMIC", "eager"),
                                              ("qwen2_moe", "HUB_FP8_BLOCK16", "grouped_mm")])
def test_experts_under_vllm_names_load_into_the_fp8_moe_block(tmp_path, name, scheme, impl):
    model = build(name, impl)
    ct_moe_folder(model, name, tmp_path, scheme, batches(3, (2, 16), 2))
    before = copy.deepcopy(model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = dq.load_pretrained(tmp_path, model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the given model untouched
    stored = load_file(tmp_path / "model.safetensors")
    gate, up, down = NAMES[name]
    block = "block_sparse_moe" if name == "mixtral" else "mlp"
    states = [st for st in loaded.__dict__["_dbr_record"].states if isinstance(st, MoeState)]
    assert len(states) == LAYERS and all(st.quantized for st in states)
    for st in states:
        module = loaded.get_submodule(st.fqn)
        p = st.fqn.replace(".mlp.", f".{block}.") + ".{}.{}"
        w13, w2 = module._parameters["gate_up_proj"], module._parameters["down_proj"]
        assert type(w13) is FP8Weight and type(w2) is FP8Weight
        for e in range(EXPERTS_N):  # the file's bytes, and its dequantized values, exactly
            want13 = torch.cat([stored[p.format(e, n) + ".weight"] for n in (gate, up)])
            assert torch.equal(w13.qdata[e].view(torch.uint8), want13.view(torch.uint8))
            assert torch.equal(w2.qdata[e].view(torch.uint8), stored[p.format(e, down) + ".weight"].view(torch.uint8))
            deq13 = torch.cat([_dequantized(stored[p.format(e, n) + ".weight"], _weight_scale(stored, p.format(e, n)))
                               for n in (gate, up)])
            assert torch.equal(w13.dequantize(torch.float32)[e], deq13)
        if scheme == "FP8":  # gate/up input: the largest of the experts' scales; down: each expert's own
            s13 = max(float(stored[p.format(e, n) + ".input_scale"]) for e in range(EXPERTS_N) for n in (gate, up))
            assert float(st.scale(st.seen_ops[0], "input")) == s13
            assert torch.equal(st.scale(st.seen_ops[1], "input").reshape(-1),
                               torch.cat([stored[p.format(e, down) + ".input_scale"] for e in range(EXPERTS_N)]))
    differ = [str(w.message) for w in caught if "input scales differ" in str(w.message)]
    assert bool(differ) == (scheme == "FP8")  # llm-compressor's per-expert observers see different tokens
    inputs = batches(1, (3, 12), 7)[0]
    with torch.no_grad():
        ours, ref = logits(loaded(**inputs)), logits(reference(model, name, tmp_path)(**inputs))
        compare(ours, ref, logits(model(**inputs)), f"{name} {scheme}", "plain torch (vLLM's computation)")
    rel = float((ours - ref).norm() / ref.norm())
    print(f"  relative difference to the plain-torch model {rel:.2e}")
    assert rel < REL_TO_REFERENCE


@pytest.mark.parametrize("name,scheme", [("mixtral", "FP8"), ("mixtral", "FP8_DYNAMIC"), ("qwen2_moe", "FP8")])
def test_transformers_loads_the_same_folder_as_far_from_high_precision(tmp_path, name, scheme):
    """Software we did not write reads the folder (transformers 5 merges the per-expert entries into its 3-D
    parameters, conversion_mapping.py; compressed-tensors dequantizes them, DecompressExperts): the same distance
    to the high-precision model within 0.0005, and agreement above it. transformers computes the experts on
    high-precision inputs; measured: distances 0.99757 / 0.99796 (mixtral FP8), 0.99836 / 0.99831, 0.99746 /
    0.99750; agreement 0.9995 / 0.9998 / 0.9997."""
    from transformers import AutoModelForCausalLM

    model = build(name, "eager")
    ct_moe_folder(model, name, tmp_path, scheme, batches(3, (2, 16), 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        ours = dq.load_pretrained(tmp_path, model)
    inputs = batches(1, (3, 12), 7)[0]
    with torch.no_grad():
        compare(logits(ours(**inputs)), logits(theirs(**inputs)).float(), logits(model(**inputs)), f"{name} {scheme}")


def test_experts_that_dbr_quant_cannot_run_are_refused_naming_the_tensor(tmp_path):
    model = build("mixtral", "eager")
    ct_moe_folder(model, "mixtral", tmp_path, "FP8_DYNAMIC", batches(1, (2, 8), 2))
    stored = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight_scale"
    stored[name] = stored[name][:5]
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight_scale: the "
                       r"checkpoint holds float32 \[5, 1\], the model needs \[64, 1\]"):
        dq.load_pretrained(tmp_path, model)
    stored[name] = torch.full((64, 1), float("nan"))
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.3\.w3\.weight_scale: a scale must be a positive finite"):
        dq.load_pretrained(tmp_path, model)


def test_dynamic_experts_recalibrated_to_static_scales_save_and_reload(tmp_path):
    """An FP8_DYNAMIC MoE folder → ``recalibrate=True`` → calibrate → convert: the file's FP8 expert bytes kept, a
    static gate_up scale and one down scale per expert; saved by dbr_quant (vLLM's names) and reloaded bit for
    bit."""
    model = build("mixtral", "eager")
    ct_moe_folder(model, "mixtral", tmp_path / "dynamic", "FP8_DYNAMIC", batches(1, (2, 8), 2))
    stored = load_file(tmp_path / "dynamic" / "model.safetensors")
    prepared = dq.load_pretrained(tmp_path / "dynamic", model, recalibrate=True)
    dq.calibrate(prepared, batches(3, (2, 16), 3), progress=False)
    converted = dq.convert(prepared, inplace=True)
    states = [st for st in converted.__dict__["_dbr_record"].states if isinstance(st, MoeState)]
    assert len(states) == LAYERS and all(st.static and st.quantized for st in states)
    for st in states:
        w13 = converted.get_submodule(st.fqn)._parameters["gate_up_proj"]
        p = st.fqn.replace(".mlp.", ".block_sparse_moe.") + ".{}.{}.weight"
        want = torch.stack([torch.cat([stored[p.format(e, n)] for n in ("w1", "w3")]) for e in range(EXPERTS_N)])
        assert type(w13) is FP8Weight and torch.equal(w13.qdata.view(torch.uint8), want.view(torch.uint8))
        assert st.scale(st.seen_ops[1], "input").numel() == EXPERTS_N
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dq.save_pretrained(converted, tmp_path / "static")
    reloaded = dq.load_pretrained(tmp_path / "static", build("mixtral", "eager"))
    inputs = batches(1, (3, 12), 7)[0]
    with torch.no_grad():
        assert torch.equal(logits(converted(**inputs)), logits(reloaded(**inputs)))
