"""Debug features: the base class, the registry, and the five built-in features.

Modelled on Transformer Engine's debug features (``process_tensor``, ``process_quantized_tensor``,
``fp8_gemm``, ``save_stats_for_logging[_quantized]``). A feature is a frozen dataclass whose fields are
its YAML parameters; it overrides any subset of the hooks below. For each tensor of a layer
(linear: ``input``, ``weight``, ``output``; matmul: ``a``, ``b``, ``output``; sdpa: ``q``, ``k``, ``v``,
``output``) the inspector calls, in this order::

    log_tensor(ctx, x)            # the high-precision tensor as it arrives
    x = process_tensor(ctx, x)    # before quantization (for "output": after the GEMM)
    q = process_quantized(ctx, q) # after quantization (only when the layer runs in FP8)
    log_quantized(ctx, x, q)      # the quantized tensor next to its high-precision value

and once per layer call ``use_fp8(layer)`` (any ``False`` → the GEMM runs in high precision) and
``tensor_config(layer, tensor, cfg)`` (format / granularity of ``input`` and ``weight``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar, cast

import torch

from dbr_quant.formats import FP8Format
from dbr_quant.inspect.stats import FP8_STATS, TENSOR_STATS, fp8_stats, tensor_stats
from dbr_quant.kernels.reference import block as reference_block
from dbr_quant.kernels.reference.dense import head_view
from dbr_quant.kernels.reference.mx import e8m0_to_float
from dbr_quant.qconfig import Granularity, OpQConfig, TensorQConfig
from dbr_quant.quantize.weight_quantization import elementwise_block_scale

ACTIVATION_TENSORS = ("input", "a", "b", "q", "k", "v")
TENSOR_NAMES = ACTIVATION_TENSORS + ("weight", "output")


@dataclass(frozen=True)
class LayerInfo:
    """A recorded quantized op as features see it. ``name`` is the op's fqn (for nn.Linear: its module)."""

    name: str
    kind: str  # linear / matmul / sdpa
    module_type: str  # class name of the nn.Linear, or of the module whose forward calls the op
    qconfig: OpQConfig

    def quantizes(self, tensor: str) -> bool:
        """Whether FP8 execution quantizes ``tensor`` of this layer: never the output, and not the input of a
        weight-only linear or expert tensor (``QConfig.fp8_weight_only()``: the W8A16 GEMM reads it as it is). Such
        a tensor has no FP8 scale and no quantization error (no FP8 stats, FakeQuant leaves it alone)."""
        if tensor == "output":
            return False
        return not (tensor == "input" and self.kind in ("linear", "experts") and self.qconfig.weight_only)



@dataclass(frozen=True)
class Quantized:
    """An FP8 tensor and its dequantization scale: x ≈ data·scale, where ``scale`` broadcasts against data —
    or, for block-scaled weights (``block`` = (rows, columns)), is one scale per block [⌈N/bn⌉, ⌈K/bk⌉],
    and for group-scaled activations (``group``) one per token per ``group`` channels [..., ⌈K/group⌉].
    MXFP8 (``QConfig.mxfp8()``): the same layouts with block (1, 32) / group 32, the scales as uint8 E8M0 codes
    (``kernels.mx_quantize``; scale = 2^(code - 127)), what the MX GEMM reads. ``elementwise_scale()`` is the
    scale (fp32 where decoded) broadcastable against ``data`` in every case."""

    data: torch.Tensor
    scale: torch.Tensor
    format: FP8Format
    block: tuple[int, int] | None = None
    group: int | None = None

    @staticmethod
    def weight(qdata: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, block: tuple[int, int] | None = None
               ) -> Quantized:
        """An FP8 weight from its stored scale ([N] per channel, 0-d per tensor, [E, N] / [E, 1] per expert, or
        per block): the scale made broadcastable against ``data`` (a block scale stays per block)."""
        if block is not None:
            return Quantized(qdata, scale, fmt, block=block)
        scale = scale.to(qdata.device)
        return Quantized(qdata, scale.unsqueeze(-1) if scale.dim() else scale, fmt)

    def elementwise_scale(self) -> torch.Tensor:
        if self.block is not None:
            return elementwise_block_scale(self.scale, self.data.shape, self.block)
        if self.group is not None:
            scale = e8m0_to_float(self.scale) if self.scale.dtype == torch.uint8 else self.scale  # MX codes
            return reference_block.expand_group_scale(scale, self.data.shape[-1], self.group)
        return head_view(self.scale)  # an attention operand's per-head [H] scale as (H, 1, 1); others as they are

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.elementwise_scale().float()).to(dtype)


# quantize(x) with a tensor's FP8 scale; quantize(None) on a weight: the FP8 weight as stored (or as convert
# would store it)
Quantizer = Callable[[torch.Tensor | None], Quantized]



def not_quantized(layer: str, tensor: str) -> Quantizer:
    """The quantizer of a tensor FP8 execution leaves in high precision (:meth:`LayerInfo.quantizes`): a clear
    error."""
    def refuse(x: torch.Tensor | None) -> Quantized:
        raise RuntimeError(f"dbr_quant.inspect: layer {layer!r} runs weight-only FP8 (QConfig.fp8_weight_only()): "
                           f"its {tensor!r} is not quantized, so it has no FP8 scale; check "
                           "ctx.layer.quantizes(ctx.tensor) before ctx.quantize(x)")
    return refuse


@dataclass(frozen=True)
class TensorContext:
    """What a hook knows about the tensor at hand; ``log`` appends a record, ``quantize`` uses the
    layer's scale and format for this tensor (what FP8 execution would do)."""

    layer: LayerInfo
    tensor: str
    step: int
    fp8: bool  # does the layer's GEMM run in FP8
    log: Callable[[str, float], None]
    quantize: Callable[[torch.Tensor], Quantized]


class Feature:
    """Base class of debug features. Subclasses are frozen dataclasses registered with
    :func:`register_feature`; every hook is optional."""

    name: ClassVar[str] = ""

    def use_fp8(self, layer: LayerInfo) -> bool | None:
        """False: this layer's GEMM runs in high precision. None: no opinion."""
        return None

    def tensor_config(self, layer: LayerInfo, tensor: str, cfg: TensorQConfig) -> TensorQConfig:
        return cfg

    def process_tensor(self, ctx: TensorContext, x: torch.Tensor) -> torch.Tensor:
        return x

    def process_quantized(self, ctx: TensorContext, q: Quantized) -> Quantized:
        return q

    def log_tensor(self, ctx: TensorContext, x: torch.Tensor) -> None:
        return None

    def log_quantized(self, ctx: TensorContext, x: torch.Tensor, q: Quantized) -> None:
        return None

    def overrides(self, hook: str) -> bool:
        return getattr(type(self), hook) is not getattr(Feature, hook)


def feature_pass(features: Sequence[Feature], ctx: TensorContext | None, t: torch.Tensor, is_weight: bool,
                 want_q: bool, fp8: bool, quantize: Quantizer) -> tuple[torch.Tensor, Quantized | None]:
    """One input tensor of a layer through the features: log it, let them process it, and when asked
    quantize it (what FP8 would compute: a high-precision layer is measured on what FP8 would do) and let
    them process and log the quantized form. Returns (processed tensor, quantized or None). ``ctx`` may be
    None only without features."""
    if ctx is None or not features:  # nothing to log or process: only the quantized form, when asked
        return t, (quantize(None if is_weight else t) if want_q else None)
    for f in features:
        f.log_tensor(ctx, t)
    p = t
    for f in features:
        p = f.process_tensor(ctx, p)
    if not want_q:
        return p, None
    src = p if fp8 else t
    q = quantize(None) if (is_weight and src is t) else quantize(src)
    if fp8:
        for f in features:
            q = f.process_quantized(ctx, q)
    for f in features:
        f.log_quantized(ctx, src, q)
    return p, q


FEATURES: dict[str, type[Feature]] = {}
F = TypeVar("F", bound=type[Feature])


def register_feature(cls: F | None = None, *, name: str | None = None, replace: bool = False):
    """Class decorator: make a ``Feature`` subclass usable by name in inspect YAML configs.

    The class is turned into a frozen dataclass if it is not one already; its fields are the YAML
    parameters (type-checked when the config loads; ``__post_init__`` may validate further).
    """

    def wrap(c: F) -> F:
        if not (isinstance(c, type) and issubclass(c, Feature)):
            raise TypeError(f"@register_feature needs a subclass of dbr_quant.inspect.Feature, got {c!r}")
        if not dataclasses.is_dataclass(c) or "__dataclass_params__" not in c.__dict__:
            c = cast(F, dataclass(frozen=True)(c))  # the same class, made a dataclass
        key = name or c.__name__
        if key in FEATURES and not replace and FEATURES[key] is not c:
            raise ValueError(f"a feature named {key!r} is already registered ({FEATURES[key].__qualname__}); "
                             "pass replace=True to replace it")
        c.name = key
        FEATURES[key] = c
        return c

    return wrap(cls) if cls is not None else wrap


def unregister_feature(name: str) -> None:
    FEATURES.pop(name, None)


def _check_names(what: str, given: tuple[str, ...], allowed: tuple[str, ...]) -> tuple[str, ...]:
    given = tuple(given)
    bad = [g for g in given if g not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {bad}; allowed: {list(allowed)}")
    return given


@dataclass(frozen=True)
class StepRange:
    """Which steps (forwards inside the session, from 0) a logging feature acts on; end_step inclusive."""

    freq: int = 1
    start_step: int = 0
    end_step: int | None = None

    def __post_init__(self) -> None:
        if self.freq < 1 or self.start_step < 0 or (self.end_step is not None and self.end_step < self.start_step):
            raise ValueError("need freq >= 1, start_step >= 0 and end_step >= start_step (or null)")

    def active(self, step: int) -> bool:
        if step < self.start_step or (self.end_step is not None and step > self.end_step):
            return False
        return (step - self.start_step) % self.freq == 0


@register_feature
@dataclass(frozen=True)
class LogTensorStats(Feature, StepRange):
    """Log amax / min / max / mean / std of the high-precision tensors."""

    tensors: tuple[str, ...] = ("input", "weight", "output")
    stats: tuple[str, ...] = TENSOR_STATS

    def __post_init__(self) -> None:
        StepRange.__post_init__(self)
        _check_names("tensors", self.tensors, TENSOR_NAMES)
        _check_names("stats", self.stats, TENSOR_STATS)

    def log_tensor(self, ctx: TensorContext, x: torch.Tensor) -> None:
        if ctx.tensor in self.tensors and self.active(ctx.step):
            for stat, value in tensor_stats(x, self.stats).items():
                ctx.log(stat, value)


@register_feature
@dataclass(frozen=True)
class LogFP8Stats(Feature, StepRange):
    """Log underflow %, saturation %, quantization MSE, SQNR (dB) and the scale of quantized tensors.

    Layers that run in high precision (DisableFP8 / FakeQuant) are measured on what FP8 would do. A tensor the
    layer does not quantize (the input of a weight-only linear, ``LayerInfo.quantizes``) gets no FP8 stats: it
    has no quantization, which a zero error / infinite SQNR would misreport."""

    tensors: tuple[str, ...] = ("input", "weight")
    stats: tuple[str, ...] = FP8_STATS

    def __post_init__(self) -> None:
        StepRange.__post_init__(self)
        _check_names("tensors", self.tensors, ACTIVATION_TENSORS + ("weight",))
        _check_names("stats", self.stats, FP8_STATS)

    def log_quantized(self, ctx: TensorContext, x: torch.Tensor, q: Quantized) -> None:
        if ctx.tensor in self.tensors and self.active(ctx.step):
            for stat, value in fp8_stats(x, q.data, q.elementwise_scale(), q.format, self.stats).items():
                ctx.log(stat, value)


@register_feature
@dataclass(frozen=True)
class DisableFP8(Feature):
    """The selected layers run in high precision (converted models: with their dequantized FP8 weights)."""

    def use_fp8(self, layer: LayerInfo) -> bool | None:
        return False


@register_feature
@dataclass(frozen=True)
class FakeQuant(Feature):
    """Quantize-dequantize the chosen tensors with the layer's scales, then compute in high precision."""

    tensors: tuple[str, ...] = ("input", "weight")

    def __post_init__(self) -> None:
        _check_names("tensors", self.tensors, ACTIVATION_TENSORS + ("weight",))

    def use_fp8(self, layer: LayerInfo) -> bool | None:
        return False

    def process_tensor(self, ctx: TensorContext, x: torch.Tensor) -> torch.Tensor:
        if ctx.tensor not in self.tensors or not ctx.layer.quantizes(ctx.tensor):  # weight-only input: exact
            return x
        return ctx.quantize(x).dequantize(x.dtype)


@register_feature
@dataclass(frozen=True)
class Scaling(Feature):
    """Per-layer FP8 format (E4M3 / E5M2) and granularity: weights "tensor" or "channel"; activations
    "tensor" (calibrated scale, or dynamic when the model is) or "token" (dynamic, one scale per row)."""

    input_format: str | None = None
    input_granularity: str | None = None
    weight_format: str | None = None
    weight_granularity: str | None = None

    def __post_init__(self) -> None:
        for f in (self.input_format, self.weight_format):
            if f is not None:
                FP8Format.parse(f)
        _check_names("input_granularity", (self.input_granularity or "tensor",), ("tensor", "token"))
        _check_names("weight_granularity", (self.weight_granularity or "tensor",), ("tensor", "channel"))

    def tensor_config(self, layer: LayerInfo, tensor: str, cfg: TensorQConfig) -> TensorQConfig:
        self._check_layer(layer)
        fmt, gran = (self.weight_format, self.weight_granularity) if tensor == "weight" else (
            self.input_format, self.input_granularity)
        if fmt is None and gran is None:
            return cfg
        # replace: a block / group layer keeps its block and group sizes when only the format changes
        granularity = cast(Granularity, gran or cfg.granularity)  # checked in __post_init__
        return dataclasses.replace(cfg, format=FP8Format.parse(fmt or cfg.format), granularity=granularity)

    def _check_layer(self, layer: LayerInfo) -> None:
        """Settings no GEMM of ``layer`` computes: a ValueError naming the layer and what to set instead."""
        if layer.kind != "linear":
            return
        if layer.qconfig.weight_only and (self.input_format is not None or self.input_granularity is not None):
            raise ValueError(f"Scaling(input_format / input_granularity) on layer {layer.name!r}: it runs weight-only "
                             "FP8 (QConfig.fp8_weight_only()), its input is not quantized, so it has no scaling to "
                             "change; set only weight_format / weight_granularity there, or select other layers")
        if layer.qconfig.weight.granularity == "mx" and (self.input_granularity is None) != (
                self.weight_granularity is None):
            kept = "input" if self.input_granularity is None else "weight"
            raise ValueError(f"Scaling on layer {layer.name!r}: it is MXFP8 (QConfig.mxfp8(): E8M0 scales per 32 "
                             f"elements on both GEMM operands), and only the other operand's granularity changes, so "
                             f"the {kept} would stay MX, which no GEMM computes with a non-MX operand; set both "
                             "input_granularity and weight_granularity (e.g. token and channel), or neither")
