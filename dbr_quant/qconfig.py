"""Typed, frozen configuration: what format, observer and granularity each tensor gets.

Per-module overrides are an ordered tuple: the first ``Override`` that matches an op wins and its
unset (None) fields fall back to the global config. No string-keyed dicts, no precedence tables.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.block import check_block, check_group
from dbr_quant.observers import ObserverConfig, RunningMax

Granularity = Literal["tensor", "channel", "token", "block", "group", "mx"]
GRANULARITIES = ("tensor", "channel", "token", "block", "group", "mx")
WEIGHT_GRANULARITIES = ("tensor", "channel", "block", "mx")
ACTIVATION_GRANULARITIES = ("tensor", "token", "group", "mx")
WEIGHT_ONLY_GRANULARITIES = ("tensor", "channel")  # what vLLM's CompressedTensorsW8A16Fp8 reads
MXScaleRounding = Literal["floor", "ceil"]
MX_SCALE_ROUNDINGS = ("floor", "ceil")
WeightRounding = Literal["nearest", "gptq"]
WEIGHT_ROUNDINGS = ("nearest", "gptq")
AttentionScales = Literal["tensor", "head"]
ATTENTION_SCALES = ("tensor", "head")
# GPTQ's damping candidates, relative to the mean Hessian diagonal: a half-decade log grid from 1e-3 to 10, then
# round-to-nearest (inf); cross-validated over calibration batches (quantize/rounding/damping.py)
DEFAULT_DAMPINGS: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, math.inf)


@dataclass(frozen=True)
class TensorQConfig:
    """How one kind of tensor (activations or weights) is quantized.

    granularity: "tensor" (one scale), "channel" (weights: one per output channel), "token" (activations,
    dynamic only: one per row of the last dimension), "block" (weights: one per ``block`` = (rows, columns)
    tile of [out, in], the DeepSeek-V3 / compressed-tensors FP8_BLOCK layout) or "group" (activations,
    dynamic only: one per token per ``group_size`` channels). ``block`` and ``group_size`` are read only by
    those granularities; a linear with block weights needs its activation group to equal the block's column
    count (one activation scale per K block of the GEMM). "mx" (weights and dynamic activations, together): OCP
    MX, one power-of-two E8M0 scale per 32 elements along K (``kernels.reference.mx`` says how the exponent is
    rounded); ``block`` / ``group_size`` are not read. ``mx_scale_rounding`` (read by "mx" only): "floor", the OCP
    spec's rule (amax's binade minus the element format's; the block's largest values may saturate), or "ceil" (the
    smallest power of two that saturates nothing, torchao's RCEIL). With ``quantize_attention``, "group" and "mx"
    activations of matmul / attention operands are quantized per token where the operand allows it (a, q, k), else
    per tensor.
    """

    format: FP8Format = FP8Format.E4M3
    observer: ObserverConfig = field(default_factory=RunningMax)
    granularity: Granularity = "tensor"
    block: tuple[int, int] = (128, 128)
    group_size: int = 128
    mx_scale_rounding: MXScaleRounding = "floor"

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", FP8Format.parse(self.format))
        if self.mx_scale_rounding not in MX_SCALE_ROUNDINGS:
            raise ValueError(f"mx_scale_rounding must be 'floor' or 'ceil', not {self.mx_scale_rounding!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(map(repr, GRANULARITIES))}, "
                             f"not {self.granularity!r}")
        object.__setattr__(self, "block", check_block(self.block, "TensorQConfig.block"))
        check_group(self.group_size)
        if self.granularity == "block" and type(self.observer) is not RunningMax:
            raise ValueError(f"granularity 'block' takes each block's amax as its scale (as compressed-tensors "
                             f"FP8_BLOCK and transformers FineGrainedFP8 do, so checkpoints match); observer "
                             f"{type(self.observer).__name__} is not supported there: use RunningMax()")
        if self.granularity == "mx" and type(self.observer) is not RunningMax:
            raise ValueError(f"granularity 'mx' takes each 32-element block's amax for its power-of-two scale (OCP MX, "
                             f"compressed-tensors MXFP8); observer {type(self.observer).__name__} is not supported "
                             "there: use RunningMax()")


@dataclass(frozen=True)
class GPTQOptions:
    """Settings of ``weight_rounding="gptq"`` (see ``dbr_quant.quantize.rounding``).

    act_order: round input channels in order of decreasing Hessian diagonal (largest inputs first).
    block_size: columns rounded between two lazy updates of the remaining weight (speed only).
    folds: calibration batches are dealt round robin into this many folds (one forward = one batch); the
        damping is chosen by cross-validation over them. Memory during calibration: folds · in_features² · 8
        bytes per GPTQ linear (fp64 sums), e.g. 2 · 384² · 8 = 2.4 MB for a MiniLM attention projection,
        2 · 4096² · 8 = 268 MB for a 4096-wide one.
    dampings: candidate dampings (multiples of the mean Hessian diagonal; ``math.inf`` = round to nearest).
    """

    act_order: bool = False
    block_size: int = 128
    folds: int = 2
    dampings: tuple[float, ...] = DEFAULT_DAMPINGS

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"GPTQOptions.block_size must be an int >= 1, got {self.block_size!r}")
        if isinstance(self.folds, bool) or not isinstance(self.folds, int) or self.folds < 2:
            raise ValueError(f"GPTQOptions.folds must be an int >= 2 (cross-validation needs two), got {self.folds!r}")
        object.__setattr__(self, "dampings", tuple(float(d) for d in self.dampings))
        if not self.dampings or any(not d >= 0 for d in self.dampings):
            raise ValueError(f"GPTQOptions.dampings must be non-empty numbers >= 0, got {self.dampings!r}")


def _check_rounding(rounding: str | None, weight: TensorQConfig, where: str) -> None:
    if rounding is not None and rounding not in WEIGHT_ROUNDINGS:
        raise ValueError(f"{where}: weight_rounding must be 'nearest' or 'gptq', not {rounding!r}")
    if rounding == "gptq" and weight.granularity in ("block", "mx"):
        raise ValueError(f"{where}: weight_rounding='gptq' supports per-channel and per-tensor weights, not "
                         f"granularity {weight.granularity!r}; use weight_rounding='nearest' for block-scaled weights "
                         "(or an Override that gives those modules nearest rounding)")


@dataclass(frozen=True)
class Override:
    """Per-module settings. ``pattern`` is a regex matched (re.search) against the op's fqn (for a
    module call, the module's name, e.g. ``encoder.layer.0.output.dense``; for a functional op,
    ``<parent fqn>.<op>_<k>``); ``module_type`` matches the op's module or any module enclosing it.
    ``untie=True`` quantizes a linear whose weight is tied to another parameter (an ``lm_head`` tied to the token
    embedding), which otherwise stays high precision so the tie holds: its FP8 copy then sits beside the
    high-precision original, and convert warns with the bytes.
    """

    pattern: str | None = None
    module_type: type[nn.Module] | tuple[type[nn.Module], ...] | None = None
    skip: bool = False
    activation: TensorQConfig | None = None
    weight: TensorQConfig | None = None
    dynamic: bool | None = None
    weight_rounding: WeightRounding | None = None
    untie: bool = False

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

    def __str__(self) -> str:
        """The fields the user set, e.g. ``Override(pattern='^fc$', skip=True)`` (names it in reasons)."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={getattr(value, '__name__', None) or repr(value)}")
        return f"Override({', '.join(parts)})"


@dataclass(frozen=True)
class QConfig:
    """Global quantization settings.

    activation / weight: per-tensor E4M3 activations with a running-max observer and per-channel
    E4M3 weights by default. dynamic: compute activation scales at run time (no calibration).
    strict: raise instead of warning when a later forward runs an op the trace never saw.
    fuse: bind recorded subgraphs to fused kernels (False runs every op on its own).
    quantize_attention: also run softmax attention in FP8 — scaled_dot_product_attention and the matmul/bmm
    between two activations that feed a softmax or read one (q·kᵀ, p·v); other products of two activations
    (linear attention's chunked q·kᵀ·v, whose recurrent decode step has no matmul) stay high precision,
    reported. Off by default, as in Transformer Engine (fp8_dpa): softmax
    amplifies the rounding of q·kᵀ (all-MiniLM-L6-v2: embedding cosine 0.9975 → 0.9970 with it on).
    weight_rounding: "nearest" rounds each linear weight to the nearest FP8 value; "gptq" rounds with GPTQ
    error feedback from the Hessian of the linear's calibration inputs, with the damping chosen by
    cross-validation over calibration batches (``gptq`` holds its options; ``dbr_quant.runtime.hessians``
    says what calibration keeps). Same scales and FP8 layout as nearest: only which grid point each weight
    takes changes. Needs calibration batches also with ``dynamic=True``.
    attention_scales: the static scales of FP8 attention's operands (with ``quantize_attention``): "tensor", one
    per operand; "head", one per attention head (q, the probabilities of eager attention's p·v) and per KV
    head (k, v under GQA), calibrated per head (``dbr_quant.ops.heads``). Heads whose ranges differ keep their
    own resolution; ``save_pretrained`` writes per-KV-head ``k_scale`` / ``v_scale`` (compressed-tensors
    ``attn_head``). SDPA's probabilities keep the fixed scale 1/fmt.max: every row's largest probability is
    1 in the Triton kernel (at most 1 in the reference), so no head has a smaller range to calibrate.
    weight_only: FP8 weights, activations left in high precision (W8A16, ``QConfig.fp8_weight_only()``): linears
    read their input as it is (``kernels.fp8_weight_only_linear``), nothing is calibrated (``dynamic`` is set);
    weights per channel or per tensor, no FP8 attention.
    """

    activation: TensorQConfig = field(default_factory=TensorQConfig)
    weight: TensorQConfig = field(default_factory=lambda: TensorQConfig(granularity="channel"))
    dynamic: bool = False
    strict: bool = False
    fuse: bool = True
    quantize_attention: bool = False
    overrides: tuple[Override, ...] = ()
    weight_rounding: WeightRounding = "nearest"
    gptq: GPTQOptions = field(default_factory=GPTQOptions)
    attention_scales: AttentionScales = "tensor"
    weight_only: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if self.weight_only:
            object.__setattr__(self, "dynamic", True)  # no activation scale to observe: nothing to calibrate
            _check_weight_only(self)
        _check_attention_scales(self)
        check_combination(self.activation, self.weight, self.dynamic, "QConfig")
        _check_rounding(self.weight_rounding, self.weight, "QConfig")
        if not isinstance(self.gptq, GPTQOptions):
            raise TypeError(f"QConfig.gptq must be a GPTQOptions, got {type(self.gptq).__name__}")
        for ov in self.overrides:
            r = self.for_op_override(ov)
            kind = getattr(ov.module_type, "__name__", ov.module_type)
            where = f"Override(pattern={ov.pattern!r}, module_type={kind}) with QConfig"
            check_combination(r.activation, r.weight, r.dynamic, where)
            _check_rounding(ov.weight_rounding, r.weight, where)
            if not r.skip:
                _check_rounding(r.weight_rounding, r.weight, where)

    @classmethod
    def fp8_block(cls, block: tuple[int, int] = (128, 128), fmt: FP8Format | str = FP8Format.E4M3,
                  **kwargs) -> QConfig:
        """Block-scaled FP8 as DeepSeek-V3 / Qwen3-FP8 ship it (compressed-tensors ``FP8_BLOCK``): one weight
        scale per ``block`` tile, dynamic activation scales per token per ``block[1]`` channels. No calibration
        needed. Other QConfig fields go in ``kwargs``."""
        block = check_block(block, "QConfig.fp8_block(block=...)")
        fmt = FP8Format.parse(fmt)
        return cls(weight=TensorQConfig(format=fmt, granularity="block", block=block),
                   activation=TensorQConfig(format=fmt, granularity="group", group_size=block[1]), dynamic=True,
                   **kwargs)

    @classmethod
    def mxfp8(cls, fmt: FP8Format | str = FP8Format.E4M3, scale_rounding: MXScaleRounding = "floor",
              **kwargs) -> QConfig:
        """MXFP8 (OCP MX v1.0, compressed-tensors ``MXFP8``, Blackwell's scaled MMA): FP8 weights and dynamic FP8
        activations, one power-of-two E8M0 scale per 32 elements along K, its exponent rounded per
        ``scale_rounding`` ("floor": the spec; "ceil": nothing saturates, see TensorQConfig). No calibration
        needed. Other QConfig fields go in ``kwargs``."""
        fmt = FP8Format.parse(fmt)
        mx = TensorQConfig(format=fmt, granularity="mx", mx_scale_rounding=scale_rounding)
        return cls(weight=mx, activation=mx, dynamic=True, **kwargs)

    @classmethod
    def fp8_weight_only(cls, granularity: Literal["channel", "tensor"] = "channel", **kwargs) -> QConfig:
        """Weight-only FP8 (W8A16, vLLM's ``CompressedTensorsW8A16Fp8``): E4M3 weights per output channel (or per
        tensor), activations high precision. For GPUs without FP8 tensor cores and memory-bound decode. Other
        QConfig fields go in ``kwargs``."""
        return cls(weight=TensorQConfig(granularity=granularity), weight_only=True, **kwargs)

    def override_for(self, fqn: str, enclosing_types: tuple[type, ...]) -> Override | None:
        """The first override that matches an op (the one whose settings it takes), or None."""
        return next((ov for ov in self.overrides if ov.matches(fqn, enclosing_types)), None)

    def for_op(self, fqn: str, enclosing_types: tuple[type, ...]) -> OpQConfig:
        """Resolve the settings for one op: first matching override, unset fields from self."""
        ov = self.override_for(fqn, enclosing_types)
        if ov is not None:
            return self.for_op_override(ov)
        return OpQConfig(skip=False, activation=self.activation, weight=self.weight, dynamic=self.dynamic,
                         weight_rounding=self.weight_rounding, weight_only=self.weight_only)

    def for_op_override(self, ov: Override) -> OpQConfig:
        """The settings of an op that ``ov`` matches: its fields, unset ones from self."""
        return OpQConfig(skip=ov.skip, activation=ov.activation or self.activation, weight=ov.weight or self.weight,
                         dynamic=self.dynamic if ov.dynamic is None or self.weight_only else ov.dynamic,
                         weight_rounding=ov.weight_rounding or self.weight_rounding, untie=ov.untie,
                         weight_only=self.weight_only)


def _check_weight_only(qconfig: QConfig) -> None:
    weights = [qconfig.weight] + [ov.weight for ov in qconfig.overrides if ov.weight is not None]
    bad = sorted({w.granularity for w in weights if w.granularity not in WEIGHT_ONLY_GRANULARITIES})
    if bad:
        raise ValueError(f"QConfig(weight_only=True): weight-only FP8 takes per-channel or per-tensor weights (vLLM's "
                         f"CompressedTensorsW8A16Fp8), not granularity {bad}; use QConfig.fp8_weight_only()")
    if qconfig.quantize_attention:
        raise ValueError("QConfig(weight_only=True, quantize_attention=True): weight-only FP8 leaves activations in "
                         "high precision, and FP8 attention quantizes them; choose one")


def _check_attention_scales(q: QConfig) -> None:
    if q.attention_scales not in ATTENTION_SCALES:
        raise ValueError(f"QConfig.attention_scales must be 'tensor' or 'head', not {q.attention_scales!r}")
    if q.attention_scales == "head" and not q.quantize_attention:
        raise ValueError("QConfig(attention_scales='head') sets the scales of FP8 attention: set "
                         "quantize_attention=True too")
    if q.attention_scales == "head" and q.dynamic:
        raise ValueError("QConfig(attention_scales='head') calibrates one scale per attention head (static); with "
                         "dynamic=True attention scales are computed per tensor or per token at run time: set "
                         "dynamic=False (Override(dynamic=True) keeps chosen ops dynamic)")


def check_combination(activation: TensorQConfig, weight: TensorQConfig, dynamic: bool, where: str) -> None:
    """A ValueError naming ``where`` for weight/activation settings that no kernel computes.

    Block weights work with every activation granularity: a per-tensor (static or dynamic) or per-token scale
    is a special case of per-token-group scales (the same value in every group), so the block GEMM takes it
    broadcast to the group layout — static per-tensor activations with block weights is transformers
    FineGrainedFP8's ``activation_scheme: "static"``. Group activations need block weights: their scales vary
    along K, which a per-channel/per-tensor GEMM cannot take out of its dot product.
    """
    wg, ag = weight.granularity, activation.granularity
    if wg not in WEIGHT_GRANULARITIES:
        raise ValueError(f"{where}: weights take granularity 'tensor', 'channel' or 'block', not {wg!r}")
    if ag not in ACTIVATION_GRANULARITIES:
        raise ValueError(f"{where}: activations take granularity 'tensor', 'token' (dynamic) or 'group' (dynamic), "
                         f"not {ag!r}")
    if ag in ("token", "group") and not dynamic:
        raise ValueError(f"{where}: per-{ag} activation scales are computed at run time: set dynamic=True")
    if ag == "group" and wg != "block":
        raise ValueError(f"{where}: activation granularity 'group' needs weight granularity 'block' (group scales "
                         f"vary along the GEMM's reduction dimension; only the block-scaled GEMM applies them); "
                         f"got weight granularity {wg!r}")
    if (ag == "mx") != (wg == "mx"):
        raise ValueError(f"{where}: MX scales go on both GEMM operands (weights and activations granularity 'mx', as "
                         f"QConfig.mxfp8() sets them); got weight {wg!r} with activation {ag!r}")
    if ag == "mx" and not dynamic:
        raise ValueError(f"{where}: MX activation scales are computed at run time: set dynamic=True")
    if ag == "group" and activation.group_size != weight.block[1]:
        raise ValueError(f"{where}: the activation group size ({activation.group_size}) must equal the weight "
                         f"block's column count (block={weight.block}): the block GEMM applies one activation "
                         "scale per K block")


@dataclass(frozen=True)
class OpQConfig:
    """The resolved settings of one recorded op."""

    skip: bool
    activation: TensorQConfig
    weight: TensorQConfig
    dynamic: bool
    weight_rounding: WeightRounding = "nearest"  # convert's rounding of this op's weight (not saved: load reads bytes)
    untie: bool = False  # quantize a linear whose weight is tied to another parameter (Override.untie)
    weight_only: bool = False  # FP8 weight, high-precision input (QConfig.weight_only)

