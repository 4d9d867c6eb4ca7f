"""Amax observers (buffer-backed ``nn.Module``s) and the frozen configs that create them."""

from dbr_quant.observers.amax import (
    AmaxHistoryObserver,
    MovingAverageObserver,
    MSEObserver,
    PercentileObserver,
    RunningMaxObserver,
)
from dbr_quant.observers.base import AmaxObserver
from dbr_quant.observers.config import MSE, AmaxHistory, MovingAverage, ObserverConfig, Percentile, RunningMax

__all__ = [
    "MSE",
    "AmaxHistory",
    "AmaxHistoryObserver",
    "AmaxObserver",
    "MSEObserver",
    "MovingAverage",
    "MovingAverageObserver",
    "ObserverConfig",
    "Percentile",
    "PercentileObserver",
    "RunningMax",
    "RunningMaxObserver",
]
