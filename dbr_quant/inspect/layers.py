"""The layers an inspection sees: a prepared or converted model's recorded GEMM ops under unique layer names, and
attaching an inspector to the model's record (what its forwards then run through)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from dbr_quant.inspect.features import LayerInfo
from dbr_quant.moe.experts import EXPERTS
from dbr_quant.ops.mappings import QUANTIZEABLE
from dbr_quant.ops.state import SeenOp
from dbr_quant.runtime.runs import ModelRecord

if TYPE_CHECKING:  # the inspector reads the layers; a session attaches it
    from dbr_quant.inspect.inspector import Inspector


def model_record(model: nn.Module) -> ModelRecord:
    record = model.__dict__.get("_dbr_record") if isinstance(model, nn.Module) else None
    if record is None or record.phase not in ("prepared", "converted"):
        raise TypeError("dbr_quant.inspect needs a model returned by dbr_quant.prepare() (calibrated) or convert()")
    return record


@dataclass(frozen=True)
class RecordedLayer:
    """A recorded quantized op under its layer name: the op's fqn, with ``#k`` appended to the k-th repeat
    of an fqn (e.g. two matmuls in one forward: ``attn.matmul``, ``attn.matmul#1``)."""

    info: LayerInfo
    module_types: tuple[str, ...]  # class names of its module and that module's bases (for module_type)
    op: SeenOp


def named_ops(model: nn.Module) -> list[tuple[str, SeenOp]]:
    """Every recorded GEMM op (linear, matmul, sdpa, MoE experts; quantized or not) with its unique layer name."""
    count: dict[str, int] = {}
    out = []
    for st in model_record(model).states:
        for op in st.seen_ops:
            if op.kind in QUANTIZEABLE or op.kind == EXPERTS:  # each 3-D expert tensor: a layer (experts.py)
                k = count[op.fqn] = count.get(op.fqn, -1) + 1
                out.append((op.fqn if k == 0 else f"{op.fqn}#{k}", op))
    return out


def recorded_layers(model: nn.Module) -> dict[str, RecordedLayer]:
    """The recorded ops that run in FP8 (``op.quantize``), by layer name, in call order."""
    record = model_record(model)
    owners = {id(op): st.fqn for st in record.states for op in st.seen_ops}
    out: dict[str, RecordedLayer] = {}
    for name, op in named_ops(model):
        if not op.quantize:
            continue
        owner = op.weight_owner if op.weight_owner is not None else owners[id(op)]
        try:
            mod = model.get_submodule(owner)
        except AttributeError:
            mod = model
        names = tuple(c.__name__ for c in type(mod).__mro__ if c not in (object, nn.Module))
        out[name] = RecordedLayer(LayerInfo(name, op.kind, type(mod).__name__, op.qconfig), names, op)
    return out


@contextmanager
def attached(model: nn.Module, inspector: Inspector) -> Iterator[None]:
    """Route the model's forwards through ``inspector`` inside the block (always detached after)."""
    record = model_record(model)
    if record.inspector is not None:
        raise RuntimeError("this model is already being inspected (one session at a time)")
    record.inspector = inspector
    try:
        yield
    finally:
        record.inspector = None

