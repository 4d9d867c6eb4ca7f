"""auto_fallback: keep the fewest layers in high precision so the model output meets a target.

Algorithm (greedy by sensitivity, then pruned):
1. rank layers by :func:`~dbr_quant.inspect.sensitivity.sensitivity` (output quality with only that layer
   in FP8), worst first;
2. trade-off curve: put the k worst layers in high precision for k = 0, 1, … and measure the output
   with every other layer in FP8; the first k that meets the target is the candidate (with
   ``full_curve=True`` the curve continues to k = all layers, for plotting);
3. prune: try each candidate layer back in FP8, least sensitive first, and keep it in FP8 when the
   target still holds (layer errors interact, so the greedy prefix can hold layers it does not need).

The result applies as a ``QConfig`` (``Override(pattern="^fqn$", skip=True)`` per fallback layer, ahead
of the model's own overrides) for a new prepare(), or as an inspect YAML with ``DisableFP8``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ..mappings import LINEAR
from ..qconfig import Override, QConfig
from .inspector import model_record
from .sensitivity import LayerSensitivity, Metrics, OutputFn, _Evaluator, _sensitivity, fp8_flop_fraction


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
    target: float
    met: bool
    fallback: tuple[str, ...]  # layers that stay in high precision
    cosine: float
    sqnr_db: float
    fp8_flop_fraction: float  # of recorded linear FLOPs that stay FP8
    curve: tuple[CurvePoint, ...]
    sensitivity: tuple[LayerSensitivity, ...]
    base_qconfig: QConfig
    evaluations: int  # model evaluations spent (each runs all batches)

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

    def summary(self) -> str:
        status = "met" if self.met else "NOT met"
        return (f"target {self.metric} >= {self.target:g}: {status} with {len(self.fallback)} layer(s) in high "
                f"precision → cosine {self.cosine:.5f}, SQNR {self.sqnr_db:.2f} dB, FP8 share of linear FLOPs "
                f"{100 * self.fp8_flop_fraction:.1f}%\n  fallback: {list(self.fallback)}")


def auto_fallback(model: nn.Module, batches: Sequence[Any], *, target: float, metric: str = "cosine",
                  output_fn: OutputFn | None = None, reference: nn.Module | None = None,
                  full_curve: bool = True, prune: bool = True,
                  sensitivity: Sequence[LayerSensitivity] | None = None) -> FallbackResult:
    """Choose layers to keep in high precision so ``metric`` ("cosine" or "sqnr_db") of the output vs the
    reference reaches ``target``. ``model``: prepared + calibrated (exact fp32 reference) or converted
    (then pass ``reference=`` the fp32 model for a true fp32 reference). ``sensitivity`` reuses a ranking."""
    Metrics(0.0, 0.0).get(metric)
    ev = _Evaluator(model, batches, output_fn, reference)
    sens = list(sensitivity) if sensitivity is not None else _sensitivity(ev, None, metric)
    order = [s.layer for s in sorted(sens, key=lambda s: Metrics(s.cosine, s.sqnr_db).get(metric))]
    meets = lambda m: m.get(metric) >= target  # noqa: E731

    curve: list[CurvePoint] = []
    chosen: list[str] | None = None
    chosen_metrics: Metrics | None = None
    for k in range(len(order) + 1):
        layers = order[:k]
        m = ev.metrics(layers)
        curve.append(CurvePoint(k, tuple(layers), m.cosine, m.sqnr_db, fp8_flop_fraction(model, layers)))
        if chosen is None and meets(m):
            chosen, chosen_metrics = list(layers), m
            if not full_curve:
                break
    if chosen is None:  # unreachable (a converted model against real fp32): report the best point
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
        sensitivity=tuple(sens), base_qconfig=model_record(model).qconfig, evaluations=ev.evaluations)


def plot_tradeoff(result: FallbackResult, ax=None):
    """Metric (left axis) and FP8 share of linear FLOPs (right axis) vs the number of fallback layers."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    ks = [p.n_fallback for p in result.curve]
    vals = [Metrics(p.cosine, p.sqnr_db).get(result.metric) for p in result.curve]
    finite = [v if math.isfinite(v) else float("nan") for v in vals]
    ax.plot(ks, finite, "o-", color="tab:blue", ms=3, label=result.metric)
    ax.axhline(result.target, color="tab:blue", ls="--", lw=1, label=f"target {result.target:g}")
    ax.plot([len(result.fallback)], [result.value], "*", color="k", ms=12, label="chosen (after pruning)")
    ax.set_xlabel("layers kept in high precision (greedy, worst first)")
    ax.set_ylabel(f"output {result.metric} vs fp32")
    ax2 = ax.twinx()
    ax2.plot(ks, [100 * p.fp8_flop_fraction for p in result.curve], "s-", color="tab:orange", ms=3)
    ax2.set_ylabel("FP8 share of linear FLOPs (%)", color="tab:orange")
    ax2.set_ylim(0, 105)
    ax.legend(loc="center right", fontsize=8)
    ax.set_title("auto_fallback trade-off")
    return ax
