"""Frozen configs: validation, equality/hashing, and that create() builds the configured observer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dbr_quant.formats import FP8Format
from dbr_quant.observers import (
    MSE,
    AmaxHistory,
    AmaxHistoryObserver,
    MovingAverage,
    MovingAverageObserver,
    MSEObserver,
    ObserverConfig,
    Percentile,
    PercentileObserver,
    RunningMax,
    RunningMaxObserver,
)


@pytest.mark.parametrize(("cfg", "cls", "attrs"), [
    (RunningMax(), RunningMaxObserver, {}),
    (MovingAverage(0.2), MovingAverageObserver, {"momentum": 0.2}),
    (AmaxHistory(8, "most_recent", 3), AmaxHistoryObserver,
     {"history_len": 8, "algo": "most_recent", "margin": 3}),
    (Percentile(99.5), PercentileObserver, {"percentile": 99.5}),
    (MSE(10, 0.5), MSEObserver, {"num_candidates": 10, "min_ratio": 0.5}),
])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_create_builds_configured_observer(cfg, cls, attrs, axis):
    obs = cfg.create(FP8Format.E5M2, axis)
    assert type(obs) is cls
    assert obs.fmt is FP8Format.E5M2 and obs.axis == axis
    for name, value in attrs.items():
        assert getattr(obs, name) == value
    assert isinstance(cfg, ObserverConfig)
    # every create() gives an independent observer
    other = cfg.create(FP8Format.E5M2, axis)
    obs(torch.ones(2, 2))
    assert not other.calibrated


def test_history_margin_reaches_scale():
    obs = AmaxHistory(margin=3).create(FP8Format.E4M3, None)
    obs(torch.tensor([448.0]))
    assert obs.scale().item() == 8.0


def test_configs_are_frozen_hashable_and_comparable():
    cfg = MovingAverage(0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.momentum = 0.1  # type: ignore[misc]
    assert cfg == MovingAverage(0.5) and cfg != MovingAverage(0.25)
    assert len({RunningMax(), RunningMax(), MSE(), MSE(16)}) == 3
    assert not isinstance(object(), ObserverConfig)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: MovingAverage(0.0), "momentum"),
    (lambda: MovingAverage(float("nan")), "momentum"),
    (lambda: MovingAverage("0.1"), "momentum"),
    (lambda: AmaxHistory(history_len=0), "history_len"),
    (lambda: AmaxHistory(history_len=2.0), "history_len"),
    (lambda: AmaxHistory(algo="MAX"), "algo"),
    (lambda: AmaxHistory(margin=0.5), "margin"),
    (lambda: AmaxHistory(margin=-2), "margin"),
    (lambda: Percentile(-1), "percentile"),
    (lambda: Percentile(101), "percentile"),
    (lambda: MSE(num_candidates=1), "num_candidates"),
    (lambda: MSE(num_candidates=True), "num_candidates"),
    (lambda: MSE(min_ratio=0), "min_ratio"),
    (lambda: MSE(min_ratio=1.01), "min_ratio"),
])
def test_config_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()
