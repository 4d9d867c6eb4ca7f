"""Behaviour shared by every observer: non-finite handling, scales, buffers/state_dict, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch import nn

from dbr_quant.formats import FP8Format
from dbr_quant.observers import (
    MSE,
    AmaxHistory,
    AmaxHistoryObserver,
    AmaxObserver,
    MovingAverage,
    MovingAverageObserver,
    MSEObserver,
    Percentile,
    PercentileObserver,
    RunningMax,
    RunningMaxObserver,
)

CONFIGS = [RunningMax(), MovingAverage(0.1), AmaxHistory(4), Percentile(99.0), MSE(8)]
IDS = ["running_max", "moving_average", "history", "percentile", "mse"]
KINDS = pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
NAN, INF = float("nan"), float("inf")


def finite_abs_max(x: np.ndarray) -> float:
    a = np.abs(x[np.isfinite(x)].astype(np.float64))
    return float(a.max()) if a.size else 0.0


@KINDS
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_nonfinite_ignored_and_counted(cfg, axis):
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(3, 40, generator=g)
    dirty = clean.clone()
    dirty[0, 1], dirty[1, 2], dirty[2, 3] = NAN, INF, -INF
    ref_clean = clean.clone()
    ref_clean[0, 1] = ref_clean[1, 2] = ref_clean[2, 3] = 0.0  # zeros never raise |x| statistics...
    obs = cfg.create(FP8Format.E4M3, axis)
    obs(dirty)
    assert obs.nonfinite.item() == 3
    assert torch.isfinite(obs.amax).all()
    if isinstance(obs, (RunningMaxObserver, MovingAverageObserver, AmaxHistoryObserver)):
        expected = np.abs(ref_clean.numpy()).max() if axis is None else \
            np.abs(ref_clean.numpy()).max(axis=1 if axis == 0 else 0)
        np.testing.assert_allclose(obs.amax.numpy(), expected, rtol=0)
    if isinstance(obs, PercentileObserver) and axis is None:  # ...but would move a percentile: drop them
        finite = dirty.numpy()[np.isfinite(dirty.numpy())]
        np.testing.assert_allclose(obs.amax.item(), np.percentile(np.abs(finite), 99.0), rtol=1e-5)


@KINDS
def test_all_nonfinite_and_empty_batches_leave_statistic(cfg):
    obs = cfg.create(FP8Format.E4M3, None)
    obs(torch.tensor([1.0, -3.0]))
    before = obs.amax.clone()
    obs(torch.tensor([NAN, INF, -INF]))
    obs(torch.empty(0))
    assert torch.equal(obs.amax, before)
    assert obs.nonfinite.item() == 3
    assert obs.num_updates.item() == 3


@KINDS
def test_all_nonfinite_channel_keeps_its_value(cfg):
    obs = cfg.create(FP8Format.E4M3, 0)
    obs(torch.tensor([[1.0, 2.0], [4.0, -4.0]]))
    before = obs.amax.clone()
    obs(torch.tensor([[NAN, NAN], [4.0, 4.0]]))
    assert obs.amax[0].item() == before[0].item()
    assert obs.nonfinite.item() == 2


@KINDS
@pytest.mark.parametrize("axis", [None, 1])
def test_all_zero_gives_scale_exactly_one(cfg, axis):
    obs = cfg.create(FP8Format.E4M3, axis)
    obs(torch.zeros(3, 5))
    assert torch.equal(obs.scale(), torch.ones(() if axis is None else (5,)))


@KINDS
def test_only_nonfinite_ever_gives_scale_one(cfg):
    obs = cfg.create(FP8Format.E5M2, None)
    obs(torch.tensor([NAN, INF]))
    assert obs.calibrated
    assert obs.scale().item() == 1.0


@pytest.mark.parametrize("axis", [None, 0])
def test_e4m3_vs_e5m2_scale(axis):
    x = torch.tensor([[3.5, -7.0, 1.0], [0.25, 100.0, -2.0]])
    e4, e5 = RunningMaxObserver(FP8Format.E4M3, axis), RunningMaxObserver(FP8Format.E5M2, axis)
    e4(x)
    e5(x)
    amax = np.array(100.0) if axis is None else np.array([7.0, 100.0])
    np.testing.assert_allclose(e4.scale().numpy(), amax / 448.0, rtol=1e-7)
    np.testing.assert_allclose(e5.scale().numpy(), amax / 57344.0, rtol=1e-7)
    assert e4.scale().dtype == torch.float32


special = st.sampled_from([0.0, -0.0, NAN, INF, -INF, 1e-45, -1e-40, 1e-38, 3.0e38, -3.4e38, 1.0])
floats = st.floats(width=32, allow_nan=True, allow_infinity=True) | special


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5),
                 elements=floats),
    kind=st.integers(0, len(CONFIGS) - 1),
    fmt=st.sampled_from(list(FP8Format)),
    per_channel=st.booleans(),
)
def test_scale_always_finite_positive(x, kind, fmt, per_channel):
    axis = -1 if per_channel else None
    obs = CONFIGS[kind].create(fmt, axis)
    t = torch.from_numpy(x)
    obs(t)
    obs(t * 0.5)
    s = obs.scale()
    assert torch.isfinite(s).all() and (s > 0).all()
    assert obs.nonfinite.item() == 2 * int((~np.isfinite(x)).sum())
    if kind == 0 and not per_channel:
        assert obs.amax.item() == finite_abs_max(x)


def test_dtypes_widened_and_fp64_clamped():
    obs = RunningMaxObserver(FP8Format.E4M3)
    obs(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    obs(torch.tensor([3.0, INF], dtype=torch.float16))
    assert obs.amax.item() == 3.0 and obs.nonfinite.item() == 1
    obs(torch.tensor([1e300, -5.0], dtype=torch.float64))
    assert obs.amax.item() == torch.finfo(torch.float32).max
    assert obs.nonfinite.item() == 1
    assert torch.isfinite(obs.scale())


def test_non_float_input_rejected():
    with pytest.raises(TypeError, match="RunningMaxObserver"):
        RunningMaxObserver(FP8Format.E4M3)(torch.arange(4))


# ----------------------------------------------------------------------------------------- buffers/state
@KINDS
def test_buffers_in_state_dict(cfg):
    obs = cfg.create(FP8Format.E4M3, None)
    keys = set(obs.state_dict())
    assert {"amax", "nonfinite", "num_updates"} <= keys
    assert obs.nonfinite.dtype == torch.int64 and obs.num_updates.dtype == torch.int64
    assert obs.nonfinite.shape == () and obs.num_updates.shape == () and obs.amax.shape == ()


@KINDS
@pytest.mark.parametrize("axis", [0, -1])
def test_fresh_observer_loads_per_channel_state(cfg, axis):
    g = torch.Generator().manual_seed(5)
    src = cfg.create(FP8Format.E4M3, axis)
    for _ in range(3):
        src(torch.randn(4, 7, generator=g))
    state = src.state_dict()
    dst = cfg.create(FP8Format.E4M3, axis)
    assert dst.amax.shape == (0,)
    dst.load_state_dict(state)
    assert dst.calibrated
    assert torch.equal(dst.scale(), src.scale())
    # calibration continues identically after the load
    nxt = torch.randn(4, 7, generator=g)
    src(nxt)
    dst(nxt)
    assert torch.equal(dst.amax, src.amax)


def test_sized_observer_rejects_other_channel_count():
    a, b = RunningMaxObserver(FP8Format.E4M3, 0), RunningMaxObserver(FP8Format.E4M3, 0)
    a(torch.ones(3, 2))
    b(torch.ones(5, 2))
    with pytest.raises(RuntimeError, match="size mismatch"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="3 channels"):
        a(torch.ones(5, 2))
    with pytest.raises(ValueError, match="axis=0"):
        a(torch.tensor(1.0))


def test_inference_mode_calibration_then_load():
    obs = RunningMaxObserver(FP8Format.E4M3, 0)
    with torch.inference_mode():
        obs(torch.ones(2, 3))
    other = RunningMaxObserver(FP8Format.E4M3, 0)
    other(torch.full((2, 3), 2.0))
    obs.load_state_dict(other.state_dict())
    obs(torch.full((2, 3), 3.0))
    assert obs.amax.tolist() == [3.0, 3.0]


def test_to_cpu_and_module_dict():
    obs_dict = nn.ModuleDict({"w": MSE().create(FP8Format.E4M3, 0),
                              "a": AmaxHistory().create(FP8Format.E5M2, None)})
    obs_dict = obs_dict.to("cpu")
    obs_dict["w"](torch.randn(3, 4))
    obs_dict["a"](torch.randn(8))
    keys = set(obs_dict.state_dict())
    assert {"w.amax", "w.num_updates", "a.amax", "a.history", "a.nonfinite"} <= keys
    assert obs_dict["w"].amax.shape == (3,) and obs_dict["a"].history.shape == (16,)
    assert all(isinstance(m, AmaxObserver) for m in obs_dict.values())
    assert obs_dict["w"].scale().device.type == "cpu"


# ----------------------------------------------------------------------------------------- errors / repr
@pytest.mark.parametrize("cls", [RunningMaxObserver, MovingAverageObserver, AmaxHistoryObserver,
                                 PercentileObserver, MSEObserver])
def test_scale_before_update_raises_with_class_name(cls):
    obs = cls(FP8Format.E4M3)
    assert not obs.calibrated
    with pytest.raises(RuntimeError, match=cls.__name__):
        obs.scale()


@pytest.mark.parametrize("make", [
    lambda: MovingAverageObserver(FP8Format.E4M3, momentum=0.0),
    lambda: MovingAverageObserver(FP8Format.E4M3, momentum=1.5),
    lambda: AmaxHistoryObserver(FP8Format.E4M3, history_len=0),
    lambda: AmaxHistoryObserver(FP8Format.E4M3, algo="mean"),
    lambda: AmaxHistoryObserver(FP8Format.E4M3, margin=-1),
    lambda: PercentileObserver(FP8Format.E4M3, percentile=0.0),
    lambda: PercentileObserver(FP8Format.E4M3, percentile=100.5),
    lambda: MSEObserver(FP8Format.E4M3, num_candidates=1),
    lambda: MSEObserver(FP8Format.E4M3, min_ratio=0.0),
    lambda: MSEObserver(FP8Format.E4M3, min_ratio=1.2),
    lambda: RunningMaxObserver("e3m4"),
    lambda: RunningMaxObserver(FP8Format.E4M3, axis=1.0),
    lambda: RunningMaxObserver(FP8Format.E4M3, axis=True),
])
def test_bad_arguments_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


def test_algo_error_lists_choices():
    with pytest.raises(ValueError, match="most_recent"):
        AmaxHistoryObserver(FP8Format.E4M3, algo="avg")


def test_extra_repr():
    obs = RunningMaxObserver("E5M2", axis=-1)
    assert "fmt=e5m2" in repr(obs) and "axis=-1" in repr(obs) and "uncalibrated" in repr(obs)
    obs(torch.tensor([[1.0, -2.5]]))
    assert "2 channels" in repr(obs) and "max=2.5" in repr(obs)
