"""From a converted model to the compressed-tensors ``float-quantized`` layout: which tensors, in which
dtype and shape, under which name, and the ``quantization_config`` that describes them.

The mapping (each choice also in the README, "Save for serving"):

* An FP8 ``nn.Linear``: ``weight`` float8_e4m3fn [out, in]; ``weight_scale`` [out, 1] per channel or [1]
  per tensor; ``input_scale`` [1] when activations are static (dynamic: none, and the scheme says
  ``dynamic: true`` with strategy ``tensor`` or ``token``); ``bias`` as is. A gate/up pair stacked into one
  buffer is written as the two modules' own tensors.
* MXFP8 (``QConfig.mxfp8()``): compressed-tensors' MXFP8 preset, format ``mxfp8-quantized``, weights and
  (dynamic) input activations strategy ``group`` with ``group_size`` 32 and ``scale_dtype`` uint8;
  ``weight_scale`` uint8 [out, in/32], the E8M0 codes (an ``in_features`` not a multiple of 32 is refused).
* Weight-only (``QConfig.fp8_weight_only()``): vLLM's ``CompressedTensorsW8A16Fp8`` layout, weights strategy
  ``channel`` (or ``tensor``), ``input_activations`` null, no ``input_scale``.
* Block-scaled (``QConfig.fp8_block()``): compressed-tensors' FP8_BLOCK scheme, ``weights`` strategy
  ``block`` with ``block_structure`` [bn, bk], ``weight_scale`` float32 [⌈out/bn⌉, ⌈in/bk⌉];
  ``input_activations`` strategy ``group`` (``group_size`` bk, dynamic). An ``in_features`` that is not a
  multiple of the group is refused: compressed-tensors' group fake-quantization raises on it and vLLM's /
  SGLang's per-token-group kernels assert whole groups (ragged *rows* are fine everywhere).
* Scale dtype: the model's dtype when that holds the fp32 scale exactly (always for fp32 models), else
  float32. transformers creates scale parameters in the model's dtype and rounds a float32 scale into
  it when loading (≤ 2⁻⁹ relative); vLLM's scale parameters are float32 and keep it exact. Writing the
  rounded value instead would change every loader's numbers, and lose the exact scale for
  ``load_pretrained``.
* A linear called at several call sites has a scale per site: the file gets the largest (no site
  saturates; the others lose a little resolution) and a warning says so. ``dbr_quant.json`` keeps all.
* Linears that stay high precision (and every module compressed-tensors would otherwise match as a
  ``Linear``) go to ``ignore``.
* E5M2 weights or activations: compressed-tensors' FP8 is E4M3 only, so saving raises.
* Hugging Face ``Conv1D`` (GPT-2): compressed-tensors quantizes ``nn.Linear`` only, so its FP8 weight has
  no form transformers loads; it is written dequantized (its FP8 values × scale, exact in the model's
  dtype) and listed in ``ignore``; ``load_pretrained`` re-quantizes it exactly with the scale kept in
  ``dbr_quant.json``.
* FP8 attention (``quantize_attention=True``): per attention layer ``k_scale`` / ``v_scale`` [1] and a
  ``kv_cache_scheme`` with strategy ``tensor``; with ``attention_scales="head"`` one value per KV head,
  [num_key_value_heads, 1, 1], and strategy ``attn_head`` (the shape compressed-tensors' initialize_qparams gives
  an ``attn_head`` k/v scale; vLLM's CompressedTensorsKVCacheMethod flattens it into its [num_kv_heads] k_scale
  and shards it by kv head under tensor parallelism). Only when every layer compressed-tensors treats as
  KV-cached attention has static k/v scales; otherwise (and for q, and for activation × activation matmuls)
  loaders run attention in high precision and a warning says so.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from dbr_quant import kernels
from dbr_quant.checkpoints import experts
from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.safetensors_io import Entry, tensor_entry
from dbr_quant.checkpoints.schemes import Scheme, quantization_config, scale_dtype, scheme
from dbr_quant.formats import FP8Format
from dbr_quant.ops.heads import fit_heads
from dbr_quant.ops.mappings import LINEAR, MATMUL, SDPA
from dbr_quant.ops.state import AutoQuantizationState, SeenOp
from dbr_quant.ops.tags import tag_of
from dbr_quant.qconfig import QConfig
from dbr_quant.quantize.weights import FP8Weight, fp8_weight_of

# compressed-tensors' is_cached_attention_module (0.20): these names mark a KV-cached attention module
_ATTENTION_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "kv_b_proj", "q_a_proj", "kv_proj", "q")
_KV_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "kv_b_proj")


@dataclass
class Plan:
    """Everything a save writes, before anything is written."""

    groups: list[tuple[str, list[Entry]]] = field(default_factory=list)  # one per module, in model order
    quantization_config: dict[str, Any] = field(default_factory=dict)
    linears: dict[str, dict[str, Any]] = field(default_factory=dict)  # FP8 linears: how each is stored
    aliases: dict[str, str] = field(default_factory=dict)  # tensor written once under another name
    stacked: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what loaders will run differently (one warning)
    experts: dict[str, dict[str, Any]] = field(default_factory=dict)  # FP8 experts modules (experts.py)
    renames: list[tuple[str, str]] = field(default_factory=list)  # model prefix → file prefix (experts.py)


class ConvertedRecord(Protocol):
    """What saving reads of a converted model's record (``runtime.runs.ModelRecord``)."""

    phase: str
    qconfig: QConfig
    states: Sequence[AutoQuantizationState]
    example: tuple[tuple[Any, ...], dict[str, Any]] | None


def record_of(model: nn.Module) -> ConvertedRecord:
    record: ConvertedRecord | None = model.__dict__.get("_dbr_record")
    if record is None or record.phase != "converted":
        raise TypeError("dbr_quant.save_pretrained() needs a model returned by dbr_quant.convert()")
    return record


def model_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's own modules (dbr_quant's per-module states and their observers left out)."""
    out, skip = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, AutoQuantizationState):
            skip.append(name + ".")
            continue
        if not any(name.startswith(s) for s in skip):
            out.append((name, mod))
    return out


def own_tensors(mod: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers a state_dict would hold for this module itself."""
    out: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in mod._parameters.items() if p is not None]
    out += [(n, b) for n, b in mod._buffers.items() if b is not None and n not in mod._non_persistent_buffers_set]
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_ct_linear(mod: nn.Module) -> bool:
    """What compressed-tensors' target "Linear" matches: a class named Linear anywhere in the MRO."""
    return any(c.__name__ == "Linear" for c in type(mod).__mro__)


def is_cached_attention(mod: nn.Module) -> bool:
    """compressed-tensors' rule for the modules a ``kv_cache_scheme`` applies to (every one of them)."""
    if "attention" not in type(mod).__name__.lower() or not any(hasattr(mod, n) for n in _KV_PROJECTIONS):
        return False
    try:
        params = inspect.signature(mod.forward).parameters
    except (TypeError, ValueError):
        return False
    return "past_key_values" in params or "past_key_value" in params


# ------------------------------------------------------------------------------------------ the plan
def _linear_input_scales(model: nn.Module,
                         record: ConvertedRecord) -> dict[str, list[tuple[AutoQuantizationState, SeenOp]]]:
    """The call sites of each Linear module's weight: its module calls, and the functional linears that read
    its whole weight (:func:`_functional_owner`)."""
    sites: dict[str, list] = defaultdict(list)
    for st in record.states:
        for op in st.seen_ops:
            owner = op.weight_owner if op.weight_owner is not None else _functional_owner(model, op)
            if op.kind == LINEAR and owner is not None:
                sites[owner].append((st, op))
    return sites


def _functional_owner(model: nn.Module, op: SeenOp) -> str | None:
    """The Linear module whose whole ``weight`` the functional linear ``op`` reads as W, stored in FP8: Falcon's
    ``FalconLinear`` (an nn.Linear whose forward is ``x @ self.weight.T + bias``) is such a Linear to
    compressed-tensors (its target matches the class name) and to vLLM; None for any other weight operand."""
    ref = op.weight_param
    if op.kind != LINEAR or ref is None or ref.per_call or ref.transposed or ref.rows != (0, ref.out) \
            or not ref.name.endswith(".weight"):
        return None
    fqn = ref.name.removesuffix(".weight")
    return fqn if _is_ct_linear(model.get_submodule(fqn)) else None


def _kv_heads(mod: nn.Module, observed: int) -> int:
    """The KV heads of an attention module (its config's num_key_value_heads, as vLLM counts them), else the
    count its per-head scales were calibrated on."""
    heads = getattr(getattr(mod, "config", None), "num_key_value_heads", None)
    return heads if isinstance(heads, int) and heads > 0 else observed


def kv_file_scale(scales: list[torch.Tensor], mod: nn.Module, what: str) -> torch.Tensor:
    """The file's k or v scale of one attention module: the largest over its call sites, [1] per tensor or
    [num_kv_heads, 1, 1] per head (scales calibrated on repeated kv heads are equal within a group)."""
    if all(s.dim() == 0 for s in scales):
        return torch.stack(scales).max().reshape(1)
    heads = _kv_heads(mod, max(s.numel() for s in scales))
    fitted = [fit_heads(s.reshape(-1).expand(heads) if s.numel() == 1 else s, heads, what) for s in scales]
    return torch.stack(fitted).amax(dim=0).reshape(heads, 1, 1)


def _kv_scales(model: nn.Module, record: ConvertedRecord, plan: Plan) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per attention module: (k_scale, v_scale) fp32, [1] or per KV head [H_kv, 1, 1], when the whole model can
    carry a kv_cache_scheme."""
    found: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    dynamic = matmuls = 0
    for st in record.states:
        for op in st.seen_ops:
            if op.kind == SDPA and op.quantize:
                if op.qconfig.dynamic or op.qconfig.activation.format != FP8Format.E4M3:
                    dynamic += 1
                else:
                    found[st.fqn].append((st.scale(op, "k").float(), st.scale(op, "v").float()))
            elif op.kind == MATMUL and op.quantize:
                matmuls += 1
    if matmuls:
        plan.notes.append(f"{matmuls} activation × activation matmul(s) run in FP8 here; the format has no place "
                          "for them, so loaders run them in high precision")
    if dynamic:
        plan.notes.append(f"{dynamic} attention op(s) use dynamic or E5M2 scales; a kv_cache_scheme needs static "
                          "E4M3 k/v scales, so loaders run that attention in high precision")
    if not found:
        return {}
    cached = [fqn for fqn, mod in model_modules(model) if is_cached_attention(mod)]
    missing = [fqn for fqn in cached if fqn not in found]
    if not cached or missing:
        why = (f"attention layer(s) {missing[:3]} have no static k/v scales" if cached else
               "no module is KV-cached attention as compressed-tensors sees it (class name with 'attention', "
               "k_proj/v_proj, a past_key_values argument)")
        plan.notes.append(f"FP8 attention is not written ({why}): loaders run attention in high precision; q "
                          "scales are never part of the format")
        return {}
    out, extra = {}, [fqn for fqn in found if fqn not in cached]
    for fqn in cached:
        pairs, mod = found[fqn], model.get_submodule(fqn)
        out[fqn] = (kv_file_scale([k for k, _ in pairs], mod, _join(fqn, "k_scale")),
                    kv_file_scale([v for _, v in pairs], mod, _join(fqn, "v_scale")))
        if len(pairs) > 1:
            plan.notes.append(f"attention '{fqn}' runs at {len(pairs)} call sites: its k/v scales are the largest")
    if extra:
        plan.notes.append(f"FP8 attention in {extra[:3]} is not KV-cached attention: loaders run it in high precision")
    plan.notes.append("q is not quantized by loaders (the format carries k/v scales only)")
    return out


def _refuse_functional_fp8(model: nn.Module, record: ConvertedRecord) -> None:
    """compressed-tensors stores FP8 per Linear module (weight + input_scale, matched by module class); a parameter
    that a functional linear reads in FP8 (param_weights.py: an attention's in_proj_weight, F.linear(x, self.w),
    x @ A.t()) has no place there, and a loader would read its bytes as a high-precision weight."""
    params = dict(model.named_parameters())
    ops = [op for st in record.states for op in st.seen_ops if op.weight_param is not None]
    as_linear = {op.weight_param.name for op in ops if _functional_owner(model, op) is not None}
    stored = sorted({op.weight_param.name for op in ops if isinstance(params.get(op.weight_param.name), FP8Weight)}
                    - {name for name in as_linear
                       if all(_functional_owner(model, op) for op in ops if op.weight_param.name == name)})
    if stored:
        raise CheckpointError(
            f"save_pretrained(): {len(stored)} FP8 weight(s) are read by functional linears, not by Linear modules "
            f"({', '.join(stored[:4])}{', …' if len(stored) > 4 else ''}), which the compressed-tensors format "
            "cannot describe. Save with torch.save(model.state_dict()) (FP8 bytes + scales) and load into a model "
            "converted the same way, or prepare with QConfig(overrides=(Override(pattern=..., skip=True),)) for "
            "those ops to keep them high precision.")


def build_plan(model: nn.Module) -> Plan:
    """Map a converted model to tensor groups and a quantization_config; raises before anything is written."""
    record = record_of(model)
    _refuse_functional_fp8(model, record)
    plan = Plan()
    sites = _linear_input_scales(model, record)
    kv = _kv_scales(model, record, plan)
    names = {id(mod): fqn for fqn, mod in model_modules(model)}
    schemes: dict[str, Scheme] = {}
    ignore: list[str] = []
    multi_site: list[str] = []
    seen: dict[tuple, str] = {}
    moe = experts.converted_experts(record.states)
    for fqn, mod in model_modules(model):
        w = fp8_weight_of(mod)
        entries: list[Entry] = []
        if fqn in moe:  # 3-D FP8 experts: written per expert, as the hub checkpoints name them (experts.py)
            entries, plan.experts[fqn] = experts.plan_experts(model, moe[fqn], schemes)
        for pname, t in own_tensors(mod):
            name = _join(fqn, pname)
            if fqn in moe and pname.removesuffix("_bias") in moe[fqn].spec.names:
                continue
            if w is not None and pname == "weight":
                entries += _fp8_linear_entries(fqn, mod, w, sites.get(fqn, []), plan, schemes, ignore, multi_site)
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if t.numel() and key in seen:  # tied weights: written once, as Hugging Face does
                plan.aliases[name] = seen[key]
                continue
            seen[key] = name
            entries.append(tensor_entry(name, t))
        if w is None and _is_ct_linear(mod) and "weight" in mod._parameters:
            ignore.append(fqn)
        if fqn in kv:
            k, v = kv[fqn]
            entries += [tensor_entry(_join(fqn, "k_scale"), k, scale_dtype(k, _module_dtype(mod))),
                        tensor_entry(_join(fqn, "v_scale"), v, scale_dtype(v, _module_dtype(mod)))]
        stacked_after = tag.stacked_after if (tag := tag_of(mod)) is not None else None
        if stacked_after is not None and w is not None:
            plan.stacked.append([names[id(stacked_after)], fqn])
        if entries:
            plan.groups.append((fqn, entries))
    if multi_site:
        plan.notes.append(f"{len(multi_site)} linear(s) run at several call sites with different input scales; "
                          f"the file holds the largest of each ({', '.join(multi_site[:4])})")
    _check_vllm_fused(schemes, ignore, plan)
    plan.notes += experts.vllm_notes(plan.experts)
    plan.renames = experts.block_renames(model, list(plan.experts))
    if plan.renames:
        plan.groups = [(g, [experts.renamed(e, plan.renames) for e in entries]) for g, entries in plan.groups]
        schemes = {experts.rename(k, plan.renames): v for k, v in schemes.items()}
        ignore = [experts.rename(k, plan.renames) for k in ignore]
    per_head = any(k.dim() == 3 for k, _ in kv.values())
    plan.quantization_config = quantization_config(schemes, ignore, ("attn_head" if per_head else "tensor") if kv
                                                   else None)
    return plan


_VLLM_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _check_vllm_fused(schemes: dict[str, Scheme], ignore: list[str], plan: Plan) -> None:
    """vLLM runs q/k/v and gate/up as one layer each and refuses siblings with different schemes (one FP8,
    another in ``ignore``, or different strategies): say so at save time rather than at serve time."""
    ignored = set(ignore)
    parents = {fqn.rpartition(".")[0] for fqn in list(schemes) + ignore}
    for parent in parents:
        for names in _VLLM_FUSED:
            members = [f"{parent}.{n}" if parent else n for n in names]
            kinds = {("ignore",) if m in ignored else schemes[m] for m in members if m in ignored or m in schemes}
            if len(kinds) > 1 and all(m in ignored or m in schemes for m in members):
                plan.notes.append(f"{'/'.join(names)} of '{parent}' differ in scheme or precision; vLLM fuses them "
                                  "into one layer and will refuse this checkpoint (transformers loads it)")


def _module_dtype(mod: nn.Module) -> torch.dtype:
    for p in mod.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def _fp8_linear_entries(fqn: str, mod: nn.Module, w: FP8Weight, sites: list, plan: Plan,
                        schemes: dict, ignore: list[str], multi_site: list[str]) -> list[Entry]:
    ops = [op for _, op in sites]
    if not ops:
        raise CheckpointError(f"'{fqn}' holds an FP8 weight but no recorded op uses it (a dbr_quant bug)")
    found = scheme(fqn, w, ops)
    wstrat, dynamic = found[0], found[2]
    out_features = w.qdata.shape[0]
    # input_scale: whether the folder holds one (the loader cannot tell from the ops of a functional linear)
    info: dict[str, Any] = {"layout": "fp8", "format": "e4m3", "granularity": wstrat, "transposed": w.transposed,
                            "dtype": str(w.dtype).removeprefix("torch."), "input_scale": not dynamic}
    if w.block is not None:
        info["block"] = list(w.block)
    if w.transposed:
        return [_dequantized_conv1d(fqn, w, info, plan, ignore)]
    plan.linears[fqn] = info
    schemes[fqn] = found
    fused = {n for names in _VLLM_FUSED for n in names}
    if w.block is not None and out_features % w.block[0] and fqn.rpartition(".")[2] in fused:
        # vLLM's validate_fp8_block_shape: every output partition of a merged layer is a whole block of rows
        plan.notes.append(f"'{fqn}' has {out_features} output rows, not a multiple of the {w.block[0]}-row block; "
                          "vLLM merges q/k/v and gate/up into one layer and refuses partial row blocks there "
                          "(transformers loads it)")
    # block: [⌈out/bn⌉, ⌈in/bk⌉] as it is (compressed-tensors' FP8_BLOCK weight_scale); mx: the E8M0 codes uint8
    # [out, ⌈in/32⌉] as they are (compressed-tensors' MXFP8 compressor stores exactly these, mx_utils.compress_mx_scale)
    if wstrat == "mx":
        entries = [Entry(_join(fqn, "weight"), w.qdata.dtype, tuple(w.qdata.shape), lambda: w.qdata),
                   tensor_entry(_join(fqn, "weight_scale"), w.scale, torch.uint8)]
        return entries
    scale = (w.scale.float() if wstrat == "block" else w.scale.float().reshape(out_features, 1)
             if wstrat == "channel" else w.scale.float().reshape(1))
    entries = [Entry(_join(fqn, "weight"), w.qdata.dtype, tuple(w.qdata.shape), lambda: w.qdata),
               tensor_entry(_join(fqn, "weight_scale"), scale, scale_dtype(scale, w.dtype))]
    if not dynamic:
        values = torch.stack([st.scale(op, "input").float().reshape(()) for st, op in sites])
        if not torch.isfinite(values).all() or (values <= 0).any():
            raise CheckpointError(f"'{fqn}': an input scale is not a positive finite number ({values.tolist()})")
        if len(values) > 1 and not bool((values == values[0]).all()):
            multi_site.append(fqn)
        s = values.max().reshape(1)
        entries.append(tensor_entry(_join(fqn, "input_scale"), s, scale_dtype(s, w.dtype)))
    return entries


def _dequantized_conv1d(fqn: str, w: FP8Weight, info: dict, plan: Plan, ignore: list[str]) -> Entry:
    """A Conv1D's FP8 weight, dequantized into its own [in, out] layout in the model's dtype. Checked here to
    re-quantize to the same FP8 bytes with the kept scale, which is what load_pretrained does."""
    hp = w.dequantize()
    if not torch.equal(kernels.quantize(hp.t(), w.elementwise_scale(), FP8Format.E4M3).view(torch.uint8),
                       w.qdata.view(torch.uint8)):
        raise CheckpointError(f"'{fqn}' (Conv1D): its FP8 weight times its scale is not exact in {w.dtype}, so it "
                              "cannot be written dequantized and restored; convert the model in float32 or bfloat16")
    info["layout"] = "dequantized"
    info["scale"] = w.scale.float().cpu().tolist()
    plan.linears[fqn] = info
    ignore.append(fqn)
    plan.notes.append("Hugging Face Conv1D layers have no compressed-tensors form: written dequantized and "
                      "listed in ignore (loaders run them in high precision; load_pretrained restores FP8)")
    return Entry(_join(fqn, "weight"), w.dtype, tuple(hp.shape), lambda: w.dequantize())
