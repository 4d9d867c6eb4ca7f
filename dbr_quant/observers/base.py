"""Base class for amax observers: statistics live in buffers so they save, load and move with the model.

An observer watches tensors during calibration and keeps an "amax" (the magnitude that should land on the
FP8 format's largest finite value).  ``scale()`` turns it into a dequantization scale via ``safe_scale``.

Per-tensor observers (``axis=None``) keep a 0-d amax.  Per-channel observers (``axis=k``) keep one amax per
index of dimension ``k`` of the observed tensor; because the channel count is unknown until data arrives,
their per-channel buffers start with zero channels and are sized on the first update (or by
``load_state_dict``, so a fresh observer can restore a calibrated one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dbr_quant.formats import FP8Format, safe_scale

_F32_MAX = torch.finfo(torch.float32).max


def _check_axis(axis: int | None) -> int | None:
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ValueError(f"axis must be None (per-tensor) or an int (per-channel dimension), got {axis!r}")
    return axis


def _as_channels(x: Tensor, axis: int | None) -> tuple[Tensor, Tensor]:
    """Flatten ``x`` to ``(C, N)`` fp32 values (non-finite replaced by 0) plus the matching finite mask.

    Per-tensor data becomes a single row (C = 1) so every observer can be written once, for channels.
    Values are clamped to the fp32 range first so finite fp64 data never turns into inf.
    """
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # fp16/bf16/fp8 widen to fp32 exactly, keeping inf/NaN
    finite = torch.isfinite(x)
    values = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if x.dtype == torch.float64:
        values = values.clamp(-_F32_MAX, _F32_MAX)
    values = values.float()
    if axis is None:
        return values.reshape(1, -1), finite.reshape(1, -1)
    shape = (x.shape[axis], math.prod(s for i, s in enumerate(x.shape) if i != axis % x.dim()))
    return values.movedim(axis, 0).reshape(shape), finite.movedim(axis, 0).reshape(shape)


def _abs_reduce_max(values: Tensor, finite: Tensor) -> Tensor:
    """Per-row max of |values| over finite entries; NaN for rows without any finite entry."""
    if values.shape[1] == 0:
        return torch.full((values.shape[0],), float("nan"), device=values.device)
    amax = values.abs().amax(dim=1)
    return torch.where(finite.any(dim=1), amax, torch.full_like(amax, float("nan")))


class AmaxObserver(nn.Module):
    """Base observer. Subclasses choose the per-batch statistic and how batches are merged into ``amax``.

    Buffers (all in ``state_dict``): ``amax`` (fp32; 0-d per-tensor, ``(C,)`` per-channel), ``nonfinite``
    (int64: NaN/inf elements seen and ignored) and ``num_updates`` (int64: forward calls, including calls
    whose batch had no finite data, which leave the statistic unchanged).
    """

    amax: Tensor
    nonfinite: Tensor
    num_updates: Tensor

    def __init__(self, fmt: FP8Format | str, axis: int | None = None) -> None:
        super().__init__()
        self.fmt = FP8Format.parse(fmt)
        self.axis = _check_axis(axis)
        self.margin = 0
        self.synced = False  # merged across ranks (integrations.distributed.sync_observers): merging again is refused
        # name -> leading (non-channel) shape of buffers whose last dim is the channel dim when per-channel
        self._channel_buffers: dict[str, tuple[int, ...]] = {}
        self._register_stat("amax")
        with torch.inference_mode(False):  # see _register_stat
            self.register_buffer("nonfinite", torch.zeros((), dtype=torch.int64))
            self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64))

    # ----------------------------------------------------------------------------------------- buffers
    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    @property
    def num_channels(self) -> int | None:
        """Channel count (0 until the first update or load for per-channel); None for per-tensor."""
        return int(self.amax.shape[0]) if self.per_channel else None

    def _register_stat(self, name: str, lead: tuple[int, ...] = (),
                       dtype: torch.dtype = torch.float32) -> None:
        """Register a zero buffer shaped ``lead`` (per-tensor) or ``lead + (C,)`` (per-channel, C = 0 now)."""
        shape = lead + ((0,) if self.per_channel else ())
        # built outside inference mode (prepare() called under torch.inference_mode()), so that calibrating
        # outside it can update them in place (inference tensors refuse in-place updates outside the mode)
        with torch.inference_mode(False):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))
        self._channel_buffers[name] = lead

    def _resize_channels(self, channels: int) -> None:
        # built outside inference mode so a later load_state_dict / normal-mode update can write into them
        with torch.inference_mode(False):
            for name, lead in self._channel_buffers.items():
                old = getattr(self, name)
                setattr(self, name, torch.zeros((*lead, channels), dtype=old.dtype, device=old.device))

    def _adopt_device(self, device: torch.device) -> None:
        """Move the statistics to the device of the first data seen. Observers are built on the CPU (at prepare,
        or for a weight at convert) before any data; kept there, a model on a GPU would get CPU scales, which its
        kernels refuse. Later batches from another device are reduced there and only the statistic moves."""
        with torch.inference_mode(False):  # buffers a later normal-mode update or load_state_dict can write
            self.to(device)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        incoming = state_dict.get(prefix + "amax")
        if (self.per_channel and self.amax.numel() == 0 and isinstance(incoming, Tensor)
                and incoming.dim() == 1 and incoming.shape[0] > 0):
            self._resize_channels(int(incoming.shape[0]))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # ----------------------------------------------------------------------------------------- update
    @torch.no_grad()
    def forward(self, x: Tensor) -> None:
        """Fold ``x`` (detached, any float dtype, computed in fp32) into the statistics; returns None."""
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} observes floating-point tensors, got "
                            f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
        x = x.detach()
        if x.device != self.amax.device and not self.calibrated:
            self._adopt_device(x.device)
        if self.per_channel:
            assert self.axis is not None
            if not -x.dim() <= self.axis < x.dim():
                raise ValueError(f"{type(self).__name__}(axis={self.axis}) cannot observe a tensor of shape "
                                 f"{tuple(x.shape)}")
            channels = x.shape[self.axis]
            if self.amax.numel() == 0:
                self._resize_channels(channels)
            elif self.amax.shape[0] != channels:
                raise ValueError(f"{type(self).__name__} was sized for {self.amax.shape[0]} channels along "
                                 f"axis {self.axis}, got a tensor of shape {tuple(x.shape)}")
        fast = self._fast_batch_amax(x)
        if fast is not None:
            self._accumulate(fast.to(self.amax.device), torch.ones(1, dtype=torch.bool, device=self.amax.device))
            self.num_updates.add_(1)
            return
        values, finite = _as_channels(x, self.axis)
        device = self.amax.device
        self.nonfinite.add_((finite.numel() - finite.sum()).to(device))
        batch = self._batch_statistic(values, finite).to(device)
        self._accumulate(batch, torch.isfinite(batch))
        self.num_updates.add_(1)

    def _fast_batch_amax(self, x: Tensor) -> Tensor | None:
        """The batch amax in one pass (aminmax, no copies) for per-tensor max-based observers, or None
        when the general path is needed (per-channel, another statistic, fp64, or non-finite values).

        Calibration runs this on every quantized activation, so it is the observers' hot path.
        """
        if (self.per_channel or type(self)._batch_statistic is not AmaxObserver._batch_statistic
                or x.numel() == 0 or x.dtype == torch.float64):
            return None
        lo, hi = torch.aminmax(x)
        # NaN or inf present: count them properly (Python floats: torch.isfinite on a 0-d tensor costs ~9 µs)
        if not (math.isfinite(lo.item()) and math.isfinite(hi.item())):
            return None
        return torch.maximum(-lo, hi).float().reshape(1)

    def _batch_statistic(self, values: Tensor, finite: Tensor) -> Tensor:
        """Per-channel statistic of one batch, shape ``(C,)``; NaN marks channels with no finite data."""
        return _abs_reduce_max(values, finite)

    def _accumulate(self, batch: Tensor, valid: Tensor) -> None:
        """Merge a batch's ``(C,)`` statistic into the buffers; channels with ``valid`` False keep theirs."""
        raise NotImplementedError

    def _set_amax(self, value: Tensor) -> None:
        self.amax.copy_(value.reshape(self.amax.shape))

    # ----------------------------------------------------------------------------------------- merging
    @torch.no_grad()
    def merge(self, states: Sequence[Mapping[str, Tensor]]) -> None:
        """Replace this observer's statistics by the merge of ``states``: the buffers (``state_dict()``) of
        observers of the same kind and settings that each calibrated part of the batches (one per rank of a
        data-parallel calibration). The result is what one observer calibrating the union would hold; which
        merges are exact is documented per kind (``_merge``). Counters (``nonfinite``, ``num_updates``) add.
        """
        if not states:
            raise ValueError(f"{type(self).__name__}.merge() needs at least one state")
        for s in states:
            missing = [name for name in self._buffers if name not in s]
            shapes = [name for name, buf in self._buffers.items()
                      if name in s and buf is not None and s[name].shape != buf.shape]
            if missing or shapes:
                raise ValueError(f"{type(self).__name__}.merge(): a state does not match this observer "
                                 f"(missing {missing}, other shapes for {shapes}); merge observers of the same "
                                 "kind, settings and channel count")
        device = self.amax.device
        as64 = [{name: t.to(device=device, dtype=torch.float64) for name, t in s.items()} for s in states]
        self._merge(as64)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.nonfinite.copy_(sum((s["nonfinite"] for s in as64), zero).round().long())
        self.num_updates.copy_(sum((s["num_updates"] for s in as64), zero).round().long())

    def _merge(self, states: list[dict[str, Tensor]]) -> None:
        """Set ``amax`` and the kind's own buffers from float64 ``states`` (counters are done by merge())."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------------- results
    @property
    def calibrated(self) -> bool:
        return bool(self.num_updates.item() > 0)

    def scale(self) -> Tensor:
        """Dequantization scale(s), fp32, shaped like ``amax``; never 0, inf or NaN (see ``safe_scale``)."""
        if not self.calibrated:
            raise RuntimeError(f"{type(self).__name__} has not observed any data yet: run calibration "
                               f"(call it on tensors) or load a calibrated state_dict before scale()")
        return safe_scale(self.amax, self.fmt, margin=self.margin)

    def extra_repr(self) -> str:
        parts = [f"fmt={self.fmt.value}", f"axis={self.axis}"]
        if self.margin:
            parts.append(f"margin={self.margin}")
        if not self.calibrated:
            parts.append("amax=<uncalibrated>")
        elif self.amax.dim() == 0:
            parts.append(f"amax={self.amax.item():.6g}")
        elif self.amax.numel() == 0:
            parts.append("amax=<0 channels>")
        else:
            parts.append(f"amax=<{self.amax.numel()} channels, min={self.amax.min().item():.6g}, "
                         f"max={self.amax.max().item():.6g}>")
        return ", ".join(parts)
