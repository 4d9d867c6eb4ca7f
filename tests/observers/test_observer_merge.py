"""``AmaxObserver.merge``: observers that each saw a shard of the batches, merged, against one observer that
saw all of them (in the round-robin order the merge defines for order-dependent kinds)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dbr_quant.formats import FP8Format
from dbr_quant.observers import (
    AmaxHistoryObserver,
    MovingAverageObserver,
    MSEObserver,
    PercentileObserver,
    RunningMaxObserver,
)

KINDS = {
    "running_max": lambda axis: RunningMaxObserver(FP8Format.E4M3, axis),
    "history_max": lambda axis: AmaxHistoryObserver(FP8Format.E4M3, axis, history_len=3, algo="max"),
    "history_recent": lambda axis: AmaxHistoryObserver(FP8Format.E4M3, axis, history_len=3, algo="most_recent"),
    "percentile": lambda axis: PercentileObserver(FP8Format.E4M3, axis, percentile=90.0),
    "mse": lambda axis: MSEObserver(FP8Format.E4M3, axis, num_candidates=8),
    "moving_average": lambda axis: MovingAverageObserver(FP8Format.E4M3, axis, momentum=0.3),
}
EXACT = {"running_max", "history_max", "history_recent"}


def _batches(seed: int, n: int, nan: bool) -> list[torch.Tensor]:
    """Batches of shape (3, 8) with scales spread over two decades; some NaN/inf entries (never a whole
    channel, so every batch has finite data in every channel)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(3, 8, generator=g) * float(torch.empty(()).uniform_(0.1, 10.0, generator=g))
        if nan:
            x[0, 1], x[2, 5] = float("nan"), float("inf")
        out.append(x)
    return out


def _shards(batches: list[torch.Tensor], sizes: list[int]) -> list[list[torch.Tensor]]:
    it = iter(batches)
    return [list(itertools.islice(it, n)) for n in sizes]


def _round_robin(shards: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Shard 0's first batch, shard 1's first, …, shard 0's second, … (what the merge stands for)."""
    return [b for group in itertools.zip_longest(*shards) for b in group if b is not None]


def _calibrated(kind: str, axis: int | None, batches: list[torch.Tensor]):
    obs = KINDS[kind](axis)
    for b in batches:
        obs(b)
    return obs


def _merged(kind: str, axis: int | None, shards: list[list[torch.Tensor]]):
    parts = [_calibrated(kind, axis, shard) for shard in shards]
    for p in parts:  # an unsized per-channel part (no batches) is sized like the others, as sync_observers does
        if p.per_channel and p.num_channels == 0:
            p._resize_channels(3 if axis == 0 else 8)
    merged = KINDS[kind](axis)
    if axis is not None:
        merged._resize_channels(parts[0].amax.shape[0] if parts[0].amax.numel() else 3 if axis == 0 else 8)
    merged.merge([p.state_dict() for p in parts])
    return merged


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), axis=st.sampled_from([None, 0, 1]),
       sizes=st.lists(st.integers(0, 4), min_size=1, max_size=4).filter(lambda s: sum(s) > 0),
       seed=st.integers(0, 2**16), nan=st.booleans())
def test_merge_equals_one_observer_on_the_union(kind, axis, sizes, seed, nan):
    batches = _batches(seed, sum(sizes), nan)
    shards = _shards(batches, sizes)
    single = _calibrated(kind, axis, _round_robin(shards))
    merged = _merged(kind, axis, shards)
    assert merged.num_updates.item() == single.num_updates.item() == len(batches)
    assert merged.nonfinite.item() == single.nonfinite.item()
    if kind in EXACT:
        assert torch.equal(merged.amax, single.amax)
        if kind.startswith("history"):
            assert torch.equal(merged.history, single.history)
    elif kind in ("percentile", "mse"):
        torch.testing.assert_close(merged.amax, single.amax, rtol=1e-5, atol=0)
        assert torch.equal(merged.batches, single.batches)
    else:  # moving average: both are convex combinations of the per-batch amaxes
        per_batch = torch.stack([_calibrated("running_max", axis, [b]).amax for b in batches])
        spread = per_batch.amax(dim=0) - per_batch.amin(dim=0)
        assert bool(((merged.amax - single.amax).abs() <= spread * (1 + 1e-6) + 1e-6).all())
        assert bool((merged.amax >= per_batch.amin(dim=0) * (1 - 1e-6)).all())
        assert bool((merged.amax <= per_batch.amax(dim=0) * (1 + 1e-6)).all())


def test_moving_average_merge_is_the_count_weighted_mean():
    a, b = MovingAverageObserver("e4m3", momentum=0.5), MovingAverageObserver("e4m3", momentum=0.5)
    for v in (1.0, 3.0):
        a(torch.tensor([v]))  # EMA: 1 → 2
    b(torch.tensor([8.0]))
    merged = MovingAverageObserver("e4m3", momentum=0.5)
    merged.merge([a.state_dict(), b.state_dict()])
    assert merged.amax.item() == pytest.approx((2 * 2.0 + 1 * 8.0) / 3)
    assert merged.batches.item() == 3 and merged.num_updates.item() == 3


def test_history_merge_interleaves_parts_round_robin():
    parts = [AmaxHistoryObserver("e4m3", history_len=4, algo="max") for _ in range(2)]
    for v in (1.0, 2.0, 3.0):
        parts[0](torch.tensor([v]))
    for v in (10.0,):
        parts[1](torch.tensor([v]))
    merged = AmaxHistoryObserver("e4m3", history_len=4, algo="max")
    merged.merge([p.state_dict() for p in parts])
    # round-robin stream: 1, 10, 2, 3 → newest first
    assert merged.history.tolist() == [3.0, 2.0, 10.0, 1.0]
    assert merged.amax.item() == 10.0


def test_merge_rejects_states_of_another_shape():
    a = RunningMaxObserver("e4m3", axis=0)
    a(torch.ones(4, 2))
    b = RunningMaxObserver("e4m3", axis=0)
    b(torch.ones(3, 2))
    with pytest.raises(ValueError, match="same kind, settings and channel count"):
        a.merge([a.state_dict(), b.state_dict()])


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("axis", [None, 0])
def test_state_is_fixed_size(kind, axis):
    """Calibration memory does not grow with the number of batches (what sync_observers sends, too)."""
    def nbytes(obs) -> int:
        return sum(t.numel() * t.element_size() for t in obs.state_dict().values())

    one = _calibrated(kind, axis, _batches(0, 1, False))
    many = _calibrated(kind, axis, _batches(0, 12, False))
    assert nbytes(one) == nbytes(many)
    per_channel_bytes = {"running_max": 4, "history_max": 4 + 4 * 3, "history_recent": 4 + 4 * 3}.get(kind, 4 + 8)
    assert nbytes(many) == 16 + per_channel_bytes * (1 if axis is None else 3)
