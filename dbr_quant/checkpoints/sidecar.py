"""``dbr_quant.json``: what ``load_pretrained`` needs beyond the compressed-tensors tensors.

The compressed-tensors layout holds one input scale per linear and k/v scales per attention layer. A
converted model also has a scale per call site, q scales, scales of activation × activation matmuls and
the decisions of its trace (which op runs in FP8, which ops fuse, which gate/up pairs are stacked). This
JSON records them, with the QConfig resolved per op (so no user class or regex has to be rebuilt), and
the example inputs prepare() traced with, so ``load_pretrained`` can trace the same architecture again.

Everything is plain JSON: numbers are written with Python's shortest round-trip repr, so an fp32 scale
read back is the same fp32 value, bit for bit. Tensors in example inputs become ``{"__tensor__": ...}``
objects with a dtype from a fixed list; nothing is imported or executed on load.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch

from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.formats import FP8Format
from dbr_quant.ops.state import AutoQuantizationState, SeenOp
from dbr_quant.qconfig import OpQConfig, Override, QConfig, TensorQConfig

FORMAT = "dbr_quant.checkpoint"
VERSION = 1
FILENAME = "dbr_quant.json"

_TENSOR_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


class Unserializable(TypeError):
    """An example input that has no JSON form (a cache object, a custom class)."""


# ------------------------------------------------------------------------------------------ example inputs
def encode_value(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        name = str(x.dtype).removeprefix("torch.")
        if name not in _TENSOR_DTYPES:
            raise Unserializable(f"a {x.dtype} tensor")
        return {"__tensor__": {"dtype": name, "shape": list(x.shape), "data": x.detach().cpu().reshape(-1).tolist()}}
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return {"__tuple__": [encode_value(v) for v in x]}
    if isinstance(x, list):
        return [encode_value(v) for v in x]
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        return {"__dict__": {k: encode_value(v) for k, v in x.items()}}
    raise Unserializable(f"a {type(x).__name__}")


def decode_value(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [decode_value(v) for v in x]
    if isinstance(x, dict) and len(x) == 1:
        (tag, body), = x.items()
        if tag == "__tuple__" and isinstance(body, list):
            return tuple(decode_value(v) for v in body)
        if tag == "__dict__" and isinstance(body, dict):
            return {k: decode_value(v) for k, v in body.items()}
        if tag == "__tensor__" and isinstance(body, dict) and body.get("dtype") in _TENSOR_DTYPES:
            dtype = _TENSOR_DTYPES[body["dtype"]]
            data = torch.tensor(body["data"], dtype=torch.float64 if dtype.is_floating_point else None)
            return data.to(dtype).reshape(body["shape"])
    raise CheckpointError(f"{FILENAME}: malformed example input entry {str(x)[:80]!r}")


# ------------------------------------------------------------------------------------------ configs
def _tensor_cfg(cfg: TensorQConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"format": cfg.format.value, "granularity": cfg.granularity}
    if cfg.granularity == "block":  # only where read: files of other granularities stay as before
        out["block"] = list(cfg.block)
    if cfg.granularity == "group":
        out["group_size"] = cfg.group_size
    if cfg.granularity == "mx" and cfg.mx_scale_rounding != "floor":
        out["mx_scale_rounding"] = cfg.mx_scale_rounding
    return out


def _tensor_cfg_from(d: dict) -> TensorQConfig:
    extra: dict[str, Any] = {}
    if "block" in d:
        extra["block"] = tuple(d["block"])
    if "group_size" in d:
        extra["group_size"] = d["group_size"]
    if "mx_scale_rounding" in d:
        extra["mx_scale_rounding"] = d["mx_scale_rounding"]
    return TensorQConfig(format=FP8Format.parse(d["format"]), granularity=d["granularity"], **extra)


def op_config(cfg: OpQConfig) -> dict[str, Any]:
    out = {"skip": cfg.skip, "dynamic": cfg.dynamic, "activation": _tensor_cfg(cfg.activation),
           "weight": _tensor_cfg(cfg.weight)}
    if cfg.untie:  # only where set: files without it read as before
        out["untie"] = True
    if cfg.weight_only:
        out["weight_only"] = True
    return out


def global_config(q: QConfig) -> dict[str, Any]:
    out = {"activation": _tensor_cfg(q.activation), "weight": _tensor_cfg(q.weight), "dynamic": q.dynamic,
           "strict": q.strict, "fuse": q.fuse, "quantize_attention": q.quantize_attention}
    if q.attention_scales != "tensor":  # only where set: files without it read as before
        out["attention_scales"] = q.attention_scales
    if q.weight_only:  # only where set: files without it read as before
        out["weight_only"] = True
    return out


def rebuild_qconfig(saved: dict[str, Any], states: list[dict[str, Any]]) -> QConfig:
    """The saved global settings plus one exact-name Override per op whose resolved settings differ (the
    saved QConfig's own overrides may name user classes; their per-op result is what matters)."""
    g = saved
    base = QConfig(activation=_tensor_cfg_from(g["activation"]), weight=_tensor_cfg_from(g["weight"]),
                   dynamic=g["dynamic"], strict=g["strict"], fuse=g["fuse"],
                   quantize_attention=g["quantize_attention"], attention_scales=g.get("attention_scales", "tensor"),
                   weight_only=g.get("weight_only", False))
    default = op_config(base.for_op("", ()))
    overrides: dict[str, Override] = {}
    for st in states:
        for op in st["ops"]:
            cfg = op["qconfig"]
            if cfg == default or op["fqn"] in overrides:
                continue
            overrides[op["fqn"]] = Override(
                pattern=f"^{re.escape(op['fqn'])}$", skip=cfg["skip"], dynamic=cfg["dynamic"],
                activation=_tensor_cfg_from(cfg["activation"]), weight=_tensor_cfg_from(cfg["weight"]),
                untie=cfg.get("untie", False))
    return dataclasses.replace(base, overrides=tuple(overrides.values()))


# ------------------------------------------------------------------------------------------ ops
def op_record(op: SeenOp) -> dict[str, Any]:
    """What the trace decided for one op: compared field by field when the architecture is traced again."""
    return {"index": op.index, "kind": op.kind, "fqn": op.fqn, "quantize": op.quantize, "slots": list(op.slots),
            "fusion": op.fusion, "group": list(op.group) if op.group is not None else None,
            "weight_owner": op.weight_owner, "qconfig": op_config(op.qconfig)}


def op_scales(st: AutoQuantizationState, op: SeenOp) -> dict[str, Any]:
    """The frozen activation scales of an op by slot (static quantized ops only), as exact JSON numbers."""
    if not op.quantize or op.qconfig.dynamic:
        return {}
    return {slot: st.scale(op, slot).detach().float().cpu().tolist() for slot in op.slots}


def state_records(states: Sequence[AutoQuantizationState]) -> list[dict[str, Any]]:
    return [{"module": st.fqn, "ops": [dict(op_record(op), scales=op_scales(st, op)) for op in st.seen_ops]}
            for st in states]


def compare_trace(saved: list[dict[str, Any]], states: Sequence[AutoQuantizationState]) -> str | None:
    """None when the new trace made the saved decisions, else a description of the first difference."""
    now = {st.fqn: st for st in states}
    if [s["module"] for s in saved] != [st.fqn for st in states]:
        return (f"modules with recorded ops differ: saved {[s['module'] for s in saved][:8]}…, "
                f"traced {[st.fqn for st in states][:8]}…")
    for s in saved:
        ops = now[s["module"]].seen_ops
        if len(ops) != len(s["ops"]):
            return f"module '{s['module']}': {len(s['ops'])} ops saved, {len(ops)} traced"
        for rec, op in zip(s["ops"], ops):
            fresh = op_record(op)
            diff = [k for k in fresh if fresh[k] != rec.get(k)]
            if diff:
                what = ", ".join(f"{k} saved {rec.get(k)!r}, traced {fresh[k]!r}" for k in diff)
                return f"op {op.fqn} ({op.kind}): {what}"
    return None
