"""Typed, frozen observer configs: say *which* observer (and its settings) without building it yet.

A quantisation recipe holds configs; ``create(fmt, axis)`` builds a fresh observer for each tensor once
the format and channel axis are known.  Arguments are validated at construction, so a bad recipe fails
where it is written rather than deep inside calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

from dbr_quant.formats import FP8Format
from dbr_quant.observers.amax import (
    AmaxHistoryObserver,
    MovingAverageObserver,
    MSEObserver,
    PercentileObserver,
    RunningMaxObserver,
    check_history,
    check_momentum,
    check_mse,
    check_percentile,
)
from dbr_quant.observers.base import AmaxObserver


@dataclass(frozen=True)
class RunningMax:
    """Max of |x| over everything seen."""

    def create(self, fmt: FP8Format, axis: int | None) -> AmaxObserver:
        return RunningMaxObserver(fmt, axis)


@dataclass(frozen=True)
class MovingAverage:
    """EMA of per-batch amax; ``momentum`` in (0, 1] is the weight of each new batch."""

    momentum: float = 0.01

    def __post_init__(self) -> None:
        check_momentum(self.momentum)

    def create(self, fmt: FP8Format, axis: int | None) -> AmaxObserver:
        return MovingAverageObserver(fmt, axis, momentum=self.momentum)


@dataclass(frozen=True)
class AmaxHistory:
    """Transformer Engine delayed scaling: window of ``history_len`` batch amaxes, ``algo`` "max" or
    "most_recent", scale multiplied by ``2**margin``."""

    history_len: int = 16
    algo: str = "max"
    margin: int = 0

    def __post_init__(self) -> None:
        check_history(self.history_len, self.algo, self.margin)

    def create(self, fmt: FP8Format, axis: int | None) -> AmaxObserver:
        return AmaxHistoryObserver(fmt, axis, history_len=self.history_len, algo=self.algo,
                                   margin=self.margin)


@dataclass(frozen=True)
class Percentile:
    """Mean over batches of the ``percentile``-th percentile (0 < p <= 100) of |x|."""

    percentile: float = 99.99

    def __post_init__(self) -> None:
        check_percentile(self.percentile)

    def create(self, fmt: FP8Format, axis: int | None) -> AmaxObserver:
        return PercentileObserver(fmt, axis, percentile=self.percentile)


@dataclass(frozen=True)
class MSE:
    """Mean over batches of the clip in ``[min_ratio, 1] * amax`` (``num_candidates`` steps) minimising
    FP8 fake-quantisation MSE."""

    num_candidates: int = 32
    min_ratio: float = 0.3

    def __post_init__(self) -> None:
        check_mse(self.num_candidates, self.min_ratio)

    def create(self, fmt: FP8Format, axis: int | None) -> AmaxObserver:
        return MSEObserver(fmt, axis, num_candidates=self.num_candidates, min_ratio=self.min_ratio)


ObserverConfig = RunningMax | MovingAverage | AmaxHistory | Percentile | MSE
