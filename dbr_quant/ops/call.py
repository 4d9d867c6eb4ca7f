"""What an executor is given: the intercepted call (``Call``), the record of its op (``OpRecord``), the state
that holds its scales (``OpState``) and the run it executes in (``Env``).

The protocols say what ops/ reads of objects that higher layers make (ops.state's ``SeenOp`` and
``AutoQuantizationState``, a run of runtime/runs.py or moe/), so ops/ never imports those layers.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from dbr_quant import kernels
from dbr_quant.ops.mappings import LINEAR, linear_bias, linear_weight
from dbr_quant.qconfig import OpQConfig
from dbr_quant.quantize.weights import fp8_weight_of


class OpRecord(Protocol):
    """A recorded op as executors read it (``ops.state.SeenOp``)."""

    @property
    def index(self) -> int: ...  # its position in its module's forward (names its scales)

    @property
    def kind(self) -> str: ...

    @property
    def fqn(self) -> str: ...  # names it in messages

    @property
    def qconfig(self) -> OpQConfig: ...

    @property
    def quantize(self) -> bool: ...  # False: it runs as written

    @property
    def weight_owner(self) -> str | None: ...  # the linear module holding its weight (inspect names layers by it)


class OpState(Protocol):
    """The record holder of an op's module (``ops.state.AutoQuantizationState``): its activation scales."""

    @property
    def converted(self) -> bool: ...  # whether scales are frozen (else observers give them)

    def frozen_scale(self, op: OpRecord, slot: str) -> torch.Tensor: ...

    def observed_scale(self, op: OpRecord, slot: str) -> torch.Tensor: ...


class Call:
    """One intercepted call as it arrived at run time. Created per intercepted op: ``__slots__`` and a plain
    ``__init__`` make it cheap to build and read."""

    __slots__ = ("kind", "func", "args", "kwargs", "op", "state", "placeholder", "module")

    def __init__(self, kind: str, func: Any, args: tuple, kwargs: dict, op: OpRecord | None = None,
                 state: OpState | None = None, placeholder: torch.Tensor | None = None) -> None:
        self.kind = kind
        self.func = func  # the torch function, or the module for module calls
        self.args = args
        self.kwargs = kwargs
        self.op = op  # None: the trace never saw it here, it runs as written
        self.state = state
        self.placeholder = placeholder  # what this call returned while its subgraph was still pending
        self.module: nn.Module | None = func if isinstance(func, nn.Module) else None

    def __repr__(self) -> str:
        return f"Call({self.kind}, {self.func!r}, op={self.op!r})"

    def run_original(self, args: tuple | None = None, kwargs: dict | None = None) -> Any:
        """The high-precision op as the user wrote it (FP8 weights dequantized)."""
        args = self.args if args is None else args
        kwargs = self.kwargs if kwargs is None else kwargs
        m = self.module
        if m is None:
            return self.func(*args, **kwargs)
        if self.kind == LINEAR:
            return torch.nn.functional.linear(args[0], *linear_hp_weight(m))
        return type(m).forward(m, *args, **kwargs)  # a recognised norm module's own body


def linear_hp_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of an nn.Linear in high precision (dequantized when stored in FP8), as (N×K)."""
    w = fp8_weight_of(module)
    if w is None:
        return linear_weight(module), linear_bias(module)
    return kernels.dequantize(w.qdata, w.elementwise_scale(), w.dtype), linear_bias(module)


def not_float_activation(op: OpRecord, slot: str, x: torch.Tensor, calibrating: bool = False) -> TypeError:
    """An integer or bool activation reached an FP8 op: its kernels would compute in float and cast the result back
    to ``x.dtype``, truncating it silently, and an observer cannot say whose data it refuses (the high-precision op
    raises on the dtype mismatch instead)."""
    return TypeError(f"dbr_quant: {op.kind} '{op.fqn}' got a {x.dtype} '{slot}' activation of shape "
                     f"{tuple(x.shape)}{' while calibrating' if calibrating else ''}; FP8 ops take floating-point "
                     "activations. Cast the input to the model's dtype (float32, bfloat16, float16).")


class Env(Protocol):
    """The run an executor runs in (runtime/runs.py, moe/): it hands out activation scales."""

    def input_scale(self, call: Call, slot: str, x: torch.Tensor | None) -> torch.Tensor:
        """The scale for an activation; ``x`` may be None for static scales (needed when dynamic)."""
        ...
