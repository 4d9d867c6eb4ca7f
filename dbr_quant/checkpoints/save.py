"""``save_pretrained``: a converted model as a compressed-tensors ``float-quantized`` folder.

    model-00001-of-00003.safetensors …   tensors, one module's group never split across shards
    model.safetensors.index.json          when there is more than one shard (else model.safetensors)
    config.json                           Hugging Face models: their config + quantization_config
    generation_config.json                when the model has one
    dbr_quant.json                        what load_pretrained needs beyond the tensors (see sidecar.py)

Everything is decided (and every error raised) before the first byte is written; shards are written one
tensor at a time (safetensors_io), so the extra memory is about one tensor, not one shard.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dbr_quant import __version__  # set at the top of dbr_quant/__init__.py, before it imports checkpoints
from dbr_quant.checkpoints import sidecar
from dbr_quant.checkpoints.layout import Plan, build_plan, record_of
from dbr_quant.checkpoints.safetensors_io import Entry, order_for_alignment, parse_size, write_file
from dbr_quant.quantize.weights import fp8_weight_of

INDEX = "model.safetensors.index.json"
_OURS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


def _shards(groups: list[tuple[str, list[Entry]]], limit: int) -> list[list[Entry]]:
    """Greedy, in model order: a group (one module's tensors) starts a new shard when it would overflow the
    current one; a group larger than the limit gets a shard of its own."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for _, entries in groups:
        n = sum(e.nbytes for e in entries)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].extend(entries)
        size += n
    return [s for s in shards if s]


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def _hf_config(model: nn.Module, plan: Plan) -> dict[str, Any] | None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not hasattr(config, "model_type"):
        return None
    d = config.to_dict()
    d["architectures"] = d.get("architectures") or [type(model).__name__]
    d["dtype"] = str(_model_dtype(model)).removeprefix("torch.")
    if plan.quantization_config.get("config_groups"):
        d["quantization_config"] = plan.quantization_config
    else:  # an empty scheme list makes compressed-tensors' loader fail: the folder is a plain checkpoint
        plan.notes.append("no layer has a compressed-tensors FP8 form (a tied lm_head, Conv1D layers and skipped "
                          "linears stay high precision or are written dequantized): config.json has no "
                          "quantization_config, so loaders read it as a high-precision model")
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    out_emb = get_output_embeddings() if callable(get_output_embeddings) else None
    if d.get("tie_word_embeddings") and out_emb is not None and fp8_weight_of(out_emb) is not None:
        # the FP8 output projection is no longer the input embedding: a loader that re-ties would overwrite it
        d["tie_word_embeddings"] = False
        plan.notes.append("the output embedding is FP8 while the input embedding is not: config.json says "
                          "tie_word_embeddings=false")
    return d


def _sidecar(model: nn.Module, plan: Plan) -> dict[str, Any]:
    record = record_of(model)
    example = None
    if record.example is not None:
        args, kwargs = record.example
        try:
            example = {"args": sidecar.encode_value(tuple(args)), "kwargs": sidecar.encode_value(dict(kwargs))}
        except sidecar.Unserializable as e:
            plan.notes.append(f"prepare()'s example inputs hold {e}, which has no JSON form: pass example_inputs / "
                              "example_kwargs to load_pretrained")
    return {
        "format": sidecar.FORMAT, "version": sidecar.VERSION, "dbr_quant_version": __version__,
        "model_class": type(model).__name__, "dtype": str(_model_dtype(model)).removeprefix("torch."),
        "qconfig": sidecar.global_config(record.qconfig), "example": example,
        "states": sidecar.state_records(record.states), "linears": plan.linears, "stacked": plan.stacked,
        "aliases": plan.aliases, "quantization_config": plan.quantization_config,
        "experts": plan.experts, "renames": [list(r) for r in plan.renames],
    }


def save_pretrained(converted: nn.Module, save_directory: str | os.PathLike, *,
                    max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``converted`` (a model returned by :func:`dbr_quant.convert`) as a compressed-tensors FP8 folder
    that transformers (with ``compressed-tensors`` installed) and vLLM load, and that
    :func:`load_pretrained` turns back into the same converted model, bit for bit.

    ``max_shard_size``: bytes or a string like ``"5GB"``; tensors of one module stay in one shard. Raises
    :class:`CheckpointError` (before writing anything) for settings the format cannot express: E5M2
    weights or activations, a linear whose call sites differ in static/dynamic. Returns the written paths.
    """
    plan = build_plan(converted)
    limit = parse_size(max_shard_size)
    config = _hf_config(converted, plan)
    meta = _sidecar(converted, plan)
    shards = _shards(plan.groups, limit)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    keep = set(names) | ({INDEX} if n > 1 else set())
    for old in out.iterdir():  # shards of an earlier save would be read by loaders that glob *.safetensors
        if _OURS.fullmatch(old.name) and old.name not in keep:
            old.unlink()
    written = []
    weight_map: dict[str, str] = {}
    total = 0
    for name, entries in zip(names, shards):
        write_file(out / name, order_for_alignment(entries), {"format": "pt"})
        written.append(str(out / name))
        for e in entries:
            weight_map[e.name] = name
            total += e.nbytes
    if n > 1:
        _write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append(str(out / INDEX))
    if config is not None:
        _write_json(out / "config.json", config)
        written.append(str(out / "config.json"))
        gen = getattr(converted, "generation_config", None)
        if gen is not None and hasattr(gen, "to_json_file"):
            gen.to_json_file(out / "generation_config.json")
            written.append(str(out / "generation_config.json"))
    _write_json(out / sidecar.FILENAME, meta)  # last: a folder without it was not completely written
    written.append(str(out / sidecar.FILENAME))
    if plan.notes:
        shown = "; ".join(dict.fromkeys(plan.notes))
        warnings.warn(f"dbr_quant.save_pretrained(): {shown}", stacklevel=2)
    return written


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


__all__ = ["save_pretrained"]
