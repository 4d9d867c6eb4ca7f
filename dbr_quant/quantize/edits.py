"""In-place edits of a converted FP8 weight re-quantize it: never a silent no-op.

What writes into ``module.weight`` after convert, and what it gets:

* PEFT's ``merge_and_unload`` (``weight.data += delta``, or ``w = weight.data.clone(); w += delta;
  weight.data = w``), Hugging Face ``_init_weights`` (``nn.init.normal_``), ``add_`` / ``mul_`` / ``zero_`` /
  ``fill_`` / ``normal_`` / ``uniform_`` / ``copy_`` / ``w[i] = v`` / ``.data = tensor``: the weight is
  dequantized to fp32, the op runs there, and the result is quantized again with the weight's own rule —
  the config convert used (format, observer, granularity: per tensor, per channel or per block) — into the
  weight's own buffers. The scale changes with the values; the layout does not, so the rows of a stacked
  gated-MLP ``[gate; up]`` buffer stay in place and the fused GEMM keeps reading one buffer.
* Why re-quantize and not raise: merging an adapter or re-initialising a layer after convert is something
  users do (PEFT merge is the common one); the result is what converting the edited fp32 weight would give
  (GPTQ-rounded weights are rounded to nearest again: the calibration Hessians are gone).
* What raises: an edit that changes the shape, produces NaN/inf, or writes a weight that accelerate keeps
  offloaded (its bytes live in accelerate's weights map); ``FP8Weight(tensor)`` without scales (accelerate's
  ``set_module_tensor_to_device(..., value=tensor)``).

``weights.FP8Weight`` routes each such write here (``__torch_dispatch__`` of a mutating op, ``.data =``,
``w[i] = v``, ``copy_``); this module reads the weight through :class:`EditableWeight`, so it never imports the
class and the two import one way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from dbr_quant.formats import FP8Format
from dbr_quant.qconfig import TensorQConfig
from dbr_quant.quantize.weight_quantization import all_finite, quantize_weight

__all__ = ["EditableWeight", "weight_config", "edit", "requantize"]


class EditableWeight(Protocol):
    """What an edit reads and writes of an FP8 weight (``weights.FP8Weight``, which calls this module: an edit
    never needs the class itself)."""

    qdata: torch.Tensor
    scale: torch.Tensor
    transposed: bool
    block: tuple[int, int] | None
    qconfig: TensorQConfig | None

    @property
    def shape(self) -> torch.Size: ...

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor: ...


def weight_config(w: EditableWeight) -> TensorQConfig:
    """The weight config ``w`` was quantized with: the one convert stored, else (a weight loaded from a
    checkpoint) the one its layout implies, with amax scales as compressed-tensors computes them."""
    if w.qconfig is not None:
        return w.qconfig
    fmt = FP8Format.of(w.qdata.dtype)
    if w.scale.dtype == torch.uint8:  # E8M0 codes: MX
        return TensorQConfig(format=fmt, granularity="mx")
    if w.block is not None:
        return TensorQConfig(format=fmt, granularity="block", block=w.block)
    experts_per_tensor = w.qdata.dim() == 3 and w.scale.shape[-1] == 1 < w.qdata.shape[1]  # [E, 1] per expert
    return TensorQConfig(format=fmt, granularity="tensor" if w.scale.dim() == 0 or experts_per_tensor else "channel")


def requantize(w: EditableWeight, values: torch.Tensor, what: str) -> None:
    """Quantize ``values`` (``w``'s logical layout) into ``w``'s own ``qdata`` and ``scale``, in place, with
    ``w``'s rule (:func:`weight_config`, the quantizer convert uses)."""
    if tuple(values.shape) != tuple(w.shape):
        raise RuntimeError(f"dbr_quant: {what} would make an FP8 weight {list(w.shape)} {list(values.shape)}; a "
                           "converted weight keeps its shape (call dq.disabled() or convert the edited model again)")
    if w.qdata.is_meta:
        raise RuntimeError(f"dbr_quant: {what} on an offloaded FP8 weight (accelerate keeps its bytes in the "
                           "weights map); edit the weight before convert, or load the model without offloading")
    if w.scale.dim() == 0 and w.qdata.numel() * w.qdata.element_size() < w.qdata.untyped_storage().nbytes():
        # rows of a per-tensor weight (in_proj_weight[:E], w.chunk(3)): one scale serves every row, so
        # re-quantizing these rows alone would silently rescale the others
        raise RuntimeError(f"dbr_quant: {what} on rows {list(w.shape)} of a per-tensor-scaled FP8 weight would "
                           "change the scale of its other rows; edit the whole parameter instead")
    values = values.transpose(-2, -1) if w.transposed else values
    values = values.float().contiguous()
    if not all_finite(values.reshape(-1, values.shape[-1])):
        raise ValueError(f"dbr_quant: {what} would put NaN/inf into an FP8 weight {list(w.shape)}; the weight "
                         "is left as it was")
    quantized = quantize_weight(values, weight_config(w))
    w.qdata.copy_(quantized.qdata)
    # a per-tensor scale stored per row (a stacked [gate; up] buffer) takes the one value in every row
    scale = quantized.scale
    w.scale.copy_(scale.reshape(()) if scale.numel() == 1 else scale.reshape(w.scale.shape))


def edit(w: EditableWeight, fn: Callable[[torch.Tensor], Any], what: str) -> None:
    """Run ``fn`` on ``w``'s fp32 values (in place), then re-quantize the result into ``w``."""
    high = w.dequantize(torch.float32)
    fn(high)
    requantize(w, high, what)
