"""The observer kinds: how each turns calibration batches into an amax.

All of them reduce per channel (per-tensor is one channel) and ignore non-finite values (see ``base``).
Observers that average per-batch statistics keep a ``batches`` buffer counting, per channel, the batches
that contributed finite data, so a batch without data for a channel never drags its mean towards zero.

State is fixed-size: it does not grow with the number of batches. Per observer with C channels (C = 1
per-tensor) it is ``amax`` (4·C bytes) + ``nonfinite`` and ``num_updates`` (16 bytes), plus ``batches``
(8·C) for MovingAverage / Percentile / MSE and ``history`` (4·history_len·C) for AmaxHistory: 20 bytes per
per-tensor RunningMax, 28 for MovingAverage / Percentile / MSE, 84 for AmaxHistory(16). Percentile and MSE
keep the mean of per-batch statistics, not a histogram of all data; their transient memory is per batch and
bounded (see ``_QUANTILE_LIMIT`` / ``_MSE_LIMIT``).

``merge(states)`` (data-parallel calibration, ``dbr_quant.sync_observers``) combines observers that each saw
part of the batches into what one observer calibrating their union would hold:

* RunningMax: the max (exact).
* AmaxHistory: the window one observer holds after seeing the parts round-robin (part 0's first batch, part
  1's first, …, part 0's second, …; the order a ``DistributedSampler`` deals batches in) — exact when every
  batch has finite data (a batch without any repeats its own part's previous entry, not the other part's).
* Percentile, MSE: the mean of per-batch statistics over all batches = the batch-count-weighted mean of the
  parts' means (exact up to float rounding of the running means).
* MovingAverage: the batch-count-weighted mean of the parts' EMAs. An EMA depends on the order of the batches,
  which one merged number cannot reproduce; both it and the single-stream EMA are convex combinations of the
  per-batch amaxes, so they differ by at most the spread (max − min) of the per-batch amaxes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dbr_quant.formats import FP8Format
from dbr_quant.observers.base import AmaxObserver, _abs_reduce_max

HISTORY_ALGOS = ("max", "most_recent")
# torch.quantile refuses to reduce over more than 2**24 elements per row;
# MSE evaluates its candidates on at most _MSE_LIMIT elements at a time
_QUANTILE_LIMIT = 2**24
_MSE_LIMIT = 2**22
_MSE_MIN_PER_CHANNEL = 256


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_momentum(momentum: float) -> None:
    if not (_is_real(momentum) and 0 < momentum <= 1):
        raise ValueError(f"momentum must be a number in (0, 1], got {momentum!r}")


def check_history(history_len: int, algo: str, margin: int) -> None:
    if not (_is_int(history_len) and history_len >= 1):
        raise ValueError(f"history_len must be an int >= 1, got {history_len!r}")
    if algo not in HISTORY_ALGOS:
        raise ValueError(f"algo must be one of {HISTORY_ALGOS}, got {algo!r}")
    if not (_is_int(margin) and margin >= 0):
        raise ValueError(f"margin must be an int >= 0 (scale is multiplied by 2**margin), got {margin!r}")


def check_percentile(percentile: float) -> None:
    if not (_is_real(percentile) and 0 < percentile <= 100):
        raise ValueError(f"percentile must be a number in (0, 100], got {percentile!r}")


def check_mse(num_candidates: int, min_ratio: float) -> None:
    if not (_is_int(num_candidates) and num_candidates >= 2):
        raise ValueError(f"num_candidates must be an int >= 2, got {num_candidates!r}")
    if not (_is_real(min_ratio) and 0 < min_ratio <= 1):
        raise ValueError(f"min_ratio must be a number in (0, 1], got {min_ratio!r}")


def _strided_columns(values: Tensor, max_cols: int) -> Tensor:
    """Deterministic subsample: every k-th column so at most ``max_cols`` remain (k = ceil(N / max_cols))."""
    n = values.shape[1]
    return values if n <= max_cols else values[:, :: math.ceil(n / max_cols)]


class RunningMaxObserver(AmaxObserver):
    """amax = the largest finite |x| ever seen: no clipping at all, the safe default for weights."""

    def _accumulate(self, batch: Tensor, valid: Tensor) -> None:
        current = self.amax.reshape(-1)
        self._set_amax(torch.where(valid, torch.maximum(current, batch), current))

    def _merge(self, states: list[dict[str, Tensor]]) -> None:
        self._set_amax(torch.stack([s["amax"] for s in states]).amax(dim=0).float())


def _count_weighted_mean(self: MovingAverageObserver | _BatchMeanObserver, states: list[dict[str, Tensor]]) -> None:
    """amax = per-channel mean of the parts' amaxes weighted by their ``batches``; batches add up."""
    counts = torch.stack([s["batches"] for s in states])
    total = counts.sum(dim=0)
    mean = (counts * torch.stack([s["amax"] for s in states])).sum(dim=0) / total.clamp(min=1)
    self._set_amax(mean.float())
    self.batches.copy_(total.round().long())


class MovingAverageObserver(AmaxObserver):
    """EMA of per-batch amax: the first batch sets it, later ones move it by ``momentum``.

    Smooths activation ranges so one unusual calibration batch does not dominate.
    """

    batches: Tensor

    def __init__(self, fmt: FP8Format | str, axis: int | None = None, momentum: float = 0.01) -> None:
        check_momentum(momentum)
        super().__init__(fmt, axis)
        self.momentum = float(momentum)
        self._register_stat("batches", dtype=torch.int64)

    def _accumulate(self, batch: Tensor, valid: Tensor) -> None:
        current, seen = self.amax.reshape(-1), self.batches.reshape(-1)
        ema = (1 - self.momentum) * current + self.momentum * batch
        updated = torch.where(seen > 0, ema, batch)
        self._set_amax(torch.where(valid, updated, current))
        self.batches.add_(valid.reshape(self.batches.shape).long())

    _merge = _count_weighted_mean

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, momentum={self.momentum}"


class AmaxHistoryObserver(AmaxObserver):
    """Transformer Engine style delayed scaling over a rolling window of per-batch amaxes.

    ``history`` has shape ``(history_len,)`` or ``(history_len, C)``; row 0 is the newest batch and each
    update rolls older rows down (the oldest drops out).  ``algo="max"`` uses the max over the window
    (unfilled rows are 0, so they never win), ``"most_recent"`` the newest row.  ``scale()`` multiplies by
    ``2**margin``.
    A channel without finite data in a batch repeats its previous newest value.
    """

    history: Tensor

    def __init__(self, fmt: FP8Format | str, axis: int | None = None, history_len: int = 16,
                 algo: str = "max", margin: int = 0) -> None:
        check_history(history_len, algo, margin)
        super().__init__(fmt, axis)
        self.history_len = history_len
        self.algo = algo
        self.margin = margin
        self._register_stat("history", lead=(history_len,))

    def _accumulate(self, batch: Tensor, valid: Tensor) -> None:
        history = self.history.reshape(self.history_len, -1)
        newest = torch.where(valid, batch, history[0])
        rolled = torch.cat([newest[None], history[:-1]], dim=0)
        self.history.copy_(rolled.reshape(self.history.shape))
        self._set_amax(rolled.amax(dim=0) if self.algo == "max" else rolled[0])

    def _merge(self, states: list[dict[str, Tensor]]) -> None:
        # row i of part r holds its batch number n_r - 1 - i; round-robin order sorts batches by
        # (batch number, part), so the merged window is the history_len largest of those keys
        entries = []
        for part, s in enumerate(states):
            n = int(s["num_updates"].item())
            rows = s["history"].reshape(self.history_len, -1)
            entries += [((n - 1 - i, part), rows[i]) for i in range(min(self.history_len, n))]
        entries.sort(key=lambda e: e[0], reverse=True)
        window = torch.zeros_like(self.history.reshape(self.history_len, -1), dtype=torch.float64)
        for i, (_, row) in enumerate(entries[: self.history_len]):
            window[i] = row
        self.history.copy_(window.reshape(self.history.shape).float())
        self._set_amax((window.amax(dim=0) if self.algo == "max" else window[0]).float())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, history_len={self.history_len}, algo={self.algo!r}"


class _BatchMeanObserver(AmaxObserver):
    """amax = per-channel mean of the per-batch statistics (each batch weighs the same)."""

    batches: Tensor

    def __init__(self, fmt: FP8Format | str, axis: int | None = None) -> None:
        super().__init__(fmt, axis)
        self._register_stat("batches", dtype=torch.int64)

    def _accumulate(self, batch: Tensor, valid: Tensor) -> None:
        self.batches.add_(valid.reshape(self.batches.shape).long())
        current, count = self.amax.reshape(-1), self.batches.reshape(-1)
        mean = current + (batch - current) / count.clamp(min=1)
        self._set_amax(torch.where(valid, mean, current))

    _merge = _count_weighted_mean


class PercentileObserver(_BatchMeanObserver):
    """amax = mean over batches of the ``percentile``-th percentile of finite |x| (linear interpolation).

    Clips rare outliers in activations.  Averaging per-batch percentiles (instead of pooling all data) keeps
    memory constant; it is the same estimate for i.i.d. batches.  Rows longer than 2**24 (torch.quantile's
    limit) are subsampled by a deterministic stride.
    """

    def __init__(self, fmt: FP8Format | str, axis: int | None = None, percentile: float = 99.99) -> None:
        check_percentile(percentile)
        super().__init__(fmt, axis)
        self.percentile = float(percentile)

    def _batch_statistic(self, values: Tensor, finite: Tensor) -> Tensor:
        channels = values.shape[0]
        if values.shape[1] == 0:
            return torch.full((channels,), float("nan"), device=values.device)
        data = torch.where(finite, values.abs(), torch.full((), float("nan"), device=values.device))
        data = _strided_columns(data, _QUANTILE_LIMIT)
        rows = max(1, _QUANTILE_LIMIT // data.shape[1])  # bound the sort's memory per chunk
        q = self.percentile / 100.0
        return torch.cat([torch.nanquantile(chunk, q, dim=1) for chunk in data.split(rows)])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, percentile={self.percentile}"


class MSEObserver(_BatchMeanObserver):
    """amax = mean over batches of the clip value minimising FP8 fake-quantisation MSE.

    Per batch and channel, clip candidates are ``batch_amax * r`` for ``num_candidates`` values of r evenly
    spaced in ``[min_ratio, 1]``; the error of quantise-dequantise with scale ``clip / fmt.max`` is measured
    on |x| / batch_amax (same argmin, no overflow).  Ties go to the largest clip, so clipping is only chosen
    when it strictly helps.  Rows are subsampled by a deterministic stride to bound memory and time; the
    batch amax itself always comes from all of the data.
    """

    def __init__(self, fmt: FP8Format | str, axis: int | None = None, num_candidates: int = 32,
                 min_ratio: float = 0.3) -> None:
        check_mse(num_candidates, min_ratio)
        super().__init__(fmt, axis)
        self.num_candidates = num_candidates
        self.min_ratio = float(min_ratio)

    def _batch_statistic(self, values: Tensor, finite: Tensor) -> Tensor:
        batch_amax = _abs_reduce_max(values, finite)  # NaN for channels without data
        channels = values.shape[0]
        if values.shape[1] == 0 or channels == 0:
            return batch_amax
        usable = torch.isfinite(batch_amax) & (batch_amax > 0)
        denom = torch.where(usable, batch_amax, torch.ones_like(batch_amax))
        per_row = max(_MSE_LIMIT // channels, _MSE_MIN_PER_CHANNEL)
        # non-finite entries are 0 in ``values``: 0 quantises exactly, so they add no error to any candidate
        data = _strided_columns(values.abs(), per_row)
        rows = max(1, _MSE_LIMIT // data.shape[1])
        ratios = torch.linspace(1.0, self.min_ratio, self.num_candidates, device=values.device)  # 1 first
        best = torch.cat([self._best_ratio(chunk / d[:, None], ratios)
                          for chunk, d in zip(data.split(rows), denom.split(rows), strict=True)])
        # all-zero channels: clip 0 (safe_scale turns amax 0 into scale 1)
        return torch.where(usable, batch_amax * best, batch_amax)

    def _best_ratio(self, normalized: Tensor, ratios: Tensor) -> Tensor:
        fmax, tiny = self.fmt.max, torch.finfo(torch.float32).tiny
        errors = []
        for r in ratios.tolist():
            # a 0-d tensor on the data's device, not a Python number: CUDA torch turns a division by a number
            # into a multiply by its reciprocal (see formats.safe_scale), so a GPU's pick could differ from the CPU's
            scale = torch.tensor(max(r / fmax, tiny), dtype=torch.float32, device=normalized.device)
            fake = (normalized / scale).clamp(-fmax, fmax).to(self.fmt.dtype).float() * scale
            errors.append((fake - normalized).square().mean(dim=1))
        # argmin returns the first minimum, i.e. the largest ratio among ties
        return ratios[torch.stack(errors).argmin(dim=0)]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_candidates={self.num_candidates}, min_ratio={self.min_ratio}"
