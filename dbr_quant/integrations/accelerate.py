"""Models dispatched by Hugging Face accelerate: ``cpu_offload``, ``disk_offload``, ``dispatch_model``.

accelerate wraps a module's ``forward``: ``module._hf_hook`` plus an instance ``forward`` that runs
``hook.pre_forward``, the original forward, ``hook.post_forward``. Its device hooks (``AlignDevicesHook``,
``CpuOffload``, chained in a ``SequentialHook``) only move tensors: before the forward they move the inputs
to the execution device and, for an offloaded module, load its weights from ``hook.weights_map`` (a CPU
state dict, or memory-mapped ``.dat`` files in the offload folder); afterwards they put them back on
``meta``. dbr_quant treats them as transparent:

* They do not block fusions (they are not forward hooks). Any other ``_hf_hook`` can change inputs and
  outputs, so ``has_opaque_hook`` makes it count as a hook, like ``register_forward_hook``.
* When a converted model computes a linear (or a recognised norm) itself rather than through the module's
  forward, ``onload`` runs the hook's pre_forward; the run keeps the weights until the fused subgraph using
  them has run, then ``offload`` runs its post_forward (``convert_run.ConvertRun``).
* ``convert`` quantizes each weight where accelerate keeps it (``weight_home``): an offloaded weight is read
  from the weights map, quantized, and written back in FP8 (data and scales as two entries; on disk as
  accelerate's own ``.dat`` files in a ``dbr_fp8_<id>/`` folder inside the offload folder, the fp32 files
  are left alone), while the module keeps a ``meta`` FP8Weight. The hook's weights map then hands
  accelerate an ``FP8Weight``, which it loads like any parameter.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from dbr_quant.quantize.weights import FP8Weight

_TRANSPARENT = {"AlignDevicesHook", "CpuOffload", "SequentialHook"}


def _hooks(hook: Any) -> list[Any]:
    """The hooks of a (possibly chained) accelerate hook, flattened."""
    if hook is None:
        return []
    return [h for inner in hook.hooks for h in _hooks(inner)] if type(hook).__name__ == "SequentialHook" else [hook]


def _is_transparent(hook: Any) -> bool:
    return type(hook).__module__.startswith("accelerate.") and type(hook).__name__ in _TRANSPARENT


def has_device_hook(module: nn.Module) -> bool:
    """The module's forward is wrapped by accelerate (device moves, offloading, or anything else)."""
    return module.__dict__.get("_hf_hook") is not None


def has_opaque_hook(module: nn.Module) -> bool:
    """An accelerate hook that may do more than move tensors: it must see the module's real call."""
    hook = module.__dict__.get("_hf_hook")
    return hook is not None and not all(_is_transparent(h) for h in _hooks(hook))


def onload(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Run the module's accelerate pre_forward (weights onto the execution device, inputs too) without the
    forward; ``offload`` undoes it. The hooks' record of the caller's device (``io_same_device``) is kept."""
    hook = module.__dict__["_hf_hook"]
    saved = [(h, h.input_device) for h in _hooks(hook) if hasattr(h, "input_device")]
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    for h, device in saved:
        h.input_device = device
    return args, kwargs


def offload(module: nn.Module) -> None:
    """Run the module's accelerate post_forward: an offloaded module's weights go back to ``meta``."""
    module.__dict__["_hf_hook"].post_forward(module, None)


class onloaded:  # noqa: N801  (a context manager, used like a function)
    """``with onloaded(module):`` the module's weights are real (no-op for a module without a device hook)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module if has_device_hook(module) and not has_opaque_hook(module) else None

    def __enter__(self) -> None:
        if self.module is not None:
            onload(self.module, (), {})

    def __exit__(self, *exc: Any) -> None:
        if self.module is not None:
            offload(self.module)


# ---------------------------------------------------------------------- convert: where a weight lives
@dataclass
class WeightHome:
    """An offloaded weight: the accelerate hook that loads it and its name in that hook's weights map."""

    hook: Any
    name: str
    token: str  # one per convert() call: names its FP8 files, so two conversions never share them

    def load(self) -> torch.Tensor:
        return self.hook.weights_map[self.name]

    def store(self, module: nn.Module) -> None:
        """Move the module's (just attached, real) FP8 weight into the weights map; leave ``meta`` behind."""
        w = module._parameters["weight"]
        assert type(w) is FP8Weight
        fp8 = self.hook.weights_map
        if not isinstance(fp8, FP8WeightsMap):
            fp8 = self.hook.weights_map = FP8WeightsMap(self.hook.weights_map)
        store, key = _root_store(fp8.inner, self.name)
        q_key, s_key = _write(store, key, w.qdata, w.scale, self.token)
        fp8.fp8[self.name] = (store, q_key, s_key, w.dtype, w.transposed)
        module._parameters["weight"] = nn.Parameter(w.to("meta"), requires_grad=False)


def weight_home(root: nn.Module, fqn: str, token: str) -> WeightHome | None:
    """Where accelerate keeps the weight of linear ``fqn`` when it is offloaded (``meta`` in the module): the
    module's own offloading hook, or an ancestor's that loads its submodules (``place_submodules``). ``token``:
    one per convert() call (``new_token``)."""
    module = root.get_submodule(fqn)
    weight = module._parameters.get("weight")
    if weight is None or weight.device.type != "meta":
        return None
    parts = fqn.split(".") if fqn else []
    for depth in range(len(parts), -1, -1):
        owner = root.get_submodule(".".join(parts[:depth]))
        for h in _hooks(owner.__dict__.get("_hf_hook")):
            if (type(h).__name__ == "AlignDevicesHook" and h.offload and h.weights_map is not None
                    and (owner is module or h.place_submodules)):
                return WeightHome(h, ".".join([*parts[depth:], "weight"]), token)
    raise RuntimeError(f"dbr_quant.convert(): the weight of '{fqn}' is on the meta device and no accelerate hook "
                       "loads it; load the weights (or dispatch the model with accelerate) before convert()")


def new_token() -> str:
    """Names one conversion's FP8 files in accelerate's offload folder (``WeightHome.token``)."""
    return uuid.uuid4().hex[:12]


class FP8WeightsMap(Mapping):
    """A hook's weights map in which converted weights are FP8: ``map[name]`` is an ``FP8Weight`` built from
    the data and scale entries ``WeightHome.store`` wrote; everything else comes from the original map."""

    def __init__(self, inner: Mapping) -> None:
        self.inner = inner
        self.fp8: dict[str, tuple[Any, str, str, torch.dtype, bool]] = {}

    def __getitem__(self, name: str) -> Any:
        entry = self.fp8.get(name)
        if entry is None:
            return self.inner[name]
        store, q_key, s_key, dtype, transposed = entry
        return FP8Weight(store[q_key], store[s_key], dtype, transposed)

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def _root_store(mapping: Any, key: str) -> tuple[Any, str]:
    """The storage behind accelerate's (possibly prefixed: ``PrefixedDataset``) weights map, and the key there."""
    while type(mapping).__name__ == "PrefixedDataset":
        key, mapping = mapping.prefix + key, mapping.dataset
    return mapping, key


def _write(store: Any, key: str, qdata: torch.Tensor, scale: torch.Tensor, token: str) -> tuple[str, str]:
    """Store FP8 data and scale for ``key`` and drop the high-precision entry; returns their keys."""
    if type(store).__name__ == "OffloadedWeightsLoader":
        if key in store.state_dict or store.save_folder is None:
            store.all_keys = [k for k in store.all_keys if k != key]
            store.index.pop(key, None)
            return _write(store.state_dict, key, qdata, scale, token)
        # on disk: accelerate's own format (.dat + index entry, FP8 as int8 bytes) in a folder of our own
        from accelerate.utils import offload_weight

        folder = f"dbr_fp8_{token}"
        os.makedirs(os.path.join(store.save_folder, folder), exist_ok=True)
        q_key, s_key = f"{folder}/{key}", f"{folder}/{key}.scale"
        for k, t in ((q_key, qdata), (s_key, scale)):
            offload_weight(t.cpu(), k, store.save_folder, index=store.index)
        store.index.pop(key, None)
        store.all_keys = [k for k in store.all_keys if k != key] + [q_key, s_key]
        return q_key, s_key
    if not isinstance(store, dict):
        raise TypeError(f"dbr_quant.convert(): cannot store an FP8 weight in accelerate's weights map of type "
                        f"{type(store).__name__}; dispatch with cpu_offload / disk_offload / dispatch_model")
    q_key, s_key = f"{key}.fp8", f"{key}.fp8_scale"
    store.pop(key, None)  # the high-precision copy is no longer needed: the memory goes back
    store[q_key], store[s_key] = qdata.cpu(), scale.cpu()
    return q_key, s_key


def fp8_special_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """``special_dtypes=`` for accelerate's ``infer_auto_device_map`` / ``get_balanced_memory`` /
    ``compute_module_sizes``: each FP8 weight's name → its storage dtype. accelerate sizes a tensor as ``numel() *
    dtype_byte_size(tensor.dtype)`` (accelerate/utils/modeling.py), and an FP8 weight reports the high-precision
    dtype it computes in, so without this a converted model is planned at 4 bytes per fp32 weight element. With
    it, one byte per element; the scales (4 bytes per row, or per block) are not counted: accelerate takes a dtype
    per tensor, not a byte count. Hugging Face's own planner (``from_pretrained(device_map=...)``,
    transformers/integrations/accelerate.py) reads ``element_size()``, which counts them."""
    return {name: cast(FP8Weight, p).qdata.dtype for name, p in model.named_parameters() if type(p) is FP8Weight}
