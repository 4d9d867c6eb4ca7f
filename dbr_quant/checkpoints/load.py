"""``load_pretrained``: a folder written by ``save_pretrained`` back into the converted model, bit for bit.

Order of work, so that a bad folder never changes anything:

1. read ``dbr_quant.json`` and every safetensors header (a truncated file is an error naming the tensor);
2. check every tensor the model needs against the model: present, shape, dtype; nothing unexpected;
3. read the tensors; every scale finite and positive, no NaN byte in an FP8 weight, the file's input /
   k / v scales agreeing with the per-call-site scales in ``dbr_quant.json``;
4. only then (``assemble.py``): a skeleton of ``model`` (its parameters are neither copied nor modified)
   gets every tensor of the folder, FP8 weights as FP8; prepare() traces it with the saved example inputs
   and per-op settings; the trace must make the saved decisions; the saved activation scales are set (no
   calibration forward, no weight quantization) and gate/up stacked as saved.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dbr_quant import kernels
from dbr_quant.checkpoints import experts, foreign, readers, sidecar
from dbr_quant.checkpoints.assemble import (
    ScaleSource,
    Skeleton,
    check_fp8_weight,
    check_scale,
    example_args,
    finish_convert,
    on_model_device,
    trace,
)
from dbr_quant.checkpoints.errors import CheckpointError, read_json
from dbr_quant.checkpoints.layout import kv_file_scale, model_modules, own_tensors
from dbr_quant.checkpoints.meta_model import architecture_of
from dbr_quant.checkpoints.safetensors_io import StoredTensor, read_header, read_tensor
from dbr_quant.checkpoints.save import INDEX
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.mx import E8M0_NAN, MX_WEIGHT_BLOCK
from dbr_quant.ops.mappings import LINEAR, SDPA, is_transposed_linear
from dbr_quant.ops.state import AutoQuantizationState, SeenOp
from dbr_quant.ops.tags import tag_of
from dbr_quant.quantize.weights import fp8_weight_of

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_E8M0 = (torch.uint8,)  # MXFP8 weight_scale: E8M0 codes


def _read_sidecar(folder: Path) -> dict[str, Any]:
    path = folder / sidecar.FILENAME
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {sidecar.FILENAME} and no quantization_config in config.json (nor "
                              "hf_quant_config.json), so this is neither a folder written by dbr_quant.save_pretrained "
                              "nor an FP8 folder of another tool (compressed-tensors, fp8, fbgemm_fp8, ModelOpt)")
    meta = read_json(path)
    if not isinstance(meta, dict) or meta.get("format") != sidecar.FORMAT:
        raise CheckpointError(f"{path}: not a dbr_quant checkpoint description")
    if meta.get("version") != sidecar.VERSION:
        raise CheckpointError(f"{path}: format version {meta.get('version')}, this dbr_quant reads "
                              f"{sidecar.VERSION}; upgrade dbr_quant")
    _check_schema(meta, path)
    return meta


_OP_KEYS = {"index", "kind", "fqn", "quantize", "slots", "fusion", "group", "weight_owner", "qconfig", "scales"}
_LINEAR_KEYS = {"layout", "format", "granularity", "transposed", "dtype"}


def _check_schema(meta: dict[str, Any], path: Path) -> None:
    """The shape of dbr_quant.json, so that a damaged file is an error naming the entry, not a KeyError."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{path}: malformed entry {what}")

    for key, kind in (("qconfig", dict), ("states", list), ("linears", dict), ("stacked", list), ("aliases", dict),
                      ("quantization_config", dict)):
        need(isinstance(meta.get(key), kind), f"'{key}' (missing or not a {kind.__name__})")
    for st in meta["states"]:
        need(isinstance(st, dict) and isinstance(st.get("module"), str) and isinstance(st.get("ops"), list),
             f"in 'states': {str(st)[:80]}")
        for op in st["ops"]:
            need(isinstance(op, dict) and _OP_KEYS <= set(op) and isinstance(op["scales"], dict),
                 f"op in '{st['module']}': {str(op)[:80]}")
    for fqn, info in meta["linears"].items():
        need(isinstance(info, dict) and _LINEAR_KEYS <= set(info) and info["layout"] in ("fp8", "dequantized")
             and (info["layout"] == "fp8" or isinstance(info.get("scale"), list)), f"'linears.{fqn}'")
        need(info["granularity"] != "block" or (isinstance(info.get("block"), list) and len(info["block"]) == 2
             and all(isinstance(b, int) and b > 0 for b in info["block"])), f"'linears.{fqn}.block'")


def _read_headers(folder: Path) -> dict[str, StoredTensor]:
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder}: neither model.safetensors nor {INDEX}")
    stored: dict[str, StoredTensor] = {}
    for name in files:
        if Path(name).name != name:
            raise CheckpointError(f"{index}: shard name {name!r} points outside the folder")
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {INDEX} but missing")
        tensors, _ = read_header(path)
        for t in tensors.values():
            if t.name in stored:
                raise CheckpointError(f"{t.name}: stored twice ({stored[t.name].path} and {t.path})")
            if weight_map is not None and weight_map.get(t.name) != name:
                raise CheckpointError(f"{t.name}: in {name} but the index says {weight_map.get(t.name)}")
            stored[t.name] = t
    if weight_map is not None:
        lost = sorted(set(weight_map) - set(stored))
        if lost:
            raise CheckpointError(f"{lost[0]}: listed in {INDEX} but in no shard ({len(lost)} such tensor(s))")
    return stored


def _linear_sites(meta: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    sites: dict[str, list] = {}
    for st in meta["states"]:
        for op in st["ops"]:
            if op["kind"] == "linear" and op["weight_owner"] is not None:
                sites.setdefault(op["weight_owner"], []).append(op)
    return sites


def _expected(model: nn.Module, meta: dict[str, Any]) -> dict[str, tuple[tuple[torch.dtype, ...], tuple[int, ...]]]:
    """Every tensor the folder must hold for ``model``: name → (allowed dtypes, shape). Scales are the entries
    whose allowed dtypes are the float types (checked finite and positive once read)."""
    linears, sites = meta["linears"], _linear_sites(meta)
    modules = dict(model_modules(model))
    absent = sorted(set(linears) - set(modules))
    if absent:
        raise CheckpointError(f"'{absent[0]}': the checkpoint has an FP8 linear of this name, the model has no such "
                              "module; build the architecture the checkpoint was saved from")
    out, replaced = experts.expected_experts(model, meta)  # 3-D FP8 experts: stored per expert
    for fqn, mod in modules.items():
        for pname, t in own_tensors(mod):
            name = f"{fqn}.{pname}" if fqn else pname
            if name in meta["aliases"] or name in replaced:
                continue
            info = linears.get(fqn)
            if info is None or pname != "weight" or info["layout"] == "dequantized":
                out[name] = ((t.dtype,), tuple(t.shape))
                continue
            out[name] = ((torch.float8_e4m3fn,), tuple(t.shape))
            scale_dtypes = _E8M0 if info["granularity"] == "mx" else _FLOATS
            out[name + "_scale"] = (scale_dtypes, _scale_shape(info, tuple(t.shape)))
            static = info.get("input_scale")  # absent in folders of dbr_quant before FalconLinear support
            if static or static is None and not any(op["qconfig"]["dynamic"] for op in sites.get(fqn, [])):
                out[f"{fqn}.input_scale"] = (_FLOATS, (1,))
    return out


def _scale_shape(info: dict[str, Any], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The weight_scale shape of a saved FP8 linear with weight ``shape`` [out, in]."""
    if info["granularity"] in ("block", "mx"):
        (bn, bk), (n, k) = _block(info) or (1, 1), shape
        return (-(-n // bn), -(-k // bk))
    return (shape[0], 1) if info["granularity"] == "channel" else (1,)


def _block(info: dict[str, Any]) -> tuple[int, int] | None:
    if info["granularity"] == "mx":
        return MX_WEIGHT_BLOCK
    return tuple(info["block"]) if info["granularity"] == "block" else None


def _kv_expected(model: nn.Module, meta: dict[str, Any], stored: dict[str, StoredTensor]) -> dict[str, torch.Tensor]:
    """k_scale / v_scale tensors of the file → the value dbr_quant.json implies (save_pretrained's reduction of the
    per-call-site scales: the largest, per tensor [1] or per KV head [H_kv, 1, 1])."""
    sites: dict[tuple[str, str], list[torch.Tensor]] = {}
    for st in meta["states"]:
        for op in st["ops"]:
            for slot in ("k", "v"):
                if op["kind"] == SDPA and slot in op.get("scales", {}):
                    value = torch.tensor(op["scales"][slot], dtype=torch.float32)
                    sites.setdefault((st["module"], slot), []).append(value)
    implied = {}
    for (m, slot), scales in sites.items():
        name = f"{m}.{slot}_scale" if m else f"{slot}_scale"
        implied[name] = kv_file_scale(scales, model.get_submodule(m), name)
    found = {n for n in stored if re.search(r"(^|\.)[kv]_scale$", n)}
    stray = sorted(found - set(implied))
    if stray:
        raise CheckpointError(f"{stray[0]}: a KV-cache scale for a module without FP8 attention in {sidecar.FILENAME}")
    return {n: implied[n] for n in found}


def _read_and_check(model: nn.Module, meta: dict[str, Any], stored: dict[str, StoredTensor]) -> dict[str, torch.Tensor]:
    expected = _expected(model, meta)
    kv = _kv_expected(model, meta, stored) if meta["quantization_config"].get("kv_cache_scheme") is not None else {}
    if meta["quantization_config"].get("kv_cache_scheme") is not None and not kv:
        raise CheckpointError("the quantization_config has a kv_cache_scheme but the folder holds no k_scale / "
                              "v_scale tensors")
    expected.update({n: (_FLOATS, tuple(implied.shape)) for n, implied in kv.items()})
    for name, (dtypes, shape) in expected.items():
        t = stored.get(name)
        if t is None:
            raise CheckpointError(f"{name}: missing from the checkpoint (the model has it; is this the checkpoint of "
                                  "this architecture?)")
        if t.dtype not in dtypes or t.shape != shape:
            want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            have = str(t.dtype).removeprefix("torch.")
            raise CheckpointError(f"{name}: the checkpoint holds {have} {list(t.shape)}, "
                                  f"the model needs {want} {list(shape)}; build the model with the architecture "
                                  "and dtype it was saved from")
    unexpected = sorted(set(stored) - set(expected))
    if unexpected:
        raise CheckpointError(f"{unexpected[0]}: in the checkpoint but not in the model ({len(unexpected)} such "
                              "tensor(s)); build the architecture the checkpoint was saved from")
    linears = meta["linears"]
    values = {name: _as_stored(read_tensor(stored[name]), linears.get(name.removesuffix(".weight"))
                               if name.endswith(".weight") else None) for name in expected}
    for name, value in values.items():
        if expected[name][0] == _FLOATS:
            check_scale(name, value)
        elif expected[name][0] == _E8M0 and bool((value == E8M0_NAN).any()):
            raise CheckpointError(f"{name}: an MXFP8 scale holds the E8M0 NaN code 255")
        elif value.dtype == torch.float8_e4m3fn:
            check_fp8_weight(name, value)
    for st in meta["states"]:
        for op in st["ops"]:
            for slot, v in op.get("scales", {}).items():
                check_scale(f"{sidecar.FILENAME}: {op['fqn']} scale '{slot}'", torch.tensor(v, dtype=torch.float64))
    for fqn, ops in _linear_sites(meta).items():
        name = f"{fqn}.input_scale"
        if name in values:
            _agree(name, values[name], torch.tensor([max(float(op["scales"]["input"]) for op in ops)]))
    for name, implied in kv.items():
        _agree(name, values[name], implied)
    return values


def _agree(name: str, stored: torch.Tensor, implied: torch.Tensor) -> None:
    """The file's scale is what dbr_quant.json implies (in the dtype the file holds it in, as saved)."""
    if not torch.equal(stored.reshape(implied.shape), implied.to(stored.dtype)):
        raise CheckpointError(f"{name}: the file holds {stored.flatten().tolist()}, {sidecar.FILENAME} implies "
                              f"{implied.flatten().tolist()}; the folder mixes files of different saves")


def _as_stored(t: torch.Tensor, info: dict[str, Any] | None) -> torch.Tensor:
    """A Conv1D written dequantized ([in, out], its FP8 values × the scale kept in dbr_quant.json) back to its
    FP8 bytes [out, in], exactly (checked at save), as soon as it is read: never more than one such weight in
    high precision."""
    if info is None or info["layout"] != "dequantized":
        return t
    hp = t.t()
    s = torch.tensor(info["scale"], dtype=torch.float32)
    block = _block(info)
    elementwise = (kernels.reference_block.expand_block_scale(s, (hp.shape[0], hp.shape[1]), block) if block
                   else s.unsqueeze(1) if info["granularity"] == "channel" else s)
    return kernels.quantize(hp, elementwise, FP8Format.E4M3)


def _example(meta: dict[str, Any], example_inputs: Any, example_kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if example_inputs is not None or example_kwargs is not None:
        return example_args(example_inputs, example_kwargs)
    saved = meta.get("example")
    if saved is None:
        raise CheckpointError("this checkpoint has no example inputs (prepare()'s were not JSON-serializable): pass "
                              "example_inputs= / example_kwargs= to load_pretrained")
    return tuple(sidecar.decode_value(saved["args"])), dict(sidecar.decode_value(saved["kwargs"]))


def _place(skeleton: Skeleton, meta: dict[str, Any], values: dict[str, torch.Tensor]) -> None:
    """Every tensor of the folder into the skeleton, FP8 weights as FP8 (``values`` is emptied as it goes, so
    a read tensor is held once: by the model)."""
    for fqn, info in meta["linears"].items():
        q, block = values.pop(f"{fqn}.weight"), _block(info)
        if info["layout"] == "dequantized":  # Conv1D, re-quantized when read (_as_stored)
            s = torch.tensor(info["scale"], dtype=torch.float32)
        else:
            s = values.pop(f"{fqn}.weight_scale")
            s = s if info["granularity"] == "mx" else s.float()  # MX: E8M0 codes, as convert stores them
            s = s if block else s.reshape(-1) if info["granularity"] == "channel" else s.reshape(())
        skeleton.put_fp8(f"{fqn}.weight", q, s, is_transposed_linear(skeleton.model.get_submodule(fqn)), block)
    experts.place_experts(skeleton, meta, values)
    for name in list(skeleton.slots):
        source = meta["aliases"].get(name, name)
        if not skeleton.slots[name].filled and source in values:
            skeleton.put(name, values[source])
    skeleton.check_complete()


def _scales(meta: dict[str, Any], states: list[AutoQuantizationState]) -> ScaleSource:
    """The per-call-site activation scales of dbr_quant.json (the trace matched them op for op)."""
    saved = {id(op): rec["scales"] for st, s in zip(states, meta["states"]) for op, rec in zip(st.seen_ops, s["ops"])}

    def scale_of(st: AutoQuantizationState, op: SeenOp, slot: str) -> torch.Tensor | None:
        v = saved[id(op)].get(slot)
        return None if v is None else torch.tensor(v, dtype=torch.float32)

    return scale_of


def _check_fp8_as_saved(converted: nn.Module, meta: dict[str, Any], states: list[AutoQuantizationState]) -> None:
    """Each FP8 linear of the folder is one the trace runs in FP8 with the saved weight block, and no other
    linear is (convert would have made it FP8, so the saved model had it in FP8)."""
    sites: dict[str, list[SeenOp]] = {}
    for st in states:
        for op in st.seen_ops:
            if op.kind == LINEAR and op.weight_owner is not None:
                sites.setdefault(op.weight_owner, []).append(op)
    for fqn, ops in sites.items():
        info = meta["linears"].get(fqn)
        fp8_here = all(op.quantize for op in ops)
        if info is None and fp8_here and fp8_weight_of(converted.get_submodule(fqn)) is None:
            raise CheckpointError(f"'{fqn}': high precision in the checkpoint, but this trace runs it in FP8 (a "
                                  "dbr_quant version difference?)")
        if info is None:
            continue
        if not fp8_here:
            raise CheckpointError(f"'{fqn}': saved as an FP8 linear, but this trace runs it in high precision")
        cfg = ops[0].qconfig.weight
        traced = {"block": tuple(cfg.block), "mx": MX_WEIGHT_BLOCK}.get(cfg.granularity)
        if _block(info) != traced:
            raise CheckpointError(f"'{fqn}': saved with weight block {_block(info)}, traced here with {traced}")
    experts.check_experts_as_saved(meta, states)
    names = {id(m): fqn for fqn, m in model_modules(converted)}
    stacked = sorted([names[id(tag.stacked_after)], fqn] for fqn, m in model_modules(converted)
                     if (tag := tag_of(m)) is not None and tag.stacked_after is not None)
    if stacked != sorted(meta["stacked"]):
        raise CheckpointError(f"gate/up stacking differs from the saved model: saved {meta['stacked'][:3]}, now "
                              f"{stacked[:3]} (a dbr_quant version difference?)")


def load_pretrained(save_directory: str | Path, model: nn.Module | None = None, *, example_inputs: Any = None,
                    example_kwargs: dict[str, Any] | None = None, recalibrate: bool = False) -> nn.Module:
    """The converted model of the FP8 folder ``save_directory``, running dbr_quant's kernels.

    ``model``: the high-precision architecture (e.g. built from its config, in the dtype the folder was saved
    from; on the meta device when it has no non-persistent buffers), whose parameters are never copied nor
    modified: every tensor comes from the folder, FP8 weights placed as FP8 (peak memory: the FP8 model plus
    about one layer). Without ``model``, the Hugging Face architecture ``config.json`` names is built with its
    parameters on the meta device (``meta_model.py``), so no high-precision weight is ever materialized.

    The folder is one that :func:`save_pretrained` wrote (``dbr_quant.json``: restored bit for bit, prepare()'s
    example inputs from the folder unless given), or an FP8 folder of another tool, told by its config
    (``readers.py``): compressed-tensors ``float-quantized`` (any FP8 weight strategy; static or dynamic
    per-tensor / token / group inputs; ``ignore``; ``kv_cache_scheme``), the Hub's ``quant_method: "fp8"``,
    ``fbgemm_fp8``, ModelOpt FP8 (``foreign.py``; example inputs: given, else a short ``input_ids`` for a
    Hugging Face model).

    ``recalibrate=True`` (folders of other tools) returns the model *prepared*, its FP8 weights as read and a
    static per-tensor input observer on every FP8 linear: ``dbr_quant.calibrate`` it, ``dbr_quant.convert`` it
    (the weights stay the file's bytes) and ``save_pretrained`` it — an FP8_DYNAMIC checkpoint made static.

    Raises :class:`CheckpointError` naming the tensor for anything missing, of the wrong shape or dtype,
    non-finite, or truncated, and naming the setting for a scheme dbr_quant cannot run exactly (weight-only
    FP8, E5M2, zero points); nothing in the folder is executed (JSON and raw bytes).
    """
    folder = Path(save_directory)
    if model is None:
        model = architecture_of(folder)
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_pretrained() takes the high-precision nn.Module to rebuild, got {type(model).__name__}")
    if "_dbr_record" in model.__dict__:
        raise TypeError("load_pretrained() needs the original (high-precision) architecture, not a model returned "
                        "by dbr_quant.prepare()/convert()")
    if not (folder / sidecar.FILENAME).is_file():
        scheme = readers.folder_scheme(folder)
        if scheme is not None:  # another tool's FP8 folder
            return foreign.load_foreign(folder, model, scheme, _read_headers(folder), example_inputs, example_kwargs,
                                        recalibrate)
    if recalibrate:
        raise CheckpointError(f"{folder}: recalibrate=True takes a folder of another tool; a dbr_quant folder keeps "
                              "the scales it was saved with (prepare and calibrate the high-precision model instead)")
    meta = _read_sidecar(folder)
    stored = experts.file_to_model_names(_read_headers(folder), meta)
    values = _read_and_check(model, meta, stored)
    args, kwargs = _example(meta, example_inputs, example_kwargs)
    skeleton = Skeleton(model)
    _place(skeleton, meta, values)
    del values
    if example_inputs is None and example_kwargs is None:  # the folder's (CPU) examples go where the model is
        args, kwargs = on_model_device(skeleton.model, args, kwargs)
    prepared = trace(skeleton.model, args, kwargs, sidecar.rebuild_qconfig(meta["qconfig"], meta["states"]))
    states = prepared.__dict__["_dbr_record"].states
    diff = sidecar.compare_trace(meta["states"], states)
    if diff is not None:
        raise CheckpointError(f"tracing this model did not reproduce the saved model: {diff}. Pass the "
                              "architecture (and example inputs) the checkpoint was saved from")
    converted = finish_convert(prepared, _scales(meta, states))
    _check_fp8_as_saved(converted, meta, states)
    return converted
