"""auto_fallback: keep the fewest layers in high precision so the model output meets a target.

Algorithm (greedy by sensitivity, then pruned):
1. rank layers by :func:`~dbr_quant.inspect.sensitivity.sensitivity` (output quality with only that layer
   in FP8), worst first;
2. trade-off curve: put the k worst layers in high precision for k = 0, 1, … and measure the output
   with every other layer in FP8; the first k that meets the target is the candidate (with
   ``full_curve=True`` the curve continues to k = all layers, for plotting);
3. prune: try each candidate layer back in FP8, least sensitive first, and keep it in FP8 when the
   target still holds (layer errors interact, so the greedy prefix can hold layers it does not need).

With ``rank="error_per_flop"`` step 1 orders layers by the output error each causes alone in FP8 divided
by the FLOPs it would keep in high precision (cheap, harmful layers first), and ``max_high_precision_flops``
caps the high-precision share: step 2 walks that order and takes each layer whose FLOPs still fit the budget
(a layer that does not fit is passed over for later, smaller ones). Without ``target`` the result is the best
point of that curve. The curve (metric and FP8 share of linear FLOPs per step) is ``result.curve``;
``result.curve_table()`` prints it.

The result applies as a ``QConfig`` (``Override(pattern="^fqn$", skip=True)`` per fallback layer, ahead
of the model's own overrides) for a new prepare(), or as an inspect YAML with ``DisableFP8``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from dbr_quant.inspect.features import DisableFP8, Feature
from dbr_quant.inspect.inspector import Inspector
from dbr_quant.inspect.layers import attached, model_record, recorded_layers
from dbr_quant.inspect.sensitivity import (
    LayerSensitivity,
    Metrics,
    OutputFn,
    _Evaluator,
    _original_weights,
    _sensitivity,
    fp8_flop_fraction,
    linear_flops,
    rank_layers,
)
from dbr_quant.ops.mappings import LINEAR
from dbr_quant.qconfig import Override, QConfig


@dataclass(frozen=True)
class CurvePoint:
    n_fallback: int
    layers: tuple[str, ...]  # in high precision
    cosine: float
    sqnr_db: float
    fp8_flop_fraction: float


@dataclass(frozen=True)
class FallbackResult:
    metric: str
    target: float | None  # None: the best point under the FLOP budget
    met: bool
    fallback: tuple[str, ...]  # layers that stay in high precision
    cosine: float
    sqnr_db: float
    fp8_flop_fraction: float  # of recorded linear FLOPs that stay FP8
    curve: tuple[CurvePoint, ...]
    sensitivity: tuple[LayerSensitivity, ...]
    base_qconfig: QConfig
    evaluations: int  # model evaluations spent (each runs all batches)
    rank: str = "error"
    max_high_precision_flops: float | None = None  # budget: fraction of recorded linear FLOPs

    @property
    def value(self) -> float:
        return Metrics(self.cosine, self.sqnr_db).get(self.metric)

    def qconfig(self, base: QConfig | None = None) -> QConfig:
        """``base`` (default: the inspected model's QConfig) with the fallback layers skipped. Overrides match
        op fqns, so a repeated functional op (``attn.matmul#1``) skips every ``attn.matmul``."""
        base = self.base_qconfig if base is None else base
        fqns = dict.fromkeys(re.sub(r"#\d+$", "", n) for n in self.fallback)
        skips = tuple(Override(pattern=f"^{re.escape(n)}$", skip=True) for n in fqns)
        return replace(base, overrides=skips + tuple(base.overrides))

    def to_yaml(self) -> str:
        """An inspect config that runs the fallback layers in high precision."""
        if not self.fallback:
            return ""
        regex = "^(" + "|".join(re.escape(n) for n in self.fallback) + ")$"
        return f"auto_fallback:\n  layers:\n    name_regex: '{regex}'\n  features:\n    DisableFP8: {{}}\n"

    def curve_table(self) -> str:
        """The trade-off curve as text: one row per step (layers in high precision, FP8 FLOP share, metric)."""
        lines = [f"{'k':>3}  {'FP8 FLOPs':>9}  {'cosine':>8}  {'SQNR dB':>7}  added to high precision"]
        prev: tuple[str, ...] = ()
        for p in self.curve:
            added = ", ".join(n for n in p.layers if n not in prev) or "-"
            lines.append(f"{p.n_fallback:>3}  {100 * p.fp8_flop_fraction:>8.1f}%  {p.cosine:>8.5f}  "
                         f"{p.sqnr_db:>7.2f}  {added}")
            prev = p.layers
        return "\n".join(lines)

    def summary(self) -> str:
        status = "met" if self.met else "NOT met"
        budget = "" if self.max_high_precision_flops is None else \
            f", ≤ {100 * self.max_high_precision_flops:g}% of linear FLOPs in high precision, rank {self.rank}"
        if self.target is None:
            return (f"best {self.metric}{budget}: {len(self.fallback)} layer(s) in high precision → cosine "
                    f"{self.cosine:.5f}, SQNR {self.sqnr_db:.2f} dB, FP8 share of linear FLOPs "
                    f"{100 * self.fp8_flop_fraction:.1f}%\n  fallback: {list(self.fallback)}")
        return (f"target {self.metric} >= {self.target:g}{budget}: {status} with {len(self.fallback)} layer(s) in high "
                f"precision → cosine {self.cosine:.5f}, SQNR {self.sqnr_db:.2f} dB, FP8 share of linear FLOPs "
                f"{100 * self.fp8_flop_fraction:.1f}%\n  fallback: {list(self.fallback)}")


def auto_fallback(model: nn.Module, batches: Sequence[Any], *, target: float | None = None,
                  metric: str = "cosine", output_fn: OutputFn | None = None, reference: nn.Module | None = None,
                  full_curve: bool = True, prune: bool = True,
                  sensitivity: Sequence[LayerSensitivity] | None = None, rank: str = "error",
                  max_high_precision_flops: float | None = None) -> FallbackResult:
    """Choose layers to keep in high precision so ``metric`` ("cosine" or "sqnr_db") of the output vs the
    reference reaches ``target``. ``model``: prepared + calibrated (exact fp32 reference) or converted
    (then pass ``reference=`` the fp32 model: a true fp32 reference, and high-precision layers run with its
    weights). ``sensitivity`` reuses a ranking. ``rank``: "error" (worst layer first) or "error_per_flop";
    ``max_high_precision_flops``: the most FLOPs the fallback may keep in high precision, as a fraction of the
    recorded linear FLOPs (matmul/attention layers count against it too). ``target=None`` (with a budget):
    the best point of the curve."""
    Metrics(0.0, 0.0).get(metric)
    if target is None and max_high_precision_flops is None:
        raise ValueError("auto_fallback: give a target, a max_high_precision_flops budget, or both")
    if max_high_precision_flops is not None and not 0.0 <= max_high_precision_flops <= 1.0:
        raise ValueError(f"auto_fallback: max_high_precision_flops is a fraction of the linear FLOPs in [0, 1], "
                         f"got {max_high_precision_flops!r}")
    ev = _Evaluator(model, batches, output_fn, reference)
    sens = list(sensitivity) if sensitivity is not None else _sensitivity(ev, None, metric)
    ranked = rank_layers(sens, metric, rank)
    if max_high_precision_flops is None:
        order = [s.layer for s in ranked]
    else:  # take layers in rank order while they fit the budget; one that does not is passed over
        budget, used, order = max_high_precision_flops * linear_flops(model), 0, []
        for s in ranked:
            if used + s.flops <= budget:
                order.append(s.layer)
                used += s.flops
    meets = (lambda m: True) if target is None else (lambda m: m.get(metric) >= target)  # noqa: E731
    if target is None:
        full_curve = True  # the best point needs the whole curve

    curve: list[CurvePoint] = []
    chosen: list[str] | None = None
    chosen_metrics: Metrics | None = None
    for k in range(len(order) + 1):
        layers = order[:k]
        m = ev.metrics(layers)
        curve.append(CurvePoint(k, tuple(layers), m.cosine, m.sqnr_db, fp8_flop_fraction(model, layers)))
        if chosen is None and target is not None and meets(m):
            chosen, chosen_metrics = list(layers), m
            if not full_curve:
                break
    if chosen is None:  # no target, or unreachable (a converted model against real fp32): the best point
        best = max(curve, key=lambda p: Metrics(p.cosine, p.sqnr_db).get(metric))
        chosen, chosen_metrics = list(best.layers), Metrics(best.cosine, best.sqnr_db)
    elif prune and chosen:
        for name in reversed(list(chosen)):  # least sensitive first
            trial = [n for n in chosen if n != name]
            m = ev.metrics(trial)
            if meets(m):
                chosen, chosen_metrics = trial, m
    assert chosen_metrics is not None
    return FallbackResult(
        metric=metric, target=target, met=meets(chosen_metrics), fallback=tuple(chosen),
        cosine=chosen_metrics.cosine, sqnr_db=chosen_metrics.sqnr_db,
        fp8_flop_fraction=fp8_flop_fraction(model, chosen, (LINEAR,)), curve=tuple(curve),
        sensitivity=tuple(sens), base_qconfig=model_record(model).qconfig, evaluations=ev.evaluations,
        rank=rank, max_high_precision_flops=max_high_precision_flops)


@contextmanager
def fallback_applied(model: nn.Module, high_precision: Iterable[str], reference: nn.Module | None = None
                     ) -> Iterator[None]:
    """Inside the block, forwards of ``model`` (prepared + calibrated, or converted) run the ``high_precision``
    layers (e.g. ``result.fallback``) in high precision and every other recorded layer in FP8 — what
    ``prepare(..., result.qconfig())`` → convert gives, without converting again. On a converted model
    ``reference`` (the fp32 model) supplies the high-precision layers' original weights."""
    layers = recorded_layers(model)
    hp = set(high_precision)
    unknown = hp - set(layers)
    if unknown:
        raise ValueError(f"fallback_applied: not recorded quantized layers: {sorted(unknown)}")
    inspector = Inspector({n: (DisableFP8(),) if n in hp else (Feature(),) for n in layers}, layers)
    if reference is not None:
        inspector.hp_weights = _original_weights(model, reference)
    with attached(model, inspector):
        yield


def plot_tradeoff(result: FallbackResult, ax=None):
    """Metric (left axis) and FP8 share of linear FLOPs (right axis) vs the number of fallback layers."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    ks = [p.n_fallback for p in result.curve]
    vals = [Metrics(p.cosine, p.sqnr_db).get(result.metric) for p in result.curve]
    finite = [v if math.isfinite(v) else float("nan") for v in vals]
    ax.plot(ks, finite, "o-", color="tab:blue", ms=3, label=result.metric)
    if result.target is not None:
        ax.axhline(result.target, color="tab:blue", ls="--", lw=1, label=f"target {result.target:g}")
    ax.plot([len(result.fallback)], [result.value], "*", color="k", ms=12, label="chosen (after pruning)")
    ax.set_xlabel(f"layers kept in high precision (greedy, rank {result.rank})")
    ax.set_ylabel(f"output {result.metric} vs fp32")
    ax2 = ax.twinx()
    ax2.plot(ks, [100 * p.fp8_flop_fraction for p in result.curve], "s-", color="tab:orange", ms=3)
    ax2.set_ylabel("FP8 share of linear FLOPs (%)", color="tab:orange")
    ax2.set_ylim(0, 105)
    ax.legend(loc="center right", fontsize=8)
    ax.set_title("auto_fallback trade-off")
    return ax
