"""MoE experts with 3-D weights (transformers 5 ``MixtralExperts`` & co.) in a serving checkpoint.

transformers 5 keeps an MoE layer's experts as one module with fused 3-D parameters (``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]), but the checkpoints on the Hugging Face hub — and the names vLLM's
loaders read — keep one ``Linear``-style entry per expert and projection. So each converted experts module
is written per expert, the way the hub checkpoint of its architecture names it:

* Mixtral family (``model_type`` mixtral / minimax): ``<layer>.block_sparse_moe.experts.<e>.w1`` (gate),
  ``.w3`` (up), ``.w2`` (down), and the whole MoE block under ``block_sparse_moe`` (the router:
  ``block_sparse_moe.gate.weight``). vLLM ``models/mixtral.py`` maps ``experts.<e>.w1/w2/w3.`` with
  ``FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2",
  ckpt_up_proj_name="w3")``; transformers' ``conversion_mapping.py`` ("mixtral") renames
  ``.block_sparse_moe.`` → ``.mlp.`` and merges ``.experts.*.w1/w3.weight`` into ``gate_up_proj``.
* Others (Qwen2-MoE and the architectures transformers maps like it, user models):
  ``<block>.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` (vLLM ``models/qwen2_moe.py``:
  ``ckpt_gate_proj_name="gate_proj"``…; transformers "qwen2_moe": ``mlp.experts.*.gate_proj.weight``…).

Each projection: ``weight`` float8_e4m3fn [out, in]; ``weight_scale`` [out, 1] (per channel), [1] (per
expert: gate and up get the same value), or the block grid / MXFP8's uint8 E8M0 codes [out, ⌈in/32⌉];
``input_scale`` [1] when static — gate and up get the one gate_up input scale, down its expert's own (vLLM's
``CompressedTensorsW8A8Fp8MoEMethod`` loads one per expert and takes the max over experts).
``dbr_quant.json`` keeps under ``experts`` how to stack them back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.safetensors_io import Entry, tensor_entry
from dbr_quant.checkpoints.schemes import Scheme, scale_dtype, scheme
from dbr_quant.kernels.reference.mx import MX_BLOCK, MX_WEIGHT_BLOCK
from dbr_quant.moe.experts import MoeState
from dbr_quant.ops.state import AutoQuantizationState
from dbr_quant.quantize.weights import FP8Weight


class Placer(Protocol):
    """Where loaded tensors go (``assemble.Skeleton``)."""

    def put(self, name: str, value: torch.Tensor) -> None: ...

    def put_fp8(self, name: str, qdata: torch.Tensor, scale: torch.Tensor, transposed: bool,
                block: tuple[int, int] | None) -> None: ...


MIXTRAL_TYPES = ("mixtral", "minimax")  # transformers' conversion_mapping: "minimax" → the "mixtral" rules


def projection_names(model: nn.Module, gated: bool) -> tuple[str, ...]:
    """The checkpoint's per-expert projection names: (gate, up, down) when gated, else (up, down)."""
    mixtral = getattr(getattr(model, "config", None), "model_type", None) in MIXTRAL_TYPES
    if gated:
        return ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    return ("w1", "w2") if mixtral else ("up_proj", "down_proj")


def block_renames(model: nn.Module, experts_fqns: list[str]) -> list[tuple[str, str]]:
    """(model prefix, file prefix) pairs: a Mixtral MoE block ``….mlp.`` is ``….block_sparse_moe.`` on disk."""
    if getattr(getattr(model, "config", None), "model_type", None) not in MIXTRAL_TYPES:
        return []
    out = []
    for fqn in experts_fqns:
        block = fqn.removesuffix(".experts")
        if block != fqn and block.endswith(".mlp"):
            out.append((block + ".", block.removesuffix(".mlp") + ".block_sparse_moe."))
    return out


def rename(name: str, renames: list[tuple[str, str]], reverse: bool = False) -> str:
    for model_prefix, file_prefix in renames:
        src, dst = (file_prefix, model_prefix) if reverse else (model_prefix, file_prefix)
        if name.startswith(src):
            return dst + name[len(src):]
    return name


def converted_experts(states: Sequence[AutoQuantizationState]) -> dict[str, MoeState]:
    """The experts modules that are FP8 (their two 3-D weights), by fqn."""
    return {st.fqn: st for st in states if isinstance(st, MoeState) and st.quantized and st.converted}


def plan_experts(model: nn.Module, st: MoeState, schemes: dict[str, Scheme]
                 ) -> tuple[list[Entry], dict[str, Any]]:
    """The per-expert entries of one experts module (model names; renamed with the rest of the plan) and
    its ``dbr_quant.json`` record; adds each projection's compressed-tensors scheme to ``schemes``."""
    module = model.get_submodule(st.fqn)
    spec = st.spec
    params: list[FP8Weight] = []
    for n in spec.names:
        p = module._parameters[n]
        if not isinstance(p, FP8Weight):
            raise CheckpointError(f"'{st.fqn}': converted experts module without FP8 weights (a dbr_quant bug)")
        params.append(p)
    w1, w2 = params
    names = projection_names(model, spec.gated)
    # per 3-D weight: (weight strategy, activation strategy, dynamic, block, group) — _scheme refuses what the
    # format lacks (E5M2, in_features not whole activation groups), naming the tensor
    proj_schemes = [scheme(f"{st.fqn}.{n}", w, [op]) for n, w, op in zip(spec.names, params, st.seen_ops)]
    wstrat, act, dynamic, block, _ = proj_schemes[0]
    granularity = "mx" if wstrat == "mx" else "block" if block is not None else \
        "channel" if st.seen_ops[0].qconfig.weight.granularity == "channel" else "tensor"
    inputs = [] if dynamic else [st.scale(op, "input").detach().float() for op in st.seen_ops]  # gate_up, down
    biases = [module._parameters.get(f"{n}_bias") if spec.has_bias else None for n in spec.names]
    inter = w1.qdata.shape[1] // 2 if spec.gated else w1.qdata.shape[1]
    # gate / up rows: the two halves of [gate; up], or the even / odd rows when the module interleaves them
    # (GptOssExperts: ``gate_up[..., ::2]`` / ``[..., 1::2]``): each expert's gate_proj is its gate either way
    halves = (slice(0, None, 2), slice(1, None, 2)) if spec.interleaved else (slice(0, inter), slice(inter, 2 * inter))
    # (projection name, which 3-D weight, its rows)
    parts = ([(names[0], 0, halves[0]), (names[1], 0, halves[1]), (names[2], 1, None)]
             if spec.gated else [(names[0], 0, None), (names[1], 1, None)])
    entries: list[Entry] = []
    for e in range(spec.num_experts):
        for pname, which, rows in parts:
            w, b = params[which], biases[which]
            prefix = f"{st.fqn}.{e}.{pname}"
            q = w.qdata[e] if rows is None else w.qdata[e, rows]
            if granularity == "mx":  # E8M0 codes [rows, ⌈K/32⌉] as they are (compressed-tensors' MXFP8 weight_scale)
                s = w.scale[e] if rows is None else w.scale[e, rows]
            elif block is not None:  # gate / up: their own row blocks (moe/ takes I a multiple of bn, not interleaved)
                s = (w.scale[e] if rows is None else
                     w.scale[e, rows.start // block[0]:-(-rows.stop // block[0])]).float()
            else:
                s = w.scale[e] if rows is None or granularity == "tensor" else w.scale[e, rows]
                s = s.float().reshape(-1, 1) if granularity == "channel" else s.float().reshape(1)
            entries.append(Entry(f"{prefix}.weight", q.dtype, tuple(q.shape), q.contiguous))
            entries.append(tensor_entry(f"{prefix}.weight_scale", s, s.dtype if granularity == "mx" else
                                        scale_dtype(s, w.dtype)))
            if b is not None:
                bb = b[e] if rows is None else b[e, rows]
                entries.append(tensor_entry(f"{prefix}.bias", bb, bb.dtype))
            if not dynamic:
                a = inputs[which]  # one value, or one per expert (down; dense experts' gate_up too)
                a = (a[e] if a.numel() > 1 else a).reshape(1)
                entries.append(tensor_entry(f"{prefix}.input_scale", a, scale_dtype(a, w.dtype)))
            schemes[prefix] = proj_schemes[which] if granularity in ("block", "mx") else (granularity, act, dynamic,
                                                                                           None, None)
    info = {"names": list(names), "params": list(spec.names), "num_experts": spec.num_experts, "gated": spec.gated,
            "granularity": granularity, "dynamic": dynamic, "transposed": spec.transposed, "bias": spec.has_bias,
            "dtype": str(w1.dtype).removeprefix("torch.")}
    if block is not None:
        info["block"] = list(block)
    if spec.interleaved:
        info["interleaved"] = True
        info["class"] = type(module).__name__  # what vllm_notes names
    return entries, info


def renamed(entry: Entry, renames: list[tuple[str, str]]) -> Entry:
    return dataclasses.replace(entry, name=rename(entry.name, renames)) if renames else entry


def vllm_notes(infos: dict[str, dict[str, Any]]) -> list[str]:
    """What vLLM's FP8 MoE method (compressed_tensors_moe_w8a8_fp8.py, ``CompressedTensorsW8A8Fp8MoEMethod``)
    does with these experts: it takes per-tensor weights with per-tensor activations, or per-channel weights
    with dynamic per-token activations, and one activation scale per layer (the max over experts)."""
    notes = []
    kinds = {(i["granularity"], i["dynamic"]) for i in infos.values()}
    if ("channel", False) in kinds:
        notes.append("experts with per-channel weight scales and static activation scales: vLLM's FP8 MoE takes "
                     "per-channel weights only with dynamic per-token activations (and per-tensor weights with "
                     "static ones) and will refuse this checkpoint; for vLLM convert the experts with "
                     "weight granularity 'tensor' or dynamic per-token activations (transformers loads it)")
    if any(i["granularity"] == "block" for i in infos.values()):
        # transformers 5.x integrations/compressed_tensors.py DecompressExperts: (q · s) with s broadcast as per
        # channel, which fails on a block grid ("size of tensor a (48) must match ... b (3)"), whoever wrote it
        notes.append("block-scaled experts: transformers' compressed-tensors experts loader (DecompressExperts) "
                     "multiplies FP8 by the scale without expanding blocks and cannot load them; "
                     "dbr_quant.load_pretrained does")
    if any(i["granularity"] == "mx" for i in infos.values()):  # the same DecompressExperts product: [out, in/32]
        notes.append("MXFP8 experts: transformers' compressed-tensors experts loader (DecompressExperts) multiplies "
                     "FP8 by the scale without expanding the 32-channel groups and cannot load them; "
                     "dbr_quant.load_pretrained does")
    if any(not i["dynamic"] for i in infos.values()):
        notes.append("vLLM uses one input scale per MoE layer for all experts (the max of the per-expert scales)")
    # transformers 5.x does not map per-expert gate_proj / up_proj back onto interleaved experts: a GPT-OSS folder
    # loads with logits cosine 0.62 to the saved model (Llama 4's, stacked [gate; up]: 1 − 3e-15). llm-compressor
    # writes GPT-OSS's FP8 experts per expert too, gate_proj / up_proj de-interleaved, as here
    odd = sorted({i["class"] for i in infos.values() if "class" in i})
    if odd:
        notes.append(f"{', '.join(odd)} experts (gate / up interleaved) are saved per expert with gate_proj / "
                     "up_proj de-interleaved, which transformers' from_pretrained does not map back onto these "
                     "modules (its logits are wrong); load the folder with dbr_quant.load_pretrained")
    return notes


# ------------------------------------------------------------------------------------------ loading
def expected_experts(model: nn.Module, meta: dict[str, Any]) -> tuple[dict[str, tuple], set[str]]:
    """(tensor name → (dtypes, shape) of every per-expert tensor, the 3-D parameter names they replace)."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    out: dict[str, tuple] = {}
    replaced: set[str] = set()
    for fqn, info in meta.get("experts", {}).items():
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            raise CheckpointError(f"'{fqn}': the checkpoint has an FP8 experts module of this name, the model has "
                                  "none; build the architecture the checkpoint was saved from") from None
        for pname, layout in zip(info["params"], _layouts(info)):
            p = module._parameters.get(pname)
            if p is None or p.dim() != 3 or p.shape[0] != info["num_experts"]:
                raise CheckpointError(f"'{fqn}.{pname}': the checkpoint has {info['num_experts']} experts, the model "
                                      f"{None if p is None else list(p.shape)}")
            replaced.add(f"{fqn}.{pname}")
            if info["bias"]:
                replaced.add(f"{fqn}.{pname}_bias")
            n_all, k = (p.shape[2], p.shape[1]) if info["transposed"] else (p.shape[1], p.shape[2])
            for e in range(info["num_experts"]):
                for name, rows in layout:
                    n = n_all if rows is None else n_all // 2
                    prefix = f"{fqn}.{e}.{name}"
                    out[f"{prefix}.weight"] = ((torch.float8_e4m3fn,), (n, k))
                    out[f"{prefix}.weight_scale"] = ((torch.uint8,) if info["granularity"] == "mx" else floats,
                                                     _scale_shape(info, n, k))
                    if info["bias"]:
                        out[f"{prefix}.bias"] = ((p.dtype,), (n,))
                    if not info["dynamic"]:
                        out[f"{prefix}.input_scale"] = (floats, (1,))
    return out, replaced


def _scale_shape(info: dict[str, Any], n: int, k: int) -> tuple[int, ...]:
    """One expert projection's weight_scale shape: [⌈n/bn⌉, ⌈k/bk⌉] blocks, [n, ⌈k/32⌉] MX codes, [n, 1] channels,
    [1] tensor."""
    if info["granularity"] == "mx":
        return (n, -(-k // MX_BLOCK))
    if info["granularity"] == "block":
        bn, bk = info["block"]
        return (-(-n // bn), -(-k // bk))
    return (n, 1) if info["granularity"] == "channel" else (1,)


def _layouts(info: dict[str, Any]) -> list[list[tuple[str, int | None]]]:
    """Per 3-D parameter: its projections (name, half: 0 gate / 1 up / None whole)."""
    names = info["names"]
    if info["gated"]:
        return [[(names[0], 0), (names[1], 1)], [(names[2], None)]]
    return [[(names[0], None)], [(names[1], None)]]


def _stacked(fqn: str, info: dict[str, Any], layout: list, values: dict[str, torch.Tensor], key: str,
             ) -> torch.Tensor:
    """One 3-D parameter's ``key`` tensors stacked over the experts: [gate; up] (or gate / up rows interleaved
    back, as the module keeps them: ``info["interleaved"]``)."""
    join = _interleave if info.get("interleaved", False) and len(layout) == 2 else lambda ts: torch.cat(ts, 0)
    return torch.stack([join([values[f"{fqn}.{e}.{name}.{key}"] for name, _ in layout])
                        for e in range(info["num_experts"])])


def _interleave(halves: list[torch.Tensor]) -> torch.Tensor:
    """gate [I, …] and up [I, …] → [2I, …] with gate on the even rows, up on the odd ones."""
    return torch.stack(halves, 1).flatten(0, 1)


def _fp8(fqn: str, info: dict[str, Any], layout: list, values: dict[str, torch.Tensor]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata [E, N, K], scale [E, N] per channel, [E, 1] per expert or [E, row blocks, K blocks]) of one 3-D
    parameter."""
    q = _stacked(fqn, info, layout, values, "weight")
    if info["granularity"] == "mx":  # [E, N, ⌈K/32⌉] E8M0 codes, as convert stores them
        return q, _stacked(fqn, info, layout, values, "weight_scale").contiguous()
    if info["granularity"] == "block":  # [E, gate row blocks + up row blocks, K blocks]
        return q, _stacked(fqn, info, layout, values, "weight_scale").float()
    s = _stacked(fqn, info, layout, values, "weight_scale").float().reshape(q.shape[0], -1)
    if info["granularity"] != "channel":
        if not bool((s == s[:, :1]).all()):
            raise CheckpointError(f"'{fqn}': per-expert weight scales differ between gate and up; the converted "
                                  "model holds one per expert")
        s = s[:, :1].contiguous()
    return q, s


def place_experts(skeleton: Placer, meta: dict[str, Any], values: dict[str, torch.Tensor]) -> None:
    """Each experts module's 3-D parameters as FP8, stacked back from the per-expert tensors (popped from
    ``values`` as they are stacked: one module's experts held twice at most)."""
    for fqn, info in meta.get("experts", {}).items():
        block = tuple(info["block"]) if "block" in info else MX_WEIGHT_BLOCK if info["granularity"] == "mx" else None
        for pname, layout in zip(info["params"], _layouts(info)):
            q, s = _fp8(fqn, info, layout, values)
            skeleton.put_fp8(f"{fqn}.{pname}", q, s, info["transposed"], block)
            if info["bias"]:
                skeleton.put(f"{fqn}.{pname}_bias", _stacked(fqn, info, layout, values, "bias"))
            for e in range(info["num_experts"]):
                for name, _ in layout:
                    for key in ("weight", "weight_scale", "bias", "input_scale"):
                        values.pop(f"{fqn}.{e}.{name}.{key}", None)


def check_experts_as_saved(meta: dict[str, Any], states: Sequence[AutoQuantizationState]) -> None:
    """Each FP8 experts module of the folder is one the trace runs in FP8, laid out as saved."""
    traced = converted_experts(states)
    for fqn, info in meta.get("experts", {}).items():
        st = traced.get(fqn)
        if st is None:
            raise CheckpointError(f"'{fqn}': saved as FP8 experts, but this trace runs them in high precision")
        block = tuple(info["block"]) if "block" in info else None
        cfg = st.seen_ops[0].qconfig.weight
        if (info["granularity"] == "mx") != (cfg.granularity == "mx"):
            raise CheckpointError(f"'{fqn}': saved with {info['granularity']} weight scales, traced with "
                                  f"{cfg.granularity}; load with the QConfig the folder was saved with")
        if info.get("interleaved", False) != st.spec.interleaved:
            raise CheckpointError(f"'{fqn}': saved with gate / up rows {_row_layout(info.get('interleaved', False))}, "
                                  "this model's experts module keeps them "
                                  f"{_row_layout(st.spec.interleaved)}; load into the architecture it was saved from")
        if (block, info["transposed"]) != (tuple(cfg.block) if cfg.granularity == "block" else None,
                                           st.spec.transposed):
            raise CheckpointError(f"'{fqn}': saved with weight blocks {block} (transposed {info['transposed']}), "
                                  f"traced with {cfg.block if cfg.granularity == 'block' else None} (transposed "
                                  f"{st.spec.transposed})")


def _row_layout(interleaved: bool) -> str:
    return "interleaved (gate even, up odd)" if interleaved else "stacked [gate; up]"


def file_to_model_names(stored: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The folder's tensors keyed by the model's names (a Mixtral block's ``block_sparse_moe`` → ``mlp``)."""
    renames = [tuple(r) for r in meta.get("renames", [])]
    if not renames:
        return stored
    return {rename(name, renames, reverse=True): t for name, t in stored.items()}

