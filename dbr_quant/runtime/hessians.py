"""``QConfig(weight_rounding="gptq")`` in the product: Hessians during ``calibrate``, GPTQ rounding at ``convert``.

``prepare`` gives the model record a :class:`HessianCollector` when some op's resolved config asks for GPTQ
(else None: nearest rounding costs nothing extra). During calibration, ``CalibrateRun`` hands it each call of a
linear module; it keeps one :class:`HessianAccumulator` per such module (keyed by the module's fqn: a module
called several times per forward adds every call's inputs) with the fold = index of the calibration forward
modulo ``GPTQOptions.folds``, so a batch's tokens are never split across folds.

Memory: folds · in_features² · 8 bytes (fp64 sums) per GPTQ linear, on the device its inputs arrive on, held
from the first calibration batch until convert (e.g. 2 folds: 2.4 MB for a 384-wide MiniLM linear, 268 MB
for a 4096-wide one, 3.3 GB for a 14336-wide down projection). Where that does not fit, restrict GPTQ to the
linears that need it with ``Override(pattern=..., weight_rounding="gptq")`` and a ``"nearest"`` default, or go
module by module: one prepare → calibrate → convert pass per group of linears that fits, GPTQ only for that
group, keeping that group's ``weight`` entries from each pass's state_dict. Calibration runs in fp32, so every
pass has the same scales and the merged state_dict equals the one-pass model (tested); it costs one
calibration per group.
``convert`` frees each accumulator as soon as its linear is rounded; ``convert(inplace=False)`` copies the
prepared model (and its accumulators) first, as it copies the weights.

MoE experts modules (3-D weights, ``moe/weights.py``) stay on nearest rounding.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dbr_quant.ops.mappings import LINEAR
from dbr_quant.qconfig import GPTQOptions, QConfig, TensorQConfig
from dbr_quant.quantize.rounding.damping import DampingChoice, gptq_quantize
from dbr_quant.quantize.rounding.hessian import HessianAccumulator


@dataclass(frozen=True)
class GPTQRecord:
    """What convert did for one linear: the damping it chose (and the CV scores) and how long it took."""

    damping: DampingChoice
    seconds: float
    tokens: int


class HessianCollector:
    """Per-module Hessian accumulators of a prepared model's GPTQ linears (see the module docstring)."""

    def __init__(self, options: GPTQOptions) -> None:
        self.options = options
        self.accumulators: dict[str, HessianAccumulator] = {}
        self.forwards = 0  # calibration forwards seen: fold = forward index mod folds
        self._last_run: Any = None  # weakref to the CalibrateRun of the forward now running
        self._warned_unreached = False
        self.synced_at: int | None = None  # ``forwards`` when the sums were last summed across ranks
        self.rounded: dict[str, GPTQRecord] = {}  # filled by convert

    def __getstate__(self) -> dict:  # deepcopy (convert without inplace): the run is not part of the state
        state = dict(self.__dict__)
        state["_last_run"] = None
        return state

    @staticmethod
    def wants(op: Any) -> bool:
        """Whether convert rounds this recorded op's weight with GPTQ."""
        return (op.kind == LINEAR and op.quantize and op.weight_owner is not None
                and op.qconfig.weight_rounding == "gptq")

    @torch.no_grad()
    def observe(self, run: Any, op: Any, args: tuple, kwargs: dict) -> None:
        """One call of a linear module during calibration (``run`` is its forward's CalibrateRun)."""
        if not self.wants(op):
            return
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, Tensor):
            return
        if self._last_run is None or self._last_run() is not run:
            self._last_run = weakref.ref(run)
            self.forwards += 1
        acc = self.accumulators.get(op.weight_owner)
        if acc is None:
            with torch.inference_mode(False):
                acc = HessianAccumulator(x.shape[-1], folds=self.options.folds, device=x.device)
            self.accumulators[op.weight_owner] = acc
        acc.add(x, fold=(self.forwards - 1) % self.options.folds)

    def has_data(self, fqn: str) -> bool:
        acc = self.accumulators.get(fqn)
        return acc is not None and bool(acc.nonempty_folds())

    def round(self, fqn: str, module_type: str, w: Tensor, cfg: TensorQConfig, scale: Tensor, nearest: Tensor,
              keep: bool = False) -> Tensor:
        """The GPTQ-rounded FP8 weight of ``fqn`` on the grid of ``scale`` (the scale nearest rounding uses;
        ``nearest`` is that rounding, returned for a linear no calibration batch reached). Frees the module's
        accumulator and records the damping (convert) unless ``keep`` (inspection of a prepared model)."""
        if cfg.granularity not in ("channel", "tensor"):
            raise ValueError(f"convert(): weight_rounding='gptq' on '{fqn}' ({module_type}) needs per-channel or "
                             f"per-tensor weights, not {cfg.granularity!r}: give it weight_rounding='nearest'")
        acc = self.accumulators.get(fqn) if keep else self.accumulators.pop(fqn, None)
        if acc is None or not acc.nonempty_folds():
            if self.forwards == 0:
                raise ValueError(f"convert(): '{fqn}' ({module_type}) has weight_rounding='gptq' but the model saw no "
                                 "calibration batches: run dbr_quant.calibrate(prepared, batches) first (GPTQ needs "
                                 "calibration also with dynamic=True)")
            # calibrated, but no batch reached this linear (an expert never routed to, a branch not taken):
            # nothing to fit, so nearest rounding, as its activation scale comes from elsewhere too
            if not keep:
                self.rounded[fqn] = GPTQRecord(DampingChoice(math.inf, {}, False), 0.0, 0)
                if not self._warned_unreached:
                    self._warned_unreached = True
                    warnings.warn(f"dbr_quant.convert(): no calibration batch reached '{fqn}' ({module_type}) and "
                                  "maybe other weight_rounding='gptq' linears: they are rounded to nearest "
                                  "(gptq_report(model) lists them with 0 tokens)", stacklevel=4)
            return nearest
        start = time.perf_counter()
        o = self.options
        result = gptq_quantize(w, acc, cfg.format, cfg.granularity, scale=scale, candidates=o.dampings,
                               block_size=o.block_size, act_order=o.act_order)
        if not keep:
            self.rounded[fqn] = GPTQRecord(result.damping, time.perf_counter() - start, int(acc.tokens.sum()))
        return result.qdata


def collector_for(qconfig: QConfig, states: list) -> HessianCollector | None:
    """A collector when some recorded op's config asks for GPTQ, else None."""
    if any(HessianCollector.wants(op) for st in states for op in st.seen_ops):
        return HessianCollector(qconfig.gptq)
    return None


def gptq_report(model: torch.nn.Module) -> dict[str, GPTQRecord]:
    """Per GPTQ-rounded linear of a converted model: the chosen damping, CV scores, seconds, tokens."""
    record = model.__dict__.get("_dbr_record")
    collector = getattr(record, "hessians", None)
    return dict(collector.rounded) if collector is not None else {}
