"""The 3-D weights of MoE experts modules in FP8 (``convert``), and their state_dict form.

Each quantized experts module's parameters (``gate_up_proj`` / ``up_proj``, ``down_proj``) become an
``FP8Weight`` parameter: ``qdata`` [E, N, K] (transposed once when the module stores [E, in, out]), one
fp32 scale per expert and output channel (weight granularity "channel"), per expert ("tensor", [E, 1]) or
per expert and (bn × bk) block ("block", [E, ⌈N/bn⌉, ⌈K/bk⌉]; a stacked [gate; up] weight is blocked half by
half as gate_proj and up_proj are in block-scaled checkpoints, which is the same as blocking it whole since
``moe`` takes block-scaled gated experts only when bn divides the intermediate size I).
It reports the original dtype and shape, so model code reading ``experts.gate_up_proj`` keeps working and
``Module.to(dtype)`` changes the compute dtype only. In ``state_dict()`` a parameter is two entries:
``<name>`` (FP8) and ``<name>_scale`` (fp32).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from dbr_quant.moe.experts import MoeState, experts_spec
from dbr_quant.ops.tags import experts_of
from dbr_quant.qconfig import TensorQConfig
from dbr_quant.quantize.weight_quantization import quantize_weight
from dbr_quant.quantize.weights import FP8Weight, attach_fp8_weight


class StatesRecord(Protocol):
    """What convert passes: the model record (``runtime.runs.ModelRecord``) with every module's state."""

    @property
    def states(self) -> Sequence[object]: ...


def expert_parameter(module: nn.Module, name: str) -> torch.Tensor:
    """An experts module's 3-D weight (``experts_spec`` names only parameters the module has)."""
    w = module._parameters[name]
    if w is None:
        raise ValueError(f"dbr_quant: the experts module {type(module).__name__} has no parameter {name!r}")
    return w


def quantize_expert_weights(model: nn.Module, record: StatesRecord) -> None:
    """``convert``: each quantized experts module's 3-D weights become FP8 with one scale per expert and
    output channel (weight granularity "channel"; "tensor" = one per expert)."""
    for st in record.states:
        if not isinstance(st, MoeState) or not st.quantized:
            continue
        module = model.get_submodule(st.fqn)
        for op, name in zip(st.seen_ops, st.spec.names):
            w = expert_parameter(module, name).detach()
            if type(w) is FP8Weight:
                continue
            if not torch.isfinite(w).all():
                raise ValueError(f"convert(): the expert weight '{op.fqn}' has NaN/inf values; fix the weights or "
                                 f"skip it with QConfig(overrides=(Override(pattern=..., skip=True),))")
            w3 = w.transpose(-2, -1).contiguous() if st.spec.transposed else w  # [E, N, K]
            cfg = op.qconfig.weight
            quantized = quantize_weight(w3, cfg)
            attach_fp8_param(module, name, quantized.qdata, quantized.scale, w.dtype, st.spec.transposed,
                             quantized.block, qconfig=cfg)


def attach_fp8_param(module: nn.Module, name: str, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     transposed: bool, block: tuple[int, int] | None = None, *,
                     qconfig: TensorQConfig | None = None) -> None:
    """``module.<name>`` becomes an FP8Weight parameter: :func:`weights.attach_fp8_weight` (state_dict entries
    ``<name>`` (FP8) and ``<name>_scale`` (fp32), loaded back by its hooks)."""
    attach_fp8_weight(module, qdata, scale, dtype, transposed, block, name=name, qconfig=qconfig)


def expert_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the 3-D expert weights now — FP8 data + scales, or high precision —, number of them)."""
    total = count = 0
    for mod in model.modules():
        spec = experts_of(mod) or experts_spec(mod)
        if spec is None:
            continue
        for name in spec.names:
            w = expert_parameter(mod, name)
            total += w.stored_bytes() if type(w) is FP8Weight else w.numel() * w.element_size()
            count += 1
    return total, count
