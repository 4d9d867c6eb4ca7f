"""Amax observers (buffer-backed ``nn.Module``s) and the frozen configs that create them."""

from .amax import (
    AmaxHistoryObserver,
    MovingAverageObserver,
    MSEObserver,
    PercentileObserver,
    RunningMaxObserver,
)
from .base import AmaxObserver
from .config import MSE, AmaxHistory, MovingAverage, ObserverConfig, Percentile, RunningMax

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
