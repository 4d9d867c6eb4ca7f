"""``with dbr_quant.inspect.session(model, config) as s: model(**batch)`` → ``s.records``.

Every forward of ``model`` inside the block is one *step* (counted from 0 by a forward pre-hook on
the model) and runs through an :class:`~dbr_quant.inspect.inspector.Inspector` built from the config.
Records are dicts ``{"step", "layer", "tensor", "stat", "value"}``.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from dbr_quant.inspect.config import InspectConfig, load_config
from dbr_quant.inspect.features import Feature
from dbr_quant.inspect.inspector import Inspector
from dbr_quant.inspect.layers import attached, recorded_layers

RECORD_KEYS = ("step", "layer", "tensor", "stat", "value")


@dataclass
class Session:
    """The result of an inspect session: ``plan`` (layer → features) and ``records``."""

    plan: dict[str, tuple[Feature, ...]]
    records: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0  # forwards run so far

    def _log(self, step: int, layer: str, tensor: str, stat: str, value: float) -> None:
        self.records.append({"step": step, "layer": layer, "tensor": tensor, "stat": stat, "value": value})

    def to_csv(self, path: str | os.PathLike) -> None:
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=RECORD_KEYS)
            writer.writeheader()
            writer.writerows(self.records)

    def to_json(self, path: str | os.PathLike) -> None:
        """A JSON list of records; non-finite values (e.g. SQNR of an exact tensor) as strings "inf"."""
        def clean(v: Any) -> Any:
            return str(v) if isinstance(v, float) and not math.isfinite(v) else v
        with open(path, "w", encoding="utf-8") as f:
            json.dump([{k: clean(v) for k, v in r.items()} for r in self.records], f, indent=1)

    def table(self, **kwargs: Any) -> str:
        return format_records(self.records, **kwargs)

    def describe_plan(self) -> str:
        width = max([len(n) for n in self.plan] + [5])
        return "\n".join(f"{n:<{width}}  {', '.join(type(f).name for f in fs)}" for n, fs in self.plan.items())


@contextmanager
def session(model: nn.Module, config: str | os.PathLike | InspectConfig) -> Iterator[Session]:
    """Inspect ``model`` (prepared + calibrated, or converted) with a YAML config (path or text).

    The config is checked against the model's recorded layers before anything runs; the model is
    back to normal execution when the block exits, also on exceptions.
    """
    cfg = load_config(config)
    layers = recorded_layers(model)
    plan = cfg.plan(layers)
    s = Session(plan)
    inspector = Inspector(plan, layers, s._log)

    def before(module: nn.Module, args: Any) -> None:
        inspector.step = s.steps

    def after(module: nn.Module, args: Any, out: Any) -> None:
        s.steps += 1

    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    try:
        with attached(model, inspector):
            yield s
    finally:
        for h in handles:
            h.remove()


def format_records(records: list[dict[str, Any]], *, stats: tuple[str, ...] | None = None,
                   step: int | None = None, layers: str | None = None, digits: int = 4) -> str:
    """A text table: one row per (layer, tensor), one column per stat, values of ``step`` (default: the
    last step logged for that row). ``layers`` is a regex filter on layer names."""
    import re

    if stats is None:
        stats = tuple(dict.fromkeys(r["stat"] for r in records))
    rows: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}
    for r in records:
        if r["stat"] not in stats or (step is not None and r["step"] != step):
            continue
        if layers is not None and re.search(layers, r["layer"]) is None:
            continue
        cell = rows.setdefault((r["layer"], r["tensor"]), {})
        if r["stat"] not in cell or cell[r["stat"]][0] <= r["step"]:
            cell[r["stat"]] = (r["step"], r["value"])
    if not rows:
        return "(no records)"
    lw = max(max(len(k[0]) for k in rows), 5)
    tw = max(max(len(k[1]) for k in rows), 6)
    cw = max(max(len(s) for s in stats), digits + 7)
    head = f"{'layer':<{lw}}  {'tensor':<{tw}}  " + "  ".join(f"{s:>{cw}}" for s in stats)
    lines = [head, "-" * len(head)]
    for (layer, tensor), cell in rows.items():
        vals = [f"{cell[s][1]:>{cw}.{digits}g}" if s in cell else f"{'':>{cw}}" for s in stats]
        lines.append(f"{layer:<{lw}}  {tensor:<{tw}}  " + "  ".join(vals))
    return "\n".join(lines)
