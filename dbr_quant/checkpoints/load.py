"""``load_pretrained``: a folder written by ``save_pretrained`` back into the converted model, bit for bit.

Order of work, so that a bad folder never changes anything:

1. read ``dbr_quant.json`` and every safetensors header (a truncated file is an error naming the tensor);
2. check every tensor the model needs against the model: present, shape, dtype; nothing unexpected;
3. read the tensors; every scale finite and positive, no NaN byte in an FP8 weight, the file's input /
   k / v scales agreeing with the per-call-site scales in ``dbr_quant.json``;
4. only then: prepare a copy of ``model`` (the passed model is never modified) with the saved example
   inputs and the saved per-op settings, check that the trace made the saved decisions, load the
   high-precision tensors, run one forward (convert needs calibrated observers), convert, and
   overwrite every FP8 weight and activation scale with the saved ones; stack gate/up as saved.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dbr_quant import kernels
from dbr_quant.api import _stack_gate_up_weights, convert, prepare
from dbr_quant.checkpoints import experts, sidecar
from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.layout import model_modules, own_tensors
from dbr_quant.checkpoints.safetensors_io import StoredTensor, read_header, read_tensor
from dbr_quant.checkpoints.save import INDEX
from dbr_quant.formats import FP8Format
from dbr_quant.ops.mappings import SDPA
from dbr_quant.ops.tags import tag_of, unstack
from dbr_quant.quantize.weights import attach_fp8_weight, fp8_weight_of

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_QUIET = r"dbr_quant\.(prepare|convert)\(\): "  # the reload repeats warnings the user saw at convert time


def _read_sidecar(folder: Path) -> dict[str, Any]:
    path = folder / sidecar.FILENAME
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {sidecar.FILENAME}, so this is not a folder written by "
                              "dbr_quant.save_pretrained nor a block-scaled FP8 folder (compressed-tensors "
                              "FP8_BLOCK, transformers FineGrainedFP8), the other layouts load_pretrained reads (load "
                              "a per-channel / per-tensor compressed-tensors folder with transformers' "
                              "from_pretrained or vLLM instead)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON ({e})") from e
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
            out[name + "_scale"] = (_FLOATS, _scale_shape(info, tuple(t.shape)))
            if not any(op["qconfig"]["dynamic"] for op in sites.get(fqn, [])):
                out[f"{fqn}.input_scale"] = (_FLOATS, (1,))
    return out


def _scale_shape(info: dict[str, Any], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The weight_scale shape of a saved FP8 linear with weight ``shape`` [out, in]."""
    if info["granularity"] == "block":
        (bn, bk), (n, k) = info["block"], shape
        return (-(-n // bn), -(-k // bk))
    return (shape[0], 1) if info["granularity"] == "channel" else (1,)


def _block(info: dict[str, Any]) -> tuple[int, int] | None:
    return tuple(info["block"]) if info["granularity"] == "block" else None


def _kv_expected(meta: dict[str, Any], stored: dict[str, StoredTensor]) -> dict[str, float]:
    """k_scale / v_scale tensors of the file → the value dbr_quant.json implies (the largest per module)."""
    implied: dict[str, float] = {}
    for st in meta["states"]:
        for op in st["ops"]:
            for slot in ("k", "v"):
                if op["kind"] == SDPA and slot in op.get("scales", {}):
                    name = f"{st['module']}.{slot}_scale" if st["module"] else f"{slot}_scale"
                    implied[name] = max(implied.get(name, float("-inf")), float(op["scales"][slot]))
    found = {n for n in stored if re.search(r"(^|\.)[kv]_scale$", n)}
    stray = sorted(found - set(implied))
    if stray:
        raise CheckpointError(f"{stray[0]}: a KV-cache scale for a module without FP8 attention in {sidecar.FILENAME}")
    return {n: implied[n] for n in found}


def _check_scale(name: str, t: torch.Tensor) -> None:
    t = t.double()
    ok = torch.isfinite(t) & (t > 0)
    if not bool(ok.all()):
        raise CheckpointError(f"{name}: a scale must be a positive finite number, the checkpoint holds "
                              f"{t[~ok][:3].tolist()}")


def _read_and_check(model: nn.Module, meta: dict[str, Any], stored: dict[str, StoredTensor]) -> dict[str, torch.Tensor]:
    expected = _expected(model, meta)
    kv = _kv_expected(meta, stored) if meta["quantization_config"].get("kv_cache_scheme") is not None else {}
    if meta["quantization_config"].get("kv_cache_scheme") is not None and not kv:
        raise CheckpointError("the quantization_config has a kv_cache_scheme but the folder holds no k_scale / "
                              "v_scale tensors")
    expected.update({n: (_FLOATS, (1,)) for n in kv})
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
    values = {name: read_tensor(stored[name]) for name in expected}
    for name, t in values.items():
        if expected[name][0] == _FLOATS:
            _check_scale(name, t)
        elif t.dtype == torch.float8_e4m3fn and bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
            raise CheckpointError(f"{name}: the FP8 weight holds NaN bytes (0x7f/0xff)")
    for st in meta["states"]:
        for op in st["ops"]:
            for slot, v in op.get("scales", {}).items():
                _check_scale(f"{sidecar.FILENAME}: {op['fqn']} scale '{slot}'", torch.tensor(v, dtype=torch.float64))
    for fqn, ops in _linear_sites(meta).items():
        name = f"{fqn}.input_scale"
        if name in values:
            _agree(name, values[name], max(float(op["scales"]["input"]) for op in ops))
    for name, implied in kv.items():
        _agree(name, values[name], implied)
    return values


def _agree(name: str, stored: torch.Tensor, implied: float) -> None:
    want = torch.tensor([implied], dtype=torch.float32).to(stored.dtype)
    if not torch.equal(stored.reshape(1), want):
        raise CheckpointError(f"{name}: the file holds {stored.flatten().tolist()}, {sidecar.FILENAME} implies "
                              f"{implied}; the folder mixes files of different saves")


def _example(meta: dict[str, Any], example_inputs: Any, example_kwargs: Any) -> tuple[tuple, dict]:
    if example_inputs is not None or example_kwargs is not None:
        args = example_inputs if isinstance(example_inputs, tuple) else (
            () if example_inputs is None else (example_inputs,))
        return args, dict(example_kwargs or {})
    saved = meta.get("example")
    if saved is None:
        raise CheckpointError("this checkpoint has no example inputs (prepare()'s were not JSON-serializable): pass "
                              "example_inputs= / example_kwargs= to load_pretrained")
    return tuple(sidecar.decode_value(saved["args"])), dict(sidecar.decode_value(saved["kwargs"]))


def _tensor_of(model: nn.Module, name: str) -> torch.Tensor:
    fqn, _, attr = name.rpartition(".")
    mod = model.get_submodule(fqn)
    t = mod._parameters.get(attr)
    return mod._buffers[attr] if t is None else t


@torch.no_grad()
def _load_high_precision(prepared: nn.Module, meta: dict[str, Any], values: dict[str, torch.Tensor]) -> None:
    """Before convert: FP8 weights as their dequantized values (so the calibration forward and convert see
    real, finite weights), then every other tensor (tied copies included), as saved."""
    linears = meta["linears"]
    for fqn, info in linears.items():
        if info["layout"] == "fp8":
            q, s = values[f"{fqn}.weight"], values[f"{fqn}.weight_scale"].float()
            w = _tensor_of(prepared, f"{fqn}.weight")
            block = _block(info)
            if block is not None:
                s = kernels.reference_block.expand_block_scale(s, tuple(q.shape), block)
            w.copy_(kernels.dequantize(q, s, w.dtype).to(w.device))
    for fqn, mod in model_modules(prepared):
        for pname, t in own_tensors(mod):
            name = f"{fqn}.{pname}" if fqn else pname
            source = meta["aliases"].get(name, name)
            if (linears.get(fqn, {}).get("layout") == "fp8" and pname == "weight") or source not in values:
                continue  # FP8 linears above; FP8 experts below (stored per expert)
            t.copy_(values[source].to(t.device))
    experts.load_experts_high_precision(prepared, meta, values)


@torch.no_grad()
def _load_fp8(converted: nn.Module, meta: dict[str, Any], values: dict[str, torch.Tensor]) -> None:
    """After convert: the saved FP8 weights and every saved activation scale, then gate/up stacked as saved."""
    record = converted.__dict__["_dbr_record"]
    for fqn, info in meta["linears"].items():
        mod = converted.get_submodule(fqn)
        w = fp8_weight_of(mod)
        if w is None:
            raise CheckpointError(f"'{fqn}': saved as an FP8 linear, but convert left it in high precision here")
        channel, block = info["granularity"] == "channel", _block(info)
        if info["layout"] == "dequantized":  # Conv1D: exact re-quantization with the kept scale (checked at save)
            s = torch.tensor(info["scale"], dtype=torch.float32)
            hp = values[f"{fqn}.weight"].t()
            elementwise = (kernels.reference_block.expand_block_scale(s, tuple(hp.shape), block) if block
                           else s.unsqueeze(1) if channel else s)
            q = kernels.quantize(hp, elementwise, FP8Format.E4M3)
        else:
            q, s = values[f"{fqn}.weight"], values[f"{fqn}.weight_scale"].float()
            s = s if block else s.reshape(-1) if channel else s.reshape(())
        if q.shape != w.qdata.shape or s.shape != w.scale.shape:
            raise CheckpointError(f"'{fqn}': saved FP8 weight {list(q.shape)} / scale {list(s.shape)}, converted "
                                  f"{list(w.qdata.shape)} / {list(w.scale.shape)}")
        if block != w.block:
            raise CheckpointError(f"'{fqn}': saved with weight block {block}, converted here with {w.block}")
        attach_fp8_weight(mod, q.contiguous().to(w.qdata.device), s.to(w.scale.device), w.dtype, w.transposed,
                          block)
        unstack(mod)
    experts.load_experts_fp8(converted, meta, values)
    for mod in converted.modules():
        unstack(mod)
    for st, saved in zip(record.states, meta["states"]):
        for op, rec in zip(st.seen_ops, saved["ops"]):
            for slot, v in rec.get("scales", {}).items():
                buf = st.scale(op, slot)
                buf.copy_(torch.tensor(v, dtype=torch.float32).reshape(buf.shape).to(buf.device))
    _stack_gate_up_weights(converted, record)
    names = {id(m): fqn for fqn, m in model_modules(converted)}
    stacked = sorted([names[id(tag.stacked_after)], fqn] for fqn, m in model_modules(converted)
                     if (tag := tag_of(m)) is not None and tag.stacked_after is not None)
    if stacked != sorted(meta["stacked"]):
        raise CheckpointError(f"gate/up stacking differs from the saved model: saved {meta['stacked'][:3]}, now "
                              f"{stacked[:3]} (a dbr_quant version difference?)")


def load_pretrained(save_directory: str | Path, model: nn.Module, *, example_inputs: Any = None,
                    example_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """The converted model saved by :func:`save_pretrained` in ``save_directory``, rebuilt from ``model``:
    the same architecture in high precision, in the dtype it was saved from (e.g. built from its config;
    its weights are replaced). ``model`` itself is not modified. prepare()'s example inputs come from the
    folder unless given.

    A folder without ``dbr_quant.json`` whose ``config.json`` describes block-scaled FP8 written by another
    tool (compressed-tensors ``FP8_BLOCK``, transformers FineGrainedFP8; see ``checkpoints/foreign.py``) loads
    as a converted model running dbr_quant's block kernels (example inputs: given, else a short ``input_ids``
    for a Hugging Face model). Raises :class:`CheckpointError` naming the tensor for anything missing, of the
    wrong shape or dtype, non-finite, or truncated; nothing in the folder is executed (JSON and raw bytes).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_pretrained() takes the high-precision nn.Module to rebuild, got {type(model).__name__}")
    if "_dbr_record" in model.__dict__:
        raise TypeError("load_pretrained() needs the original (high-precision) architecture, not a model returned "
                        "by dbr_quant.prepare()/convert()")
    folder = Path(save_directory)
    if not (folder / sidecar.FILENAME).is_file():
        from dbr_quant.checkpoints import foreign

        qc = foreign.quantization_config_of(folder)
        if qc is not None and foreign.is_block_config(qc):  # another tool's (compressed-tensors, FineGrainedFP8)
            return foreign.load_foreign(folder, model, qc, _read_headers(folder), example_inputs, example_kwargs)
    meta = _read_sidecar(folder)
    stored = experts.file_to_model_names(_read_headers(folder), meta)
    values = _read_and_check(model, meta, stored)
    args, kwargs = _example(meta, example_inputs, example_kwargs)
    qconfig = sidecar.rebuild_qconfig(meta["qconfig"], meta["states"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_QUIET)
        prepared = prepare(model, args, qconfig, example_kwargs=kwargs)
        diff = sidecar.compare_trace(meta["states"], prepared.__dict__["_dbr_record"].states)
        if diff is not None:
            raise CheckpointError(f"tracing this model did not reproduce the saved model: {diff}. Pass the "
                                  "architecture (and example inputs) the checkpoint was saved from")
        _load_high_precision(prepared, meta, values)
        with torch.no_grad():
            prepared(*args, **kwargs)  # one calibration forward: convert needs every observer calibrated
        converted = convert(prepared, inplace=True)
    _load_fp8(converted, meta, values)
    return converted
