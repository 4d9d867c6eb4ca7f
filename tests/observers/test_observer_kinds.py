"""Each observer kind against an independent numpy / plain-torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dbr_quant.observers.amax as amax_mod
from dbr_quant.formats import FP8Format
from dbr_quant.observers import (
    AmaxHistoryObserver,
    MovingAverageObserver,
    MSEObserver,
    PercentileObserver,
    RunningMaxObserver,
)

AXES = [None, 0, -1]


def rows(x: torch.Tensor, axis: int | None) -> np.ndarray:
    """|x| as a numpy (C, N) array, channels along ``axis`` (one row per-tensor)."""
    a = np.abs(x.double().numpy())
    if axis is None:
        return a.reshape(1, -1)
    a = np.moveaxis(a, axis, 0)
    return a.reshape(a.shape[0], -1)


def ref_shape(values: np.ndarray, axis: int | None) -> np.ndarray:
    return values[0] if axis is None else values


def batches(seed: int = 0, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 5, 6, generator=g) * (i + 1) for i in range(n)]


@pytest.mark.parametrize("axis", AXES)
def test_running_max_matches_numpy(axis):
    obs = RunningMaxObserver(FP8Format.E4M3, axis)
    xs = batches()
    for x in xs:
        obs(x)
    expected = np.max([rows(x, axis).max(axis=1) for x in xs], axis=0)
    np.testing.assert_allclose(obs.amax.numpy(), ref_shape(expected, axis), rtol=0)
    assert obs.amax.shape == (() if axis is None else (6 if axis == -1 else 4,))
    assert obs.amax.dtype == torch.float32


@pytest.mark.parametrize("axis", AXES)
def test_moving_average_recurrence(axis):
    m = 0.25
    obs = MovingAverageObserver(FP8Format.E4M3, axis, momentum=m)
    xs = batches(1, 4)
    ref = None
    for x in xs:
        obs(x)
        b = rows(x, axis).max(axis=1)
        ref = b if ref is None else (1 - m) * ref + m * b
    np.testing.assert_allclose(obs.amax.numpy(), ref_shape(ref, axis), rtol=1e-6)


def test_amax_history_rolls_and_algo():
    values = [5.0, 1.0, 2.0, 3.0]
    h_max = AmaxHistoryObserver(FP8Format.E4M3, history_len=3, algo="max")
    h_recent = AmaxHistoryObserver(FP8Format.E4M3, history_len=3, algo="most_recent")
    seen = []
    for v in values:
        x = torch.tensor([v, -v / 2])
        h_max(x)
        h_recent(x)
        seen.insert(0, v)
        window = seen[:3]
        assert h_max.amax.item() == max(window)
        assert h_recent.amax.item() == v
        padded = window + [0.0] * (3 - len(window))
        assert h_max.history.tolist() == padded
    # after 4 batches the initial 5.0 has rolled out of the 3-long window
    assert h_max.amax.item() == 3.0


def test_amax_history_margin_and_per_channel_shape():
    obs = AmaxHistoryObserver(FP8Format.E4M3, axis=-1, history_len=4, margin=2)
    x1 = torch.tensor([[1.0, -8.0, 0.5], [2.0, 3.0, -0.25]])
    x2 = torch.tensor([[0.5, 1.0, 4.0], [0.0, 0.0, 0.0]])
    obs(x1)
    obs(x2)
    assert obs.history.shape == (4, 3)
    np.testing.assert_array_equal(obs.history[0].numpy(), [0.5, 1.0, 4.0])
    np.testing.assert_array_equal(obs.history[1].numpy(), [2.0, 8.0, 0.5])
    np.testing.assert_array_equal(obs.amax.numpy(), [2.0, 8.0, 4.0])
    np.testing.assert_allclose(obs.scale().numpy(), np.array([2.0, 8.0, 4.0]) * 4 / 448, rtol=1e-7)


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("pct", [50.0, 99.0, 99.99, 100.0])
def test_percentile_matches_numpy(axis, pct):
    obs = PercentileObserver(FP8Format.E5M2, axis, percentile=pct)
    xs = batches(2, 3)
    for x in xs:
        obs(x)
    per_batch = [np.percentile(rows(x, axis), pct, axis=1) for x in xs]
    np.testing.assert_allclose(obs.amax.numpy(), ref_shape(np.mean(per_batch, axis=0), axis), rtol=1e-5)


def test_percentile_strided_subsample(monkeypatch):
    monkeypatch.setattr(amax_mod, "_QUANTILE_LIMIT", 100)
    x = torch.arange(1000, dtype=torch.float32) ** 1.5
    obs = PercentileObserver(FP8Format.E4M3, percentile=90.0)
    obs(x)
    expected = np.percentile(x.numpy()[::10], 90.0)
    np.testing.assert_allclose(obs.amax.item(), expected, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ MSE
def fake_quant_mse(x: torch.Tensor, clip: float, fmt: FP8Format) -> float:
    scale = clip / fmt.max
    q = (x / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).float() * scale
    return float(((q - x) ** 2).mean())


def reference_best_clip(x: torch.Tensor, fmt: FP8Format, k: int, min_ratio: float) -> tuple[float, float]:
    """Brute-force grid search; returns (best error, plain-max error)."""
    m = float(x.abs().max())
    errs = [fake_quant_mse(x, m * r, fmt) for r in np.linspace(min_ratio, 1.0, k)]
    return min(errs), errs[-1]


def heavy_tailed(seed: int = 0, n: int = 20000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[:5] = torch.tensor([300.0, -250.0, 400.0, 1000.0, -2000.0])
    return x


@pytest.mark.parametrize("fmt", list(FP8Format))
def test_mse_heavy_tailed_clip_not_worse_than_max(fmt):
    x = heavy_tailed()
    obs = MSEObserver(fmt, num_candidates=32, min_ratio=0.3)
    obs(x)
    clip = obs.amax.item()
    amax = float(x.abs().max())
    assert 0.3 * amax * (1 - 1e-6) <= clip <= amax
    best, plain = reference_best_clip(x, fmt, 32, 0.3)
    assert fake_quant_mse(x, clip, fmt) <= plain
    assert fake_quant_mse(x, clip, fmt) <= best * (1 + 1e-4)


def test_mse_clips_when_it_strictly_helps():
    # a tight cluster at 1.0 plus one value at 1.1: clipping to ~1.0 puts the cluster exactly on the grid
    x = torch.ones(4096)
    x[0] = 1.1
    obs = MSEObserver(FP8Format.E4M3, num_candidates=64, min_ratio=0.5)
    obs(x)
    clip = obs.amax.item()
    assert clip < 1.1 * (1 - 1e-3)
    assert fake_quant_mse(x, clip, FP8Format.E4M3) < fake_quant_mse(x, 1.1, FP8Format.E4M3)


@pytest.mark.parametrize("axis", [0, -1])
def test_mse_per_channel_matches_per_row_search(axis):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 300, generator=g) * torch.arange(1, 7)[:, None]
    x[2, 7] = 60.0
    x = x if axis == 0 else x.T.contiguous()
    fmt = FP8Format.E5M2
    obs = MSEObserver(fmt, axis=axis, num_candidates=16, min_ratio=0.4)
    obs(x)
    channels = x if axis == 0 else x.T
    assert obs.amax.shape == (6,)
    for c in range(6):
        row = channels[c]
        best, _ = reference_best_clip(row, fmt, 16, 0.4)
        clip = obs.amax[c].item()
        assert clip <= float(row.abs().max())
        assert fake_quant_mse(row, clip, fmt) <= best * (1 + 1e-4)


def test_mse_amax_is_mean_of_batch_clips():
    x1, x2 = heavy_tailed(1, 5000), heavy_tailed(2, 5000) * 3
    single = []
    for x in (x1, x2):
        o = MSEObserver(FP8Format.E4M3)
        o(x)
        single.append(o.amax.item())
    both = MSEObserver(FP8Format.E4M3)
    both(x1)
    both(x2)
    assert both.amax.item() == pytest.approx(sum(single) / 2, rel=1e-6)
    assert single[1] != pytest.approx(single[0])  # the mean is not trivially one of them


def test_mse_subsample_bounds_work_and_keeps_full_amax(monkeypatch):
    monkeypatch.setattr(amax_mod, "_MSE_LIMIT", 64)
    monkeypatch.setattr(amax_mod, "_MSE_MIN_PER_CHANNEL", 8)
    x = torch.linspace(-1, 1, 1001)
    x[501] = 50.0  # not on the stride-16 subsample grid
    obs = MSEObserver(FP8Format.E4M3, min_ratio=1.0)  # only candidate: the full batch amax
    obs(x)
    assert obs.amax.item() == 50.0


def test_mse_ties_keep_the_unclipped_amax(monkeypatch):
    # the spike is not on the evaluated subsample and the rest is zero: every candidate has error 0,
    # so the tie must resolve to ratio 1 (no clipping), not to min_ratio
    monkeypatch.setattr(amax_mod, "_MSE_LIMIT", 64)
    monkeypatch.setattr(amax_mod, "_MSE_MIN_PER_CHANNEL", 8)
    x = torch.zeros(1001)
    x[501] = 7.0
    obs = MSEObserver(FP8Format.E4M3, min_ratio=0.3)
    obs(x)
    assert obs.amax.item() == 7.0
