"""Quantize one linear weight to FP8 in blocks of rows, so the temporaries are bounded by a block, not the layer.

``convert(prepared, inplace=True)`` quantizes one weight at a time and drops its high-precision copy before
the next one: with blocks, its peak memory stays at the model's high-precision size plus about a quarter of
the largest layer (that layer's FP8 bytes) plus a few blocks (``benchmarks/convert_memory.py`` measures it).

The result is bit-identical to observing and quantizing the whole weight at once (tested): per-channel
statistics are per row, quantization is elementwise, and a per-tensor amax of the max-based observers is the
max of the blocks' amaxes. Percentile and MSE per tensor, and MSE per channel (its column subsample depends
on the channel count), observe the whole weight at once.
"""

from __future__ import annotations

import torch

from dbr_quant import kernels
from dbr_quant.observers import AmaxHistoryObserver, MovingAverageObserver, MSEObserver, RunningMaxObserver
from dbr_quant.qconfig import TensorQConfig

__all__ = ["quantize_weight", "quantize_fp8_weight", "quantize_experts", "block_quantize_experts", "all_finite"]

BLOCK_ELEMENTS = 2**18  # 1 MiB of fp32 per block
_MAX_BASED = (RunningMaxObserver, MovingAverageObserver, AmaxHistoryObserver)  # one batch: amax = max |w|


def all_finite(w: torch.Tensor, block_elements: int = BLOCK_ELEMENTS) -> bool:
    """No NaN/inf in ``w`` (checked per block: no layer-sized mask)."""
    rows = max(1, block_elements // max(1, w.shape[1] if w.dim() > 1 else 1))
    return all(bool(torch.isfinite(block).all()) for block in w.split(rows))


def quantize_weight(w: torch.Tensor, cfg: TensorQConfig, block_elements: int = BLOCK_ELEMENTS
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data [N, K], scale [N] per channel or 0-d per tensor) of a finite weight ``w`` [N, K], with the
    weight observer of ``cfg`` (as ``convert`` stores it)."""
    per_channel = cfg.granularity == "channel"
    rows = max(1, block_elements // max(1, w.shape[1]))
    observer = cfg.observer.create(cfg.format, 0 if per_channel else None)
    if per_channel and w.shape[0] > 0 and not isinstance(observer, MSEObserver):
        scales = []
        for block in w.split(rows):
            part = cfg.observer.create(cfg.format, 0)
            part(block)
            scales.append(part.scale())
        scale = torch.cat(scales)
    elif not per_channel and isinstance(observer, _MAX_BASED):
        amax = torch.zeros((), dtype=torch.float32, device=w.device)
        for block in w.split(rows):
            lo, hi = torch.aminmax(block)
            amax = torch.maximum(amax, torch.maximum(-lo, hi).float())
        observer(amax.reshape(1))
        scale = observer.scale()
    else:
        observer(w)
        scale = observer.scale()
    q = torch.empty(w.shape, dtype=cfg.format.dtype, device=w.device)
    for start in range(0, w.shape[0], rows):
        s = scale[start: start + rows].unsqueeze(1) if per_channel else scale
        q[start: start + rows] = kernels.quantize(w[start: start + rows], s, cfg.format)
    return q, scale


def quantize_fp8_weight(w: torch.Tensor, cfg: TensorQConfig
                        ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]:
    """(FP8 data, scale, block) of a finite [N, K] weight as convert stores it: block-scaled (compressed-tensors
    FP8_BLOCK: each block's amax / fmt.max) for granularity "block", else :func:`quantize_weight`."""
    if cfg.granularity == "block":
        q, scale = kernels.block_quantize_weight(w, cfg.block, cfg.format)
        return q.contiguous(), scale, cfg.block
    q, scale = quantize_weight(w, cfg)
    return q, scale, None


def quantize_experts(w3: torch.Tensor, cfg: TensorQConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data [E, N, K], scale) of stacked expert weights with the weight observer of ``cfg``: scale [E, N] per
    channel, [E, 1] per tensor (one per expert), [E, ⌈N/bn⌉, ⌈K/bk⌉] per block."""
    num_e, n, k = w3.shape
    if cfg.granularity == "block":
        return block_quantize_experts(w3, cfg.block, cfg.format)
    observer = cfg.observer.create(cfg.format, 0)
    if cfg.granularity == "channel":
        observer(w3.reshape(num_e * n, k))
        scale = observer.scale().reshape(num_e, n)
    else:
        observer(w3.reshape(num_e, n * k))
        scale = observer.scale().reshape(num_e, 1)
    return kernels.quantize(w3, scale.unsqueeze(-1), cfg.format).contiguous(), scale


def block_quantize_experts(w3: torch.Tensor, block: tuple[int, int], fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 of stacked expert weights [E, N, K]: (qdata [E, N, K], scale [E, ⌈N/bn⌉, ⌈K/bk⌉]), each
    expert blocked on its own (blocks never straddle two experts)."""
    pairs = [kernels.block_quantize_weight(w3[e], block, fmt) for e in range(w3.shape[0])]
    return torch.stack([q for q, _ in pairs]).contiguous(), torch.stack([s for _, s in pairs])
