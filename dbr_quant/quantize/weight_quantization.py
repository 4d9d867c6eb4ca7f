"""The one weight quantizer: a weight to FP8 exactly as ``convert`` stores it.

Every place that needs a weight in FP8 calls :func:`quantize_weight`: ``convert`` (linear modules, parameters
read by functional linears, 3-D MoE expert weights), an in-place edit of a converted weight (``edits.py``),
``dbr_quant.inspect`` (a prepared model's weights as convert will store them) and a functional linear whose
parameter stays high precision (quantized on every call, ``ops/basic.py``). The weight config decides:
the observer of :class:`TensorQConfig` (per output channel or per tensor), block scales (each block's
amax / fmt.max, the compressed-tensors FP8_BLOCK layout), MX scales (a power of two per 1×32 block, stored as
uint8 E8M0 codes: compressed-tensors MXFP8, ``kernels.reference.mx``), a rounding other than nearest (GPTQ, given by the
caller, which holds the calibration Hessians), and a 3-D [E, N, K] weight is quantized per expert.

Memory: ``convert(prepared, inplace=True)`` quantizes one weight at a time and drops its high-precision copy
before the next one; per-channel and per-tensor weights are observed and quantized in blocks of rows, so the
temporaries are bounded by a block, not the layer (``benchmarks/convert_memory.py`` measures it). The result
is bit-identical to observing and quantizing the whole weight at once (tested): per-channel statistics are per
row, quantization is elementwise, and a per-tensor amax of the max-based observers is the max of the blocks'
amaxes. Percentile and MSE per tensor, and MSE per channel (its column subsample depends on the channel
count), observe the whole weight at once.

Speed: a weight quantized on every call (``per_call=True``) takes one pass: with an observer whose scale of one
batch is the batch's amax / fmt.max (running max, moving average, amax history without margin) that is the
dynamic-scale kernel; any other observer runs as convert runs it, so both agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dbr_quant import kernels
from dbr_quant.kernels.reference.block import expand_block_scale
from dbr_quant.kernels.reference.mx import MX_WEIGHT_BLOCK, e8m0_to_float
from dbr_quant.observers import MSE, AmaxHistory, MovingAverage, ObserverConfig, RunningMax
from dbr_quant.qconfig import TensorQConfig

__all__ = ["QuantizedWeight", "WeightRounding", "quantize_weight", "all_finite", "elementwise_block_scale"]

BLOCK_ELEMENTS = 2**18  # 1 MiB of fp32 per block


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight in FP8 as convert stores it. ``qdata``: [N, K] (or [E, N, K] for stacked experts), contiguous.
    ``scale`` (fp32): [N] per channel, 0-d per tensor, [⌈N/bn⌉, ⌈K/bk⌉] per block; for experts [E, N], [E, 1]
    (one per expert) or [E, ⌈N/bn⌉, ⌈K/bk⌉]; MX: uint8 E8M0 codes [N, ⌈K/32⌉] (experts [E, N, ⌈K/32⌉]) with
    block (1, 32). ``block``: the (bn, bk) tile of a block-scaled (or MX) weight, else None."""

    qdata: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None


class WeightRounding(Protocol):
    """Rounding other than to nearest (GPTQ: ``runtime.hessians.HessianCollector``): the FP8 data of ``w`` on the
    grid of ``scale``, given the nearest-rounded data ``nearest`` (what it returns where it has nothing to fit)."""

    def __call__(self, w: torch.Tensor, cfg: TensorQConfig, scale: torch.Tensor, nearest: torch.Tensor
                 ) -> torch.Tensor: ...


def all_finite(w: torch.Tensor, block_elements: int = BLOCK_ELEMENTS) -> bool:
    """No NaN/inf in ``w`` (checked per block: no layer-sized mask)."""
    rows = max(1, block_elements // max(1, w.shape[1] if w.dim() > 1 else 1))
    return all(bool(torch.isfinite(block).all()) for block in w.split(rows))


def quantize_weight(w: torch.Tensor, cfg: TensorQConfig, *, rounding: WeightRounding | None = None,
                    per_call: bool = False, block_elements: int = BLOCK_ELEMENTS) -> QuantizedWeight:
    """A finite weight ``w`` ([N, K], or [E, N, K] stacked experts) in FP8 as convert stores it with the weight
    config ``cfg`` (see the module docstring). ``rounding``: applied to a per-channel / per-tensor 2-D weight
    after nearest rounding (GPTQ; experts and block-scaled weights round to nearest). ``per_call``: the weight
    is quantized on every call (one pass, no row blocks; same values)."""
    if w.dim() == 3:
        return _quantize_experts(w, cfg)
    if cfg.granularity == "mx":
        q, scale = kernels.mx_quantize(w, cfg.format, cfg.mx_scale_rounding == "ceil")
        return QuantizedWeight(q if per_call else q.contiguous(), scale, MX_WEIGHT_BLOCK)
    if cfg.granularity == "block":
        q, scale = kernels.block_quantize_weight(w, cfg.block, cfg.format)
        # stored weights are contiguous (a Conv1D weight arrives transposed); a per-call one goes to the GEMM as
        # the kernel returned it (as before: no extra copy in a captured graph)
        return QuantizedWeight(q if per_call else q.contiguous(), scale, cfg.block)
    per_channel = cfg.granularity == "channel"
    if per_call and _scale_is_amax(cfg.observer):
        scale = kernels.dynamic_scale(w, cfg.format, per_token=per_channel)
        return QuantizedWeight(kernels.quantize(w, scale, cfg.format), scale.reshape(-1) if per_channel else scale)
    rows = max(1, w.shape[0] if per_call else block_elements // max(1, w.shape[1]))
    scale = _observed_scale(w, cfg, rows)
    q = torch.empty(w.shape, dtype=cfg.format.dtype, device=w.device)
    for start in range(0, w.shape[0], rows):
        s = scale[start: start + rows].unsqueeze(1) if per_channel else scale
        q[start: start + rows] = kernels.quantize(w[start: start + rows], s, cfg.format)
    if rounding is not None:
        q = rounding(w, cfg, scale, q)  # same scale, the rounding's grid points
    return QuantizedWeight(q, scale)


def elementwise_block_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """One scale per element of FP8 data ``shape`` [N, K] from its block scales [⌈N/bn⌉, ⌈K/bk⌉]; for stacked
    experts [E, N, K] (scales [E, ⌈N/bn⌉, ⌈K/bk⌉]) each expert's own block grid. MX codes (uint8) decoded."""
    if scale.dtype == torch.uint8:
        scale = e8m0_to_float(scale)
    rows_cols = (shape[-2], shape[-1])
    if len(shape) == 3:
        return torch.stack([expand_block_scale(s, rows_cols, block) for s in scale])
    return expand_block_scale(scale, rows_cols, block)


def _scale_is_amax(observer: ObserverConfig) -> bool:
    """Whether the observer's scale after one batch is that batch's amax / fmt.max (the dynamic scale)."""
    return isinstance(observer, (RunningMax, MovingAverage)) or (
        isinstance(observer, AmaxHistory) and observer.margin == 0)


def _observed_scale(w: torch.Tensor, cfg: TensorQConfig, rows: int) -> torch.Tensor:
    """The weight observer's scale of ``w`` [N, K] ([N] per channel, 0-d per tensor), read ``rows`` rows at a time
    where that gives the same result."""
    if cfg.granularity == "channel" and w.shape[0] > 0 and not isinstance(cfg.observer, MSE):
        scales = []
        for block in w.split(rows):
            part = cfg.observer.create(cfg.format, 0)
            part(block)
            scales.append(part.scale())
        return torch.cat(scales)
    observer = cfg.observer.create(cfg.format, 0 if cfg.granularity == "channel" else None)
    if cfg.granularity == "tensor" and isinstance(cfg.observer, (RunningMax, MovingAverage, AmaxHistory)):
        amax = torch.zeros((), dtype=torch.float32, device=w.device)  # one batch: amax = max |w|
        for block in w.split(rows):
            lo, hi = torch.aminmax(block)
            amax = torch.maximum(amax, torch.maximum(-lo, hi).float())
        observer(amax.reshape(1))
    else:
        observer(w)
    return observer.scale()


def _quantize_experts(w3: torch.Tensor, cfg: TensorQConfig) -> QuantizedWeight:
    """Stacked expert weights [E, N, K], each expert on its own: the observer of ``cfg`` per expert and output
    channel ([E, N]) or per expert ([E, 1]); block scales per expert (blocks never straddle two experts)."""
    num_e, n, k = w3.shape
    if cfg.granularity == "mx":  # each expert's rows: E8M0 codes [E, N, ⌈K/32⌉], what the grouped MX GEMM reads
        q, code = kernels.mx_quantize(w3, cfg.format, cfg.mx_scale_rounding == "ceil")
        return QuantizedWeight(q.contiguous(), code, MX_WEIGHT_BLOCK)
    if cfg.granularity == "block":
        pairs = [kernels.block_quantize_weight(w3[e], cfg.block, cfg.format) for e in range(num_e)]
        return QuantizedWeight(torch.stack([q for q, _ in pairs]).contiguous(), torch.stack([s for _, s in pairs]),
                               cfg.block)
    observer = cfg.observer.create(cfg.format, 0)
    if cfg.granularity == "channel":
        observer(w3.reshape(num_e * n, k))
        scale = observer.scale().reshape(num_e, n)
    else:
        observer(w3.reshape(num_e, n * k))
        scale = observer.scale().reshape(num_e, 1)
    return QuantizedWeight(kernels.quantize(w3, scale.unsqueeze(-1), cfg.format).contiguous(), scale)
