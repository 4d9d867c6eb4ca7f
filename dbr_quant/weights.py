"""The FP8 weight of a converted linear: ``module.weight`` stays, stored as FP8 bytes plus scales.

``FP8Weight`` is a wrapper tensor subclass (the design torchao's ``Float8Tensor`` uses): it reports the
original high-precision dtype, the original shape and the real device, so model code that reads
``module.weight.dtype`` / ``.shape`` / ``.device`` (Hugging Face T5, tied embeddings, PEFT, accelerate)
keeps working, while its only storage is ``qdata`` (FP8, ``[out, in]``) and ``scale`` (fp32, ``[out]`` per
channel, 0-d per tensor, or ``[⌈out/bn⌉, ⌈in/bk⌉]`` per ``block`` = (bn, bk) tile: the compressed-tensors
FP8_BLOCK / FineGrainedFP8 layout, see kernels.reference_block). Why a subclass rather than buffers beside a
dropped ``weight``:

* ``Module.to(dtype)`` / ``.half()`` / ``.bfloat16()`` pass each parameter through ``_to_copy``; the subclass
  answers by changing only the dtype it reports (the compute/output dtype), never the FP8 bytes or the
  fp32 scales. A plain FP8 buffer counts as floating point and would be cast to bf16/fp16 silently.
* Anything outside dbr_quant's runtime that uses it as a tensor (``F.linear(x, m.weight)``,
  ``m.weight.float()``, ``m.weight @ x``) gets the dequantized values (``__torch_dispatch__`` fallback).
* ``__tensor_flatten__`` lets ``torch.export`` / ``torch.compile`` see the two inner tensors.

The runtime never goes through dispatch: it reads ``qdata`` and ``scale`` directly. ``state_dict()`` of a
converted linear holds ``weight`` (float8) and ``weight_scale`` (fp32), the keys serving engines read.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

aten = torch.ops.aten

__all__ = ["FP8Weight", "attach_fp8_weight", "fp8_weight_of", "adjacent_rows", "fp8_weight_bytes"]


class FP8Weight(torch.Tensor):
    """An FP8 weight (``qdata`` × ``scale``) that reports the high-precision ``dtype`` it replaces.

    ``transposed`` marks Hugging Face ``Conv1D`` (GPT-2), whose weight is ``[in, out]``: the logical tensor
    is ``qdata.T`` while ``qdata`` stays ``[out, in]`` for the GEMM (blocks tile ``qdata``). ``block`` is the
    (rows, columns) tile of a block-scaled weight, None for per-tensor / per-channel scales. A 3-D ``qdata``
    ``[E, out, in]`` is the stacked weights of an MoE experts module (``dbr_quant.moe``; ``scale`` ``[E, out]``,
    ``[E, 1]``, or ``[E, ⌈out/bn⌉, ⌈in/bk⌉]`` with ``block``); ``transposed`` then swaps the last two dims
    (experts stored ``[E, in, out]``).
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    transposed: bool
    block: tuple[int, int] | None

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                transposed: bool = False, block: tuple[int, int] | None = None, *, requires_grad: bool = False):
        if isinstance(qdata, FP8Weight) and scale is None:
            # ``type(param)(value, requires_grad=...)``: how accelerate's set_module_tensor_to_device rebuilds a
            # parameter it moves (offloaded models, see offload.py). A parameter, like nn.Parameter(value).
            if requires_grad:
                raise RuntimeError("dbr_quant: an FP8 weight is inference-only; it cannot require grad")
            return nn.Parameter(qdata._like(), requires_grad=False)
        shape = (*qdata.shape[:-2], qdata.shape[-1], qdata.shape[-2]) if transposed else qdata.shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 transposed: bool = False, block: tuple[int, int] | None = None, *, requires_grad: bool = False):
        if scale is None:  # the copy form above: __new__ returned a complete FP8Weight
            return
        self.qdata = qdata
        self.scale = scale
        self.transposed = transposed
        self.block = None if block is None else (int(block[0]), int(block[1]))

    def data_ptr(self) -> int:
        """The FP8 data's address (a wrapper has no storage of its own; accelerate tells tied weights apart
        by ``data_ptr()``, and every wrapper would otherwise answer 0)."""
        return self.qdata.data_ptr()

    def __repr__(self) -> str:
        gran = ("per-tensor" if self.scale.dim() == 0 else "per-channel" if self.block is None
                else f"{self.block[0]}x{self.block[1]} block")
        return (f"FP8Weight(shape={list(self.shape)}, dtype={self.dtype}, storage={self.qdata.dtype}, {gran} scale, "
                f"device={self.device})")

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["qdata", "scale"], (self.dtype, self.transposed, self.block)

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: Any, outer_size: Any, outer_stride: Any) -> FP8Weight:
        return FP8Weight(inner["qdata"], inner["scale"], *ctx)

    def __deepcopy__(self, memo: dict) -> FP8Weight:
        # memo-aware copies keep a stacked [gate; up] pair sharing one storage after deepcopy
        out = FP8Weight(copy.deepcopy(self.qdata, memo), copy.deepcopy(self.scale, memo), self.dtype, self.transposed,
                        self.block)
        if isinstance(self, nn.Parameter):
            out = nn.Parameter(out, requires_grad=False)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol: int):  # torch.save(model) / pickle
        return _rebuild, (self.qdata, self.scale, self.dtype, self.transposed, isinstance(self, nn.Parameter),
                          self.block)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision values ``qdata × scale`` in ``dtype`` (default: the reported dtype)."""
        from . import kernels

        w = kernels.dequantize(self.qdata, self.elementwise_scale(), dtype or self.dtype)
        return w.transpose(-2, -1) if self.transposed else w

    def elementwise_scale(self) -> torch.Tensor:
        """``scale`` broadcastable against ``qdata`` [out, in]: 0-d, [out, 1], or one per element for blocks."""
        if self.block is not None:
            from .kernels.reference_block import expand_block_scale

            if self.qdata.dim() == 3:  # MoE experts: scale [E, ⌈N/bn⌉, ⌈K/bk⌉], each expert blocked on its own
                return torch.stack([expand_block_scale(s, tuple(self.qdata.shape[1:]), self.block) for s in self.scale])
            return expand_block_scale(self.scale, tuple(self.qdata.shape), self.block)
        return self.scale.unsqueeze(-1) if self.scale.dim() else self.scale

    def _like(self, qdata: torch.Tensor | None = None, scale: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> FP8Weight:
        return FP8Weight(self.qdata if qdata is None else qdata, self.scale if scale is None else scale,
                         self.dtype if dtype is None else dtype, self.transposed, self.block)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if torch.is_inference_mode_enabled():
            # what a view op (detach, t) returns gets the FP8Weight's version counter after this returns: an
            # output made here inside inference_mode would be an inference tensor, which has none (RuntimeError)
            with torch.inference_mode(False):
                return cls.__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        # any other use as a tensor: the dequantized high-precision values
        unwrap = lambda t: t.dequantize() if isinstance(t, FP8Weight) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _rebuild(qdata, scale, dtype, transposed, is_param, block=None):
    w = FP8Weight(qdata, scale, dtype, transposed, block)
    return nn.Parameter(w, requires_grad=False) if is_param else w


def _to_copy(w: FP8Weight, *, dtype=None, device=None, layout=None, pin_memory=None, non_blocking=False,
             memory_format=None) -> FP8Weight:
    """``.to(dtype)`` switches the reported (compute) dtype only; ``.to(device)`` moves bytes and scales."""
    if dtype is not None and not (dtype.is_floating_point and dtype.itemsize >= 2):
        raise TypeError(f"dbr_quant: an FP8 weight can compute in float32/bfloat16/float16, not {dtype}; "
                        "call .dequantize() for the values in another dtype")
    q, s = w.qdata, w.scale
    if device is not None and torch.device(device) != q.device:
        q, s = q.to(device, non_blocking=non_blocking), s.to(device, non_blocking=non_blocking)
    return w._like(q, s, dtype)


def _copy_(dst: FP8Weight, src: torch.Tensor, non_blocking: bool = False) -> FP8Weight:
    if not isinstance(src, FP8Weight):
        raise TypeError("dbr_quant: copying high-precision values into an FP8 weight would re-quantize it "
                        "with stale scales; load a converted state_dict (weight + weight_scale) instead")
    if src.block != dst.block:
        raise RuntimeError(f"dbr_quant: FP8 weight block mismatch: {src.block} into {dst.block}")
    if src.qdata.shape != dst.qdata.shape or src.scale.shape != dst.scale.shape:
        raise RuntimeError(f"dbr_quant: FP8 weight shape/scale mismatch: {list(src.qdata.shape)} "
                           f"{list(src.scale.shape)} into {list(dst.qdata.shape)} {list(dst.scale.shape)}")
    dst.qdata.copy_(src.qdata, non_blocking)
    dst.scale.copy_(src.scale, non_blocking)
    return dst


_HANDLERS = {
    aten.detach.default: lambda w: w._like(),
    aten.alias.default: lambda w: w._like(),
    aten.clone.default: lambda w, memory_format=None: w._like(w.qdata.clone(), w.scale.clone()),
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.is_same_size.default: lambda a, b: a.shape == b.shape,
}


# ---------------------------------------------------------------------- modules
def fp8_weight_of(module: nn.Module) -> FP8Weight | None:
    """The module's FP8 weight when convert stored one, else None (the hot path: one dict lookup)."""
    w = module._parameters.get("weight")
    return w if type(w) is FP8Weight else None


def attach_fp8_weight(module: nn.Module, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      transposed: bool = False, block: tuple[int, int] | None = None) -> None:
    """Make ``module.weight`` an FP8 weight; its state_dict entries become ``weight`` (FP8) + ``weight_scale``
    (2-d [⌈out/bn⌉, ⌈in/bk⌉] for a block-scaled weight, as compressed-tensors FP8_BLOCK stores it)."""
    module._parameters["weight"] = nn.Parameter(FP8Weight(qdata, scale, dtype, transposed, block),
                                                requires_grad=False)
    if not module.__dict__.get("_dbr_fp8_hooks"):
        module._register_state_dict_hook(_state_dict_hook)
        module._register_load_state_dict_pre_hook(_load_hook, with_module=True)
        module.__dict__["_dbr_fp8_hooks"] = True


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    w = fp8_weight_of(module)
    if w is None:
        return
    q, s = w.qdata, w.scale
    if q.untyped_storage().nbytes() != q.numel() * q.element_size():
        q, s = q.clone(), s.clone()  # rows of a stacked [gate; up] buffer: safetensors refuses shared storage
    state_dict[prefix + "weight"] = q
    state_dict[prefix + "weight_scale"] = s


def _load_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """``weight`` (FP8) + ``weight_scale`` from a checkpoint become one FP8Weight, which the stock loader
    then copies into the module's weight in place (a stacked [gate; up] buffer stays shared)."""
    w = fp8_weight_of(module)
    key = prefix + "weight"
    if w is None or key not in state_dict or isinstance(state_dict[key], FP8Weight):
        return
    q, s = state_dict[key], state_dict.pop(prefix + "weight_scale", None)
    if s is None:
        missing.append(prefix + "weight_scale")
        del state_dict[key]
        return
    if q.dtype != w.qdata.dtype or q.shape != w.qdata.shape or s.shape != w.scale.shape:
        errors.append(f"{prefix}weight: the checkpoint holds {q.dtype} {list(q.shape)} with scale {list(s.shape)}, "
                      f"the converted model {w.qdata.dtype} {list(w.qdata.shape)} with scale {list(w.scale.shape)}; "
                      "convert the model with the same QConfig before loading")
        del state_dict[key]
        return
    state_dict[key] = FP8Weight(q, s, w.dtype, w.transposed, w.block)


def adjacent_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``cat([a, b])`` without a copy when ``b``'s rows directly follow ``a``'s in one storage, else None."""
    if is_fake(a) or is_fake(b):
        # while a graph is captured the two are separate graph inputs: a view reaching from one into the
        # other's rows would read whatever the other input holds at run time (after a device move, garbage)
        return None
    if a.dtype != b.dtype or a.device != b.device or a.shape[1:] != b.shape[1:] or not (
            a.is_contiguous() and b.is_contiguous()):
        return None
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    if b.storage_offset() != a.storage_offset() + a.numel():
        return None
    return a.as_strided((a.shape[0] + b.shape[0], *a.shape[1:]), a.stride(), a.storage_offset())


def fp8_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's FP8 weights occupy (FP8 data + scales; a shared buffer counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for m in model.modules():
        w = fp8_weight_of(m)
        if w is None:
            continue
        for t in (w.qdata, w.scale):
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total
