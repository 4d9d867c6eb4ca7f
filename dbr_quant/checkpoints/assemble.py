"""A converted model built from a checkpoint without its high-precision weights (``load_pretrained``).

Peak memory: the FP8 model plus about one layer.

1. :class:`Skeleton`: a structural copy of the given architecture whose parameters and persistent buffers are
   meta placeholders (no memory). The given model is neither copied nor modified; tied tensors share one
   placeholder, as they share one tensor in the model.
2. The loaders (``load.py``, ``foreign.py``) put every tensor of the folder in place: an FP8 weight directly
   as an ``FP8Weight`` parameter, everything else as read. No high-precision copy of an FP8 weight is made.
3. :func:`trace`: prepare()'s trace on that model. A linear holding an ``FP8Weight`` runs (outside the
   runtime) on its dequantized values, one layer at a time, freed after the call. The trace records the
   ops, the fusions and the per-op decisions; ``load.py`` checks them against ``dbr_quant.json``.
4. :func:`finish_convert`: convert's steps that need no data: the activation scales come from the folder
   (no calibration forward), FP8 weights are already there (nothing to quantize), gate/up are stacked as
   convert stacks them.

Why a trace on the FP8 model rather than on the meta device: the trace follows the model's data-dependent
control flow (MoE routing, masks built with ``.item()`` / ``nonzero``) and checks values (an RMSNorm module
heads a fused subgraph only if it computes ``F.rms_norm``); meta tensors have no values. Why not rebuild the
per-module states from ``dbr_quant.json`` alone: the runtime's records hold more than the file (which module
owns each state, the dataflow ids the fusions were matched on, the parameters functional linears read, MoE
specs), all of which the trace produces, and the trace is what proves the given architecture is the saved one.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from dbr_quant.api import prepare
from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.layout import model_modules, own_tensors
from dbr_quant.moe.weights import quantize_expert_weights
from dbr_quant.ops.gate_up import stack_gate_up_weights
from dbr_quant.ops.state import AutoQuantizationState, SeenOp, observer_key
from dbr_quant.qconfig import QConfig
from dbr_quant.quantize.weights import attach_fp8_weight
from dbr_quant.runtime.param_weights import quantize_param_weights

QUIET = r"dbr_quant\.(prepare|convert)\(\): "  # the reload repeats warnings the user saw at convert time


def check_scale(name: str, t: torch.Tensor) -> None:
    t = t.double()
    ok = torch.isfinite(t) & (t > 0)
    if not bool(ok.all()):
        raise CheckpointError(f"{name}: a scale must be a positive finite number, the checkpoint holds "
                              f"{t[~ok][:3].tolist()}")


NAN_CHECK_CHUNK = 1 << 20  # bytes of an FP8 weight checked at a time (the check's temporaries, not the weight's)


def check_fp8_weight(name: str, q: torch.Tensor) -> None:
    """No NaN code (0x7f / 0xff) in an E4M3 weight, checked a chunk at a time: the load's peak memory is the FP8
    model plus small temporaries, not two weight-sized byte masks of the largest weight."""
    codes = q.reshape(-1).view(torch.uint8)
    for start in range(0, codes.numel(), NAN_CHECK_CHUNK):
        if bool(((codes[start:start + NAN_CHECK_CHUNK] & 0x7F) == 0x7F).any()):
            raise CheckpointError(f"{name}: the FP8 weight holds NaN bytes (0x7f/0xff)")


def example_args(example_inputs: Any, example_kwargs: dict[str, Any] | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """load_pretrained's ``example_inputs`` / ``example_kwargs`` as prepare()'s (args, kwargs)."""
    if isinstance(example_inputs, tuple):
        return example_inputs, dict(example_kwargs or {})
    return (() if example_inputs is None else (example_inputs,)), dict(example_kwargs or {})


@dataclass
class _Slot:
    """One tensor of the architecture (all the names tied to it): where it goes and whether it is there."""

    placeholder: torch.Tensor
    device: torch.device
    sites: list[tuple[nn.Module, str]] = field(default_factory=list)  # (module, attribute) holding it
    filled: bool = False


class Skeleton:
    """The given architecture with meta placeholders for its parameters and persistent buffers (non-persistent
    buffers, e.g. rotary tables, are copied: no checkpoint holds them). Each placed tensor goes to the device
    of the given model's tensor (CPU for a model on the meta device)."""

    def __init__(self, model: nn.Module) -> None:
        memo: dict[int, Any] = {}
        devices: dict[int, torch.device] = {}
        for mod in model.modules():
            for _, t in own_tensors(mod):
                if id(t) in memo:
                    continue
                ph = torch.empty(t.shape, dtype=t.dtype, device="meta")
                memo[id(t)] = nn.Parameter(ph, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else ph
                devices[id(memo[id(t)])] = torch.device("cpu") if t.is_meta else t.device
        self.model: nn.Module = copy.deepcopy(model, memo)
        self.slots: dict[str, _Slot] = {}
        by_placeholder: dict[int, _Slot] = {}
        for fqn, mod in model_modules(self.model):
            for pname, t in own_tensors(mod):
                slot = by_placeholder.get(id(t))
                if slot is None:
                    slot = by_placeholder[id(t)] = _Slot(t, devices[id(t)])
                slot.sites.append((mod, pname))
                self.slots[f"{fqn}.{pname}" if fqn else pname] = slot

    def put(self, name: str, value: torch.Tensor) -> None:
        """The tensor ``name`` and every tensor tied to it become ``value`` (once: a tied name is then done)."""
        slot = self.slots[name]
        if slot.filled:
            return
        ph, v = slot.placeholder, value.to(slot.device)
        for mod, attr in slot.sites:
            if isinstance(ph, nn.Parameter):
                v = v if isinstance(v, nn.Parameter) else nn.Parameter(v, requires_grad=ph.requires_grad)
                mod._parameters[attr] = v  # one Parameter for every tied site
            else:
                mod._buffers[attr] = v
        slot.filled = True

    def put_fp8(self, name: str, qdata: torch.Tensor, scale: torch.Tensor, transposed: bool,
                block: tuple[int, int] | None) -> None:
        """The parameter ``name`` becomes an FP8 weight (its module's alone: a tensor tied to it stays to be
        placed from its own entry, as convert unties an FP8 weight from its high-precision twin)."""
        slot = self.slots[name]
        fqn, _, pname = name.rpartition(".")
        module = self.model.get_submodule(fqn)
        attach_fp8_weight(module, qdata.contiguous().to(slot.device), scale.to(slot.device), slot.placeholder.dtype,
                          transposed, block, name=pname)
        slot.sites = [(m, a) for m, a in slot.sites if not (m is module and a == pname)]
        slot.filled = not slot.sites

    def check_complete(self) -> None:
        """Every tensor placed and none left on the meta device (a non-persistent buffer of a model built on
        the meta device has no value anywhere)."""
        missing = sorted(n for n, slot in self.slots.items() if not slot.filled)
        if missing:
            raise CheckpointError(f"{missing[0]}: the checkpoint has no value for it ({len(missing)} such tensor(s))")
        for fqn, mod in model_modules(self.model):
            for name, t in [*mod._parameters.items(), *mod._buffers.items()]:
                if t is not None and t.is_meta:
                    raise CheckpointError(
                        f"{fqn + '.' if fqn else ''}{name}: on the meta device and not in the checkpoint (a "
                        "non-persistent buffer such as a rotary table is computed when the model is built); build "
                        "the architecture on a real device, or load it with that buffer materialized")


def on_model_device(model: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Example inputs the loader made (read from the folder, or a default ``input_ids``: CPU tensors) moved to the
    device of the assembled model's first parameter, so a model loaded onto a GPU traces there."""
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))


def trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], qconfig: QConfig) -> nn.Module:
    """prepare() in place on the assembled model (its warnings were shown when the model was converted)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=QUIET)
        return prepare(model, args, qconfig, example_kwargs=kwargs, inplace=True)


ScaleSource = Callable[[AutoQuantizationState, SeenOp, str], "torch.Tensor | None"]


def _device_of(owner: nn.Module, model: nn.Module) -> torch.device:
    """Where a state's scales go: the device of its module's parameters (the state's own observers never saw
    data here, so they are still on the CPU), else the model's, else the CPU."""
    for m in (owner, model):
        p = next((p for p in m.parameters() if p.device.type != "meta"), None)
        if p is not None:
            return p.device
    return torch.device("cpu")


@torch.no_grad()
def finish_convert(prepared: nn.Module, scale_of: ScaleSource) -> nn.Module:
    """convert() for a prepared model whose FP8 weights are in place: every static activation scale from
    ``scale_of(state, op, slot)`` (None: the folder has none, an error), weights of functional linears and of
    MoE experts that are still high precision quantized as convert does, gate/up stacked."""
    record = prepared.__dict__["_dbr_record"]
    for st in record.states:
        device = _device_of(prepared.get_submodule(st.fqn), prepared)
        scales: dict[str, torch.Tensor] = {}
        for op in st.seen_ops:
            if not op.quantize or op.qconfig.dynamic:
                continue
            for slot in op.slots:
                s = scale_of(st, op, slot)
                if s is None:
                    raise CheckpointError(f"'{op.fqn}' ({op.kind}) runs in FP8 with a static '{slot}' scale, but the "
                                          "checkpoint holds none for it; load with dynamic activations or keep this "
                                          "op in high precision")
                scales[f"scale_{observer_key(op.index, slot)}"] = s.to(device)
        st.load_state_dict(scales, strict=False)  # the state's own loader registers the scale buffers
        st.converted = True
    quantize_param_weights(prepared, [op for st in record.states for op in st.seen_ops])
    quantize_expert_weights(prepared, record)
    stack_gate_up_weights(prepared, record.states)
    record.phase = "converted"
    return prepared
