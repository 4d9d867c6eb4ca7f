"""The FP8 weight of a converted linear: ``module.weight`` stays, stored as FP8 bytes plus scales.

``FP8Weight`` is a wrapper tensor subclass (the design torchao's ``Float8Tensor`` uses): it reports the
original high-precision dtype, the original shape and the real device, so model code that reads
``module.weight.dtype`` / ``.shape`` / ``.device`` (Hugging Face T5, tied embeddings, PEFT, accelerate)
keeps working, while its only storage is ``qdata`` (FP8, ``[out, in]``) and ``scale`` (fp32, ``[out]`` per
channel, 0-d per tensor, or ``[⌈out/bn⌉, ⌈in/bk⌉]`` per ``block`` = (bn, bk) tile: the compressed-tensors
FP8_BLOCK / FineGrainedFP8 layout, see kernels.reference.block). Why a subclass rather than buffers beside a
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
import hashlib
import pickle
import weakref
from collections.abc import Callable
from typing import Any, SupportsIndex, cast, get_args

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.observers.config import ObserverConfig
from dbr_quant.qconfig import TensorQConfig
from dbr_quant.quantize.edits import edit, requantize
from dbr_quant.quantize.weight_quantization import elementwise_block_scale

DEQUANTIZE_CHUNK = 1 << 22  # elements per chunk of a large weight's dequantize (fp32 temporaries: 16 MiB)
# elements per chunk of an FP8 weight's rows dequantized for a matmul outside the runtime (F.linear on the weight:
# load_pretrained's trace runs every FP8 linear so). Small: the transient fp32 + high-precision copies of a chunk
# are what the allocator keeps resident between layers (1 MiB + 512 KiB for bf16; a 4M-element chunk left the
# load's RSS 130 MB higher on a 193 MB folder, benchmarks/checkpoint_memory.py --foreign).
MATMUL_CHUNK = 1 << 18

aten = torch.ops.aten

__all__ = ["FP8Weight", "attach_fp8_weight", "fp8_weight_of", "displaced_fp8_weight", "adjacent_rows",
           "fp8_weight_bytes"]


class FP8Weight(torch.Tensor):
    """An FP8 weight (``qdata`` × ``scale``) that reports the high-precision ``dtype`` it replaces.

    ``transposed`` marks Hugging Face ``Conv1D`` (GPT-2), whose weight is ``[in, out]``: the logical tensor
    is ``qdata.T`` while ``qdata`` stays ``[out, in]`` for the GEMM (blocks tile ``qdata``). ``block`` is the
    (rows, columns) tile of a block-scaled weight, None for per-tensor / per-channel scales. A 3-D ``qdata``
    ``[E, out, in]`` is the stacked weights of an MoE experts module (``dbr_quant.moe.experts``; ``scale`` ``[E, out]``,
    ``[E, 1]``, or ``[E, ⌈out/bn⌉, ⌈in/bk⌉]`` with ``block``); ``transposed`` then swaps the last two dims
    (experts stored ``[E, in, out]``). ``qconfig`` is the weight config convert quantized it with (None when
    loaded from a checkpoint): an in-place edit (``add_``, ``.data +=``, ``copy_``, ``normal_``, …) re-quantizes
    with it (``edits.py``).
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    transposed: bool
    block: tuple[int, int] | None
    qconfig: TensorQConfig | None

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, /, scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                transposed: bool = False, block: tuple[int, int] | None = None, *, requires_grad: bool = False,
                qconfig: TensorQConfig | None = None, **attributes: Any):
        if isinstance(qdata, FP8Weight):
            # ``type(param)(value, requires_grad=...)``: how accelerate's set_module_tensor_to_device rebuilds a
            # parameter it moves (offloaded models: integrations/accelerate.py), like nn.Parameter(value).
            # init_empty_weights' register_parameter passes the parameter's ``__dict__`` too (accelerate/
            # big_modeling.py: ``param_cls(param.to(device), **param.__dict__)``, so that bitsandbytes' Params4bit
            # keeps its quant state): those are the moved weight's own attributes, which it already holds.
            if requires_grad:
                raise RuntimeError(_frozen(qdata))
            return nn.Parameter(qdata._like(), requires_grad=False)
        if attributes:
            raise TypeError(f"FP8Weight() got unexpected keyword arguments {sorted(attributes)}")
        if scale is None:
            raise TypeError("dbr_quant: FP8Weight(tensor) got high-precision values without scales (what accelerate's "
                            "set_module_tensor_to_device(module, 'weight', device, value=tensor) does to a converted "
                            "linear); give a converted weight new values in place instead: `with torch.no_grad(): "
                            "module.weight.copy_(values)` re-quantizes them with the weight's own scale rule")
        shape = (*qdata.shape[:-2], qdata.shape[-1], qdata.shape[-2]) if transposed else qdata.shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata: torch.Tensor, /, scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 transposed: bool = False, block: tuple[int, int] | None = None, *, requires_grad: bool = False,
                 qconfig: TensorQConfig | None = None, **attributes: Any):
        if isinstance(qdata, FP8Weight) or scale is None:  # the copy form: __new__ returned a complete FP8Weight
            return
        self.qdata = qdata
        self.scale = scale
        self.transposed = transposed
        self.block = None if block is None else (int(block[0]), int(block[1]))
        self.qconfig = qconfig

    @property
    def data(self) -> FP8Weight:
        # an FP8Weight sharing qdata and scale (aten.detach below); ``data`` is a C getset descriptor, which the
        # stubs type as a Tensor
        return torch._C.TensorBase.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``param.data = value``: another FP8 weight is taken as it is (it shares the bytes, as torch's ``.data =``
        does); high-precision values (PEFT's merge) are re-quantized into this weight."""
        if value.shape != self.shape:
            raise RuntimeError(f"dbr_quant: `.data =` a {list(value.shape)} tensor on an FP8 weight "
                               f"{list(self.shape)}; a converted weight keeps its shape (call dq.disabled() or convert "
                               "the edited model again)")
        if not isinstance(value, FP8Weight):
            edit(self, lambda high: high.copy_(value), "`.data = tensor`")
            return
        if value.dtype != self.dtype:
            raise RuntimeError(f"dbr_quant: `.data =` an FP8 weight reporting {value.dtype} on one reporting "
                               f"{self.dtype}; change the compute dtype with module.to(dtype)")
        self.qdata, self.scale, self.transposed, self.block, self.qconfig = (
            value.qdata, value.scale, value.transposed, value.block, value.qconfig)

    @property
    def requires_grad(self) -> bool:  # the C getset descriptor, typed as a plain attribute by the stubs
        return torch._C.TensorBase.requires_grad.__get__(self)  # type: ignore[attr-defined]

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        """``p.requires_grad = True`` (a fine-tuning loop over ``model.parameters()``) would train nothing: no
        gradient ever reaches an FP8 weight. Refused, saying what to do; ``False`` is what it already is."""
        if value:
            raise RuntimeError(_frozen(self))
        torch._C.TensorBase.requires_grad.__set__(self, False)  # type: ignore[attr-defined]

    def requires_grad_(self, requires_grad: bool = True) -> FP8Weight:
        """``model.requires_grad_(True)``: refused as the setter is."""
        if requires_grad:
            raise RuntimeError(_frozen(self))
        return self

    def __setitem__(self, index: Any, value: Any) -> None:
        """``weight[i] = v``: the edited values are re-quantized into this weight (not a temporary copy)."""
        v = value.dequantize(torch.float32) if isinstance(value, FP8Weight) else value
        edit(self, lambda high: high.__setitem__(index, v), "`weight[...] = value`")

    # a float subclass where torch types an int: the FP8 data's byte plus the scales' share of one element
    def element_size(self) -> StoredBytesPerElement:  # type: ignore[override]
        """Bytes stored per reported element: (FP8 data + scales) / numel. ``numel() * element_size()`` is how
        Hugging Face's ``get_memory_footprint`` and ``compute_module_sizes`` (transformers/modeling_utils.py,
        integrations/accelerate.py) size a parameter; the element size of the reported dtype (4 for fp32)
        hid the FP8 saving (quantized 4x smaller, reported larger). torchao's subclasses keep the reported
        dtype's size and size models with their own ``get_model_size_in_bytes`` over ``__tensor_flatten__``;
        the product with ``numel()`` here is the exact stored byte count."""
        return StoredBytesPerElement(self.stored_bytes(), self.numel())

    @property
    def nbytes(self) -> int:  # type: ignore[override]  # a C getset descriptor in the stubs
        """The bytes stored: FP8 data + scales (torch's ``nbytes`` is ``numel() * element_size()``)."""
        return self.stored_bytes()

    def stored_bytes(self) -> int:
        """Bytes of this weight's FP8 data and scales (a row slice of a shared buffer: its own rows)."""
        return self.qdata.numel() * self.qdata.element_size() + self.scale.numel() * self.scale.element_size()

    def data_ptr(self) -> int:
        """The FP8 data's address (a wrapper has no storage of its own; accelerate tells tied weights apart
        by ``data_ptr()``, and every wrapper would otherwise answer 0)."""
        return self.qdata.data_ptr()

    # Tensor.__repr__ takes tensor_contents=; mypy flags any typed override of it, even the identical signature
    def __repr__(self) -> str:  # type: ignore[override]
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
                        self.block, qconfig=self.qconfig)
        if isinstance(self, nn.Parameter):
            out = cast(FP8Weight, nn.Parameter(out, requires_grad=False))  # a parameter keeps the subclass
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, tuple]:  # pickle (joblib, Ray), copy, torch.save
        # qdata and scale travel as views of their storage's bytes: torch cannot pickle a float8 storage
        # (its legacy storage format has no float8 class), and one byte tensor per storage keeps a stacked
        # [gate; up] pair sharing one buffer after loading (pickle's memo and torch.save both store it once)
        return _rebuild_from_bytes, (_storage_view(self.qdata), _storage_view(self.scale), self.dtype, self.transposed,
                                     isinstance(self, nn.Parameter), self.block, self.qconfig)

    def _stable_hash_for_caching(self) -> str:
        """What torch.compile's AOT autograd cache keys this weight on (see torch/_functorch/_aot_autograd/
        autograd_cache.py): the inner tensors' metadata (dtype, shape, strides, device) plus the reported
        dtype, shape, layout flags and block. Like a plain parameter, the values are not part of the key: a
        compiled graph takes the FP8 bytes and scales as inputs (freezing, which would bake them in,
        bypasses that cache)."""
        from torch._inductor.codecache import extract_tensor_metadata_for_cache_key

        payload = (tuple(self.shape), str(self.dtype), self.requires_grad, self.transposed, self.block,
                   [extract_tensor_metadata_for_cache_key(t) for t in (self.qdata, self.scale)])
        return hashlib.blake2b(pickle.dumps(payload), digest_size=16).hexdigest()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision values ``qdata × scale`` in ``dtype`` (default: the reported dtype). A large 2-D
        weight is dequantized in row chunks into its output: the kernel's fp32 temporaries (and a block weight's
        per-element scales) then take at most ``DEQUANTIZE_CHUNK`` elements instead of 4 bytes per weight
        element (load_pretrained's trace dequantizes each linear once; its peak is the FP8 model + one layer)."""
        dtype = dtype or self.dtype
        q = self.qdata
        if q.dim() != 2 or q.numel() <= DEQUANTIZE_CHUNK or kernels.graph_ops() is not None or is_fake(q):
            w = kernels.dequantize(q, self.elementwise_scale(), dtype)
        else:
            step = max(1, DEQUANTIZE_CHUNK // q.shape[1])
            if self.block is not None:  # whole block rows per chunk
                step = max(1, step // self.block[0]) * self.block[0]
            w = torch.empty(q.shape, dtype=dtype, device=q.device)
            for start in range(0, q.shape[0], step):
                rows = q[start:start + step]
                w[start:start + step] = kernels.dequantize(rows, self._rows_scale(start, rows.shape), dtype)
        return w.transpose(-2, -1) if self.transposed else w

    def _rows_scale(self, start: int, shape: torch.Size) -> torch.Tensor:
        """:meth:`elementwise_scale` for the rows ``start:start + shape[0]`` of a 2-D ``qdata``."""
        if self.block is not None:
            first = start // self.block[0]
            count = -(-shape[0] // self.block[0])
            return elementwise_block_scale(self.scale[first:first + count], tuple(shape), self.block)
        return self.scale[start:start + shape[0]].unsqueeze(-1) if self.scale.dim() else self.scale

    def elementwise_scale(self) -> torch.Tensor:
        """``scale`` broadcastable against ``qdata`` [out, in]: 0-d, [out, 1], or one per element for blocks."""
        if self.block is not None:
            return elementwise_block_scale(self.scale, self.qdata.shape, self.block)
        return self.scale.unsqueeze(-1) if self.scale.dim() else self.scale

    def _like(self, qdata: torch.Tensor | None = None, scale: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> FP8Weight:
        return FP8Weight(self.qdata if qdata is None else qdata, self.scale if scale is None else scale,
                         self.dtype if dtype is None else dtype, self.transposed, self.block, qconfig=self.qconfig)

    # the stubs type Tensor.__torch_function__ as a classmethod; torch's own subclasses assign this function
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

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
        view = _VIEWS.get(func)
        if view is not None:
            out = view(*args, **kwargs)
            if out is not None:
                return out
        if func._schema.is_mutable:  # add_, mul_, zero_, normal_, out=…: re-quantize what it writes
            edited = _edit_in_place(func, args, kwargs)
            if edited is not None:
                return edited
        return _dequantized(func, args, kwargs)  # any other use as a tensor: the dequantized high-precision values


class StoredBytesPerElement(float):
    """``FP8Weight.element_size()``: the stored bytes per element as a float (one byte of FP8 data plus the
    scales' share), whose product with the weight's ``numel()`` is the exact integer byte count (``n * (b / n)``
    in floating point may miss ``b`` by one ulp, and footprint code sums ``nelement() * element_size()``)."""

    total: int
    count: int

    def __new__(cls, total: int, count: int) -> StoredBytesPerElement:
        out = super().__new__(cls, total / count if count else 0.0)
        out.total, out.count = total, count
        return out

    def __mul__(self, other: Any) -> Any:
        if isinstance(other, int) and not isinstance(other, bool) and other == self.count:
            return self.total
        return float(self) * other

    __rmul__ = __mul__


def _frozen(w: torch.Tensor) -> str:
    return (f"dbr_quant: an FP8 weight {list(w.shape)} is frozen: straight-through gradients reach a converted "
            "model's inputs, biases, norms and high-precision weights but stop at FP8 weights, so requires_grad=True "
            "would train nothing. Set requires_grad on the other parameters only (skip those whose type is "
            "dbr_quant.quantize.weights.FP8Weight), keep the layer high precision to train it "
            "(QConfig(overrides=(Override(pattern=..., skip=True),))), or train adapters (LoRA) beside it.")


def _written(func: Any, args: tuple, kwargs: dict) -> list[FP8Weight]:
    """The FP8 weights among the arguments ``func`` writes into (``self`` of ``add_``, ``out=``)."""
    found: list[FP8Weight] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        if isinstance(value, FP8Weight) and all(value is not w for w in found):
            found.append(value)
    return found


def _edit_in_place(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` writes into FP8 weights: run it on their fp32 values, re-quantize each (``edits.py``). None if
    it writes none."""
    written = _written(func, args, kwargs)
    if not written:
        return None
    high = {id(w): w.dequantize(torch.float32) for w in written}
    unwrap = lambda t: high.get(id(t), t.dequantize()) if isinstance(t, FP8Weight) else t  # noqa: E731
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    for w in written:
        requantize(w, high[id(w)], f"aten.{func.__name__}")
    back = {id(high[id(w)]): w for w in written}
    return tree_map(lambda t: back.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)


# storage → its bytes as one uint8 tensor, alive while a pickle holds it: the same storage reduces to the same
# object, which pickle's memo stores once
_STORAGE_BYTES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _storage_view(t: torch.Tensor) -> tuple:
    """``t`` as (uint8 tensor over its whole storage, dtype, size, stride, offset); a meta tensor as itself."""
    if t.is_meta:
        return (t,)
    storage = t.untyped_storage()
    key = (str(t.device), storage.data_ptr(), storage.nbytes())
    whole = _STORAGE_BYTES.get(key) if storage.nbytes() else None
    if whole is None:
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        if storage.nbytes():
            _STORAGE_BYTES[key] = whole
    return whole, t.dtype, tuple(t.shape), t.stride(), t.storage_offset()


def _from_storage_view(whole: torch.Tensor, dtype: torch.dtype | None = None, size=None, stride=None,
                       offset: int = 0) -> torch.Tensor:
    if dtype is None:  # a meta tensor, pickled as itself
        return whole
    return whole.view(dtype).as_strided(size, stride, offset)


def _rebuild_from_bytes(qdata: tuple, scale: tuple, dtype, transposed, is_param, block=None, qconfig=None):
    w = FP8Weight(_from_storage_view(*qdata), _from_storage_view(*scale), dtype, transposed, block, qconfig=qconfig)
    return nn.Parameter(w, requires_grad=False) if is_param else w


# torch.load's default (weights_only=True) unpickles only allowlisted globals: an FP8 weight saved on its own
# (``torch.save({"w": layer.weight})``) needs its rebuild function and the frozen config dataclasses it carries,
# none of which runs code on load (as torchao allowlists its tensor subclasses)
torch.serialization.add_safe_globals([_rebuild_from_bytes, TensorQConfig, FP8Format, *get_args(ObserverConfig)])


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


def _empty_like(w: FP8Weight, *, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None) -> FP8Weight:
    """``torch.empty_like`` (``module.to_empty(device=...)`` gives a model built on the meta device its storage):
    an FP8 weight with uninitialized bytes and scales, for ``load_state_dict`` to fill. A dequantized empty
    tensor would turn the layer back into a high-precision one, which then refuses the FP8 state dict."""
    device = w.device if device is None else device
    return w._like(torch.empty_like(w.qdata, device=device), torch.empty_like(w.scale, device=device), dtype)


def _copy_(dst: FP8Weight, src: torch.Tensor, non_blocking: bool = False) -> FP8Weight:
    """Another FP8 weight's bytes and scales as they are; high-precision values re-quantized (edits.py); an FP8
    weight copied into a plain tensor gives it the dequantized values (Hugging Face's resize_token_embeddings copies
    a converted lm_head's rows into a new nn.Linear: ``new.weight.data[:n] = old.weight.data[:n]``)."""
    if not isinstance(dst, FP8Weight):
        return dst.copy_(src.dequantize(dst.dtype if dst.dtype.is_floating_point else None), non_blocking)
    if not isinstance(src, FP8Weight):
        edit(dst, lambda high: high.copy_(src), "copy_ of high-precision values")
        return dst
    if src.block != dst.block:
        raise RuntimeError(f"dbr_quant: FP8 weight block mismatch: {src.block} into {dst.block}")
    if src.qdata.shape != dst.qdata.shape or src.scale.shape != dst.scale.shape:
        raise RuntimeError(f"dbr_quant: FP8 weight shape/scale mismatch: {list(src.qdata.shape)} "
                           f"{list(src.scale.shape)} into {list(dst.qdata.shape)} {list(dst.scale.shape)}")
    dst.qdata.copy_(src.qdata, non_blocking)
    dst.scale.copy_(src.scale, non_blocking)
    return dst


def _transpose(w: FP8Weight, dim0: int = 0, dim1: int = 1) -> FP8Weight | None:
    """``w.t()`` / ``.mT`` / ``.T`` of a 2-D weight: the same bytes in the other orientation (an activation ×
    parameter matmul ``x @ A.t()`` reads A this way: dbr_quant runs it as a linear on A's FP8 rows)."""
    if w.dim() != 2:
        return None
    if dim0 % 2 == dim1 % 2:
        return w._like()
    return FP8Weight(w.qdata, w.scale, w.dtype, not w.transposed, w.block)


def _rows(w: FP8Weight, start: int, stop: int) -> FP8Weight | None:
    """Output rows [start, stop) of a 2-D [out, in] weight, as an FP8 weight on the same bytes: a per-channel
    (or per-tensor) quantized row slice is the quantization of that slice. None where the slice cuts a scale
    in two (a block row, a transposed weight's input dimension): the caller then dequantizes."""
    if w.dim() != 2 or w.transposed:
        return None
    n = w.qdata.shape[0]
    start, stop = max(0, min(start, n)), max(0, min(stop, n))
    if w.block is None:
        scale = w.scale[start:stop] if w.scale.dim() else w.scale
    elif start % w.block[0] == 0 and (stop % w.block[0] == 0 or stop == n):
        scale = w.scale[start // w.block[0]:-(-stop // w.block[0])]
    else:
        return None
    return FP8Weight(w.qdata[start:stop], scale, w.dtype, False, w.block)


def _split(w: FP8Weight, sizes: Any, dim: int = 0) -> list[FP8Weight] | None:
    n = w.shape[dim] if w.dim() else 0
    if dim % max(w.dim(), 1) != 0:
        return None
    sizes = [sizes] * -(-n // sizes) if isinstance(sizes, int) else list(sizes)
    out, start = [], 0
    for size in sizes:
        part = _rows(w, start, min(start + size, n))
        if part is None:
            return None
        out.append(part)
        start += size
    return out


def _slice(w: FP8Weight, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1):
    if step != 1 or dim % max(w.dim(), 1) != 0:
        return None
    n = w.shape[0]
    start = 0 if start is None else start + n if start < 0 else start
    end = n if end is None else end + n if end < 0 else end
    return _rows(w, start, end)


def _select(w: FP8Weight, dim: int, index: int) -> FP8Weight | None:
    """``experts[e]`` of stacked 3-D expert weights [E, N, K] (transformers' eager experts loop reads
    ``gate_up_proj[expert_idx]``): that expert's bytes and scales as a 2-D FP8 weight, not the whole stack
    dequantized for one expert (load_pretrained's trace of an MoE checkpoint). A [1] per-expert scale becomes the
    0-d per-tensor scale (for a one-row expert the per-channel scale is that same number)."""
    if w.dim() != 3 or dim % 3 != 0:
        return None
    scale = w.scale[index]
    if w.block is None and scale.dim() == 1 and scale.shape[0] == 1:
        scale = scale.reshape(())
    return FP8Weight(w.qdata[index], scale, w.dtype, w.transposed, w.block)


# view ops that keep an FP8 weight FP8 (None from a handler: not expressible, fall back to the dequantized values)
_VIEWS = {
    aten.select.int: _select,
    aten.t.default: _transpose,
    aten.transpose.int: _transpose,
    aten.permute.default: lambda w, dims: _transpose(w, *dims) if len(dims) == 2 else None,  # .T
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.slice.Tensor: _slice,
}


def _chunked_product(w: FP8Weight, product: Callable[[torch.Tensor, int, int], torch.Tensor]) -> torch.Tensor | None:
    """``product(rows)`` for each chunk of the FP8 rows of a large 2-D weight ``w`` used as a matmul's ``[in, out]``
    operand (``F.linear``'s ``x @ W.t()``): each chunk's output columns ``product(dequantized rows)`` written into one
    output, so the dequantized weight is never whole (load_pretrained's trace, any F.linear outside the runtime:
    peak = the output + one chunk, not the weight in high precision). None where one pass is used: a small weight,
    a graph being traced, a block row the chunk would cut (``_rows``)."""
    q = w.qdata
    if (q.dim() != 2 or not w.transposed or q.numel() <= MATMUL_CHUNK or kernels.graph_ops() is not None
            or is_fake(q)):
        return None
    rows = FP8Weight(q, w.scale, w.dtype, False, w.block)
    step = max(1, MATMUL_CHUNK // q.shape[1])
    if w.block is not None:
        step = max(1, step // w.block[0]) * w.block[0]
    out: torch.Tensor | None = None
    for start in range(0, q.shape[0], step):
        part = _rows(rows, start, start + step)
        if part is None:
            return None
        y = product(part.dequantize().t(), start, start + step)
        if out is None:
            out = y.new_empty((*y.shape[:-1], q.shape[0]))
        out[..., start:start + y.shape[-1]] = y
    return out


def _weight_operand(b: Any, *others: Any) -> FP8Weight | None:
    """``b`` when it is the only FP8 weight of a matmul (the activation × weight product of ``F.linear``)."""
    return b if isinstance(b, FP8Weight) and not any(isinstance(t, FP8Weight) for t in others) else None


def _mm(a: torch.Tensor, b: Any) -> torch.Tensor:
    w = _weight_operand(b, a)
    out = None if w is None else _chunked_product(w, lambda rows, start, stop: torch.mm(a, rows))
    return out if out is not None else _dequantized(aten.mm.default, (a, b), {})


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: Any, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    def product(rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        columns = bias if bias.dim() == 0 or bias.shape[-1] == 1 else bias[..., start:stop]
        return torch.addmm(columns, a, rows, beta=beta, alpha=alpha)

    w = _weight_operand(b, a, bias)
    out = None if w is None else _chunked_product(w, product)
    return out if out is not None else _dequantized(aten.addmm.default, (bias, a, b), {"beta": beta, "alpha": alpha})


def _dequantized(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on the dequantized high-precision values of every FP8 weight among its arguments. A transposed
    weight (GPT-2's Conv1D, ``w.t()`` in F.linear) dequantizes to a transposed view of its [out, in] bytes, which
    a matmul reads as it is; ``view`` gets the layout the weight reports (contiguous): ``view(-1)``
    (``parameters_to_vector``) raised on the transposed view where the fp32 weight works."""
    def unwrap(t: Any) -> Any:
        if not isinstance(t, FP8Weight):
            return t
        values = t.dequantize()
        return values.contiguous() if func is aten.view.default and values.stride() != t.stride() else values

    return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


_HANDLERS = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.detach.default: lambda w: w._like(),
    aten.alias.default: lambda w: w._like(),
    aten.clone.default: lambda w, memory_format=None: w._like(w.qdata.clone(), w.scale.clone()),
    aten._to_copy.default: _to_copy,
    aten.empty_like.default: _empty_like,
    aten.copy_.default: _copy_,
    aten.is_same_size.default: lambda a, b: a.shape == b.shape,
}


# ---------------------------------------------------------------------- modules
def fp8_weight_of(module: nn.Module) -> FP8Weight | None:
    """The module's FP8 weight when convert stored one, else None (the hot path: one dict lookup)."""
    w = module._parameters.get("weight")
    return w if type(w) is FP8Weight else None


def displaced_fp8_weight(module: nn.Module) -> str | None:
    """The name under which a linear module now holds its FP8 weight when that is no longer its own ``weight``
    parameter, else None: ``torch.nn.utils.prune`` moves it to ``weight_orig`` and sets ``weight = weight_orig *
    mask`` (dequantized) before each forward; ``parametrize.register_parametrization`` moves it to
    ``parametrizations.weight.original`` and computes ``weight`` per call."""
    if "weight" in module._parameters:
        return None
    return next((name for name, p in module.named_parameters() if type(p) is FP8Weight), None)


def attach_fp8_weight(module: nn.Module, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      transposed: bool = False, block: tuple[int, int] | None = None, name: str = "weight", *,
                      qconfig: TensorQConfig | None = None) -> None:
    """Make ``module.<name>`` (``weight`` unless a functional linear reads another parameter, e.g. an attention's
    ``in_proj_weight``) an FP8 weight; its state_dict entries become ``<name>`` (FP8) + ``<name>_scale`` (2-d
    [⌈out/bn⌉, ⌈in/bk⌉] for a block-scaled weight, as compressed-tensors FP8_BLOCK stores it). ``qconfig``: the
    weight config it was quantized with (an in-place edit re-quantizes with it)."""
    module._parameters[name] = nn.Parameter(FP8Weight(qdata, scale, dtype, transposed, block, qconfig=qconfig),
                                            requires_grad=False)
    if _state_dict_hook not in module._state_dict_hooks.values():  # registered together, once per module
        module._register_state_dict_hook(_state_dict_hook)
        module._register_load_state_dict_pre_hook(_load_hook, with_module=True)


def _fp8_parameters(module: nn.Module) -> list[tuple[str, FP8Weight]]:
    return [(name, cast(FP8Weight, w)) for name, w in module._parameters.items() if type(w) is FP8Weight]


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    for name, w in _fp8_parameters(module):
        q, s = w.qdata, w.scale
        if q.untyped_storage().nbytes() != q.numel() * q.element_size():
            q, s = q.clone(), s.clone()  # rows of a stacked [gate; up] buffer: safetensors refuses shared storage
        state_dict[prefix + name] = q
        state_dict[prefix + name + "_scale"] = s


def _load_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """``weight`` (FP8) + ``weight_scale`` from a checkpoint become one FP8Weight, which the stock loader
    then copies into the module's weight in place (a stacked [gate; up] buffer stays shared)."""
    for name, w in _fp8_parameters(module):
        key = prefix + name
        if key not in state_dict or isinstance(state_dict[key], FP8Weight):
            continue
        q, s = state_dict[key], state_dict.pop(key + "_scale", None)
        if s is None:
            missing.append(key + "_scale")
            del state_dict[key]
            continue
        if q.dtype != w.qdata.dtype or q.shape != w.qdata.shape or s.shape != w.scale.shape:
            errors.append(f"{key}: the checkpoint holds {q.dtype} {list(q.shape)} with scale {list(s.shape)}, "
                          f"the converted model {w.qdata.dtype} {list(w.qdata.shape)} with scale "
                          f"{list(w.scale.shape)}; convert the model with the same QConfig before loading")
            del state_dict[key]
            continue
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
        for t in (t for _, w in _fp8_parameters(m) for t in (w.qdata, w.scale)):
            key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total
