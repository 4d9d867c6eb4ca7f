"""Typed, frozen configuration: what format, observer and granularity each tensor gets.

Per-module overrides are an ordered tuple: the first ``Override`` that matches an op wins and its
unset (None) fields fall back to the global config. No string-keyed dicts, no precedence tables.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from .formats import FP8Format
from .observers import ObserverConfig, RunningMax

Granularity = Literal["tensor", "channel", "token"]


@dataclass(frozen=True)
class TensorQConfig:
    """How one kind of tensor (activations or weights) is quantized.

    granularity: "tensor" (one scale), "channel" (weights: one per output channel) or "token"
    (activations, dynamic only: one per row of the last dimension).
    """

    format: FP8Format = FP8Format.E4M3
    observer: ObserverConfig = field(default_factory=RunningMax)
    granularity: Granularity = "tensor"

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", FP8Format.parse(self.format))
        if self.granularity not in ("tensor", "channel", "token"):
            raise ValueError(f"granularity must be 'tensor', 'channel' or 'token', not {self.granularity!r}")


@dataclass(frozen=True)
class Override:
    """Per-module settings. ``pattern`` is a regex matched (re.search) against the op's fqn (for a
    module call, the module's name, e.g. ``encoder.layer.0.output.dense``; for a functional op,
    ``<parent fqn>.<op>_<k>``); ``module_type`` matches the op's module or any module enclosing it.
    """

    pattern: str | None = None
    module_type: type[nn.Module] | tuple[type[nn.Module], ...] | None = None
    skip: bool = False
    activation: TensorQConfig | None = None
    weight: TensorQConfig | None = None
    dynamic: bool | None = None

    def __post_init__(self) -> None:
        if self.pattern is None and self.module_type is None:
            raise ValueError("Override needs a pattern (fqn regex) or a module_type")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"Override pattern {self.pattern!r} is not a valid regex: {e}") from None

    def matches(self, fqn: str, enclosing_types: tuple[type, ...]) -> bool:
        if self.pattern is not None and re.search(self.pattern, fqn) is None:
            return False
        if self.module_type is not None and not any(issubclass(t, self.module_type) for t in enclosing_types):
            return False
        return True


@dataclass(frozen=True)
class QConfig:
    """Global quantization settings.

    activation / weight: per-tensor E4M3 activations with a running-max observer and per-channel
    E4M3 weights by default. dynamic: compute activation scales at run time (no calibration).
    strict: raise instead of warning when a later forward runs an op the trace never saw.
    fuse: bind recorded subgraphs to fused kernels (False runs every op on its own).
    quantize_attention: also run attention in FP8 — scaled_dot_product_attention and matmul/bmm
    between two activations (q·kᵀ, p·v). Off by default, as in Transformer Engine (fp8_dpa): softmax
    amplifies the rounding of q·kᵀ (all-MiniLM-L6-v2: embedding cosine 0.9975 → 0.9970 with it on).
    """

    activation: TensorQConfig = field(default_factory=TensorQConfig)
    weight: TensorQConfig = field(default_factory=lambda: TensorQConfig(granularity="channel"))
    dynamic: bool = False
    strict: bool = False
    fuse: bool = True
    quantize_attention: bool = False
    overrides: tuple[Override, ...] = ()

    def __post_init__(self) -> None:
        if self.weight.granularity == "token":
            raise ValueError("weights take granularity 'tensor' or 'channel', not 'token'")
        if self.activation.granularity == "channel":
            raise ValueError("activations take granularity 'tensor' or 'token' (token needs dynamic=True)")
        if self.activation.granularity == "token" and not self.dynamic:
            raise ValueError("per-token activation scales are computed at run time: set dynamic=True")
        object.__setattr__(self, "overrides", tuple(self.overrides))

    def for_op(self, fqn: str, enclosing_types: tuple[type, ...]) -> OpQConfig:
        """Resolve the settings for one op: first matching override, unset fields from self."""
        for ov in self.overrides:
            if ov.matches(fqn, enclosing_types):
                return OpQConfig(
                    skip=ov.skip,
                    activation=ov.activation or self.activation,
                    weight=ov.weight or self.weight,
                    dynamic=self.dynamic if ov.dynamic is None else ov.dynamic,
                )
        return OpQConfig(skip=False, activation=self.activation, weight=self.weight, dynamic=self.dynamic)


@dataclass(frozen=True)
class OpQConfig:
    """The resolved settings of one recorded op."""

    skip: bool
    activation: TensorQConfig
    weight: TensorQConfig
    dynamic: bool

