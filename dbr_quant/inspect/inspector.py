"""The object dbr_quant's ``InspectRun`` calls for every recorded quantized op: ``execute(call, env)``.

Layers without features run exactly as convert would (``basic_ops.run_basic``). Layers with features
run through :meth:`Inspector._run`: hooks per tensor, then the GEMM in FP8 (same kernels) or in high
precision. Weights are quantized once per layer and setting and cached for the inspector's lifetime
(on a prepared model with the weight observer convert would use; on a converted model the stored FP8
weight is used unless ``Scaling`` changes it, then the dequantized weight is re-quantized).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dbr_quant import kernels
from dbr_quant.formats import safe_scale
from dbr_quant.inspect.features import Feature, LayerInfo, Quantized, TensorContext
from dbr_quant.moe.experts import EXPERTS
from dbr_quant.ops.basic import Call, linear_hp_weight, linear_operands, run_basic, sdpa_arguments, stored_fp8_weight
from dbr_quant.ops.mappings import LINEAR, MATMUL, QUANTIZEABLE
from dbr_quant.qconfig import TensorQConfig
from dbr_quant.quantize.weights import fp8_weight_of
from dbr_quant.runtime.runs import ModelRecord, observed_inputs
from dbr_quant.runtime.state import SeenOp

LogSink = Callable[[int, str, str, str, float], None]  # step, layer, tensor, stat, value


def model_record(model: nn.Module) -> ModelRecord:
    record = model.__dict__.get("_dbr_record") if isinstance(model, nn.Module) else None
    if record is None or record.phase not in ("prepared", "converted"):
        raise TypeError("dbr_quant.inspect needs a model returned by dbr_quant.prepare() (calibrated) or convert()")
    return record


def feature_pass(features: list, ctx: TensorContext | None, t: torch.Tensor, is_weight: bool, want_q: bool,
                 fp8: bool, quantize) -> tuple[torch.Tensor, Quantized | None]:
    """One input tensor of a layer through the features: log it, let them process it, and when asked
    quantize it (what FP8 would compute: a high-precision layer is measured on what FP8 would do) and let
    them process and log the quantized form. Returns (processed tensor, quantized or None). ``ctx`` may be
    None only without features."""
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


@dataclass(frozen=True)
class RecordedLayer:
    """A recorded quantized op under its layer name: the op's fqn, with ``#k`` appended to the k-th repeat
    of an fqn (e.g. two matmuls in one forward: ``attn.matmul``, ``attn.matmul#1``)."""

    info: LayerInfo
    module_types: tuple[str, ...]  # class names of its module and that module's bases (for module_type)
    op: SeenOp


def named_ops(model: nn.Module) -> list[tuple[str, SeenOp]]:
    """Every recorded GEMM op (linear, matmul, sdpa, MoE experts; quantized or not) with its unique layer name."""
    count: dict[str, int] = {}
    out = []
    for st in model_record(model).states:
        for op in st.seen_ops:
            if op.kind in QUANTIZEABLE or op.kind == EXPERTS:  # each 3-D expert tensor: a layer (experts.py)
                k = count[op.fqn] = count.get(op.fqn, -1) + 1
                out.append((op.fqn if k == 0 else f"{op.fqn}#{k}", op))
    return out


def recorded_layers(model: nn.Module) -> dict[str, RecordedLayer]:
    """The recorded ops that run in FP8 (``op.quantize``), by layer name, in call order."""
    record = model_record(model)
    owners = {id(op): st.fqn for st in record.states for op in st.seen_ops}
    out: dict[str, RecordedLayer] = {}
    for name, op in named_ops(model):
        if not op.quantize:
            continue
        owner = op.weight_owner if op.weight_owner is not None else owners[id(op)]
        try:
            mod = model.get_submodule(owner)
        except AttributeError:
            mod = model
        names = tuple(c.__name__ for c in type(mod).__mro__ if c not in (object, nn.Module))
        out[name] = RecordedLayer(LayerInfo(name, op.kind, type(mod).__name__, op.qconfig), names, op)
    return out


@contextmanager
def attached(model: nn.Module, inspector: Any) -> Iterator[None]:
    """Route the model's forwards through ``inspector`` inside the block (always detached after)."""
    record = model_record(model)
    if record.inspector is not None:
        raise RuntimeError("this model is already being inspected (one session at a time)")
    record.inspector = inspector
    try:
        yield
    finally:
        record.inspector = None


class Inspector:
    """Runs each recorded op with the features of its layer (``plan``: layer name → features)."""

    def __init__(self, plan: Mapping[str, tuple[Feature, ...]], layers: Mapping[str, RecordedLayer],
                 sink: LogSink | None = None) -> None:
        self.plan = dict(plan)
        self.layers = {name: r.info for name, r in layers.items()}
        self.names = {id(r.op): name for name, r in layers.items()}
        self.sink = sink
        self.step = 0
        self._weights: dict[tuple, Quantized] = {}
        # id(linear module) → its original weight, for layers run in high precision on a converted model (set by
        # sensitivity/auto_fallback from ``reference=``: else they run with their dequantized FP8 weight)
        self.hp_weights: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ entry point (InspectRun)
    def execute(self, call: Call, env: Any) -> torch.Tensor:
        name = self.names.get(id(call.op))
        features = self.plan.get(name) if name is not None else None
        if not features:
            return run_basic(call, env)
        return self._run(call, env, features, self.layers[name])

    def experts(self, module: nn.Module, st: Any, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """An MoE experts module's call (from ``moe.call.experts_forward``): each expert tensor is a layer."""
        from dbr_quant.inspect.experts import run_experts

        return run_experts(self, module, st, x, ids, weights)

    # ------------------------------------------------------------------ the per-layer pipeline
    def _run(self, call: Call, env: Any, features: tuple[Feature, ...], layer: LayerInfo) -> torch.Tensor:
        fp8 = all(f.use_fp8(layer) is not False for f in features)
        want_q = fp8 or any(f.overrides("log_quantized") for f in features)
        if call.kind == LINEAR:
            x, _, bias = linear_operands(call)
            w = linear_hp_weight(call.module)[0] if call.module is not None else linear_operands(call)[1]
            if not fp8 and call.module is not None:
                w = self.hp_weights.get(id(call.module), w)
            inputs = {"input": x, "weight": w}
        else:
            inputs = observed_inputs(call.kind, call.args, call.kwargs)
        processed: dict[str, torch.Tensor] = {}
        quantized: dict[str, Quantized] = {}
        for name, t in inputs.items():
            cfg = self._tensor_cfg(layer, name, features)
            quantize = self._quantizer(call, env, name, cfg, t)
            ctx = TensorContext(layer, name, self.step, fp8, self._logger(layer.name, name), quantize)
            processed[name], q = feature_pass(features, ctx, t, name == "weight", want_q, fp8, quantize)
            if q is not None:
                quantized[name] = q
        y = self._gemm(call, processed, quantized if fp8 else None)
        ctx = TensorContext(layer, "output", self.step, fp8, self._logger(layer.name, "output"),
                            lambda t: _raise_no_quantizer())
        for f in features:
            f.log_tensor(ctx, y)
        for f in features:
            y = f.process_tensor(ctx, y)
        return y

    def _logger(self, layer: str, tensor: str) -> Callable[[str, float], None]:
        sink, step = self.sink, self.step
        return (lambda stat, value: sink(step, layer, tensor, stat, float(value))) if sink else (lambda s, v: None)

    @staticmethod
    def _tensor_cfg(layer: LayerInfo, name: str, features: tuple[Feature, ...]) -> TensorQConfig:
        cfg = layer.qconfig.weight if name == "weight" else layer.qconfig.activation
        for f in features:
            cfg = f.tensor_config(layer, name, cfg)
        return cfg

    # ------------------------------------------------------------------ quantization
    def _quantizer(self, call: Call, env: Any, name: str, cfg: TensorQConfig, t: torch.Tensor
                   ) -> Callable[[torch.Tensor | None], Quantized]:
        """quantize(x) with this tensor's scale; quantize(None) on a weight gives the cached FP8 weight."""
        if name == "weight":
            def weight(x: torch.Tensor | None) -> Quantized:
                return self._fp8_weight(call, cfg, env) if x is None or x is t else _quantize_weight(x, cfg)
            return weight
        op_cfg = call.op.qconfig.activation

        def activation(x: torch.Tensor | None) -> Quantized:
            x = t if x is None else x
            if cfg.granularity == "group" and call.kind == LINEAR:  # block-scaled linears: per token per group
                data, scale = kernels.group_quantize(x, cfg.group_size, cfg.format)
                return Quantized(data, scale, cfg.format, group=cfg.group_size)
            # matmul / attention operands of a "group" model: per token where the operand allows it (as run)
            token = cfg.granularity in ("token", "group") and name in ("input", "a", "q", "k")
            if token or call.op.qconfig.dynamic:
                scale = kernels.dynamic_scale(x, cfg.format, per_token=token)
            else:
                scale = env.input_scale(call, name, t)
                if cfg.format != op_cfg.format:  # same amax, other format
                    scale = safe_scale(scale * op_cfg.format.max, cfg.format)
            return Quantized(kernels.quantize(x, scale, cfg.format), scale, cfg.format)
        return activation

    def _fp8_weight(self, call: Call, cfg: TensorQConfig, env: Any = None) -> Quantized:
        m = call.module
        key = (id(call.op), cfg) if m is not None else None
        if key is not None and key in self._weights:
            return self._weights[key]
        stored = stored_fp8_weight(m) if m is not None else None
        if stored is not None and cfg == call.op.qconfig.weight:
            w_q, s = stored  # a module's own rows also when convert stacked a gated pair
            block = fp8_weight_of(m).block
            q = (Quantized(w_q, s, cfg.format, block=block) if block is not None
                 else Quantized(w_q, s.unsqueeze(-1) if s.dim() else s, cfg.format))
        else:
            w = linear_hp_weight(m)[0] if m is not None else linear_operands(call)[1]
            q = _quantize_weight(w.detach(), cfg)
            hessians = getattr(getattr(env, "record", None), "hessians", None)
            if stored is None and hessians is not None and cfg == call.op.qconfig.weight \
                    and hessians.wants(call.op) and hessians.has_data(call.op.weight_owner):
                # a prepared model whose convert will round with GPTQ: measure that rounding, not nearest
                scale = q.scale.reshape(-1) if q.scale.dim() else q.scale
                data = hessians.round(call.op.weight_owner, type(m).__name__, w.detach(), cfg, scale, q.data,
                                      keep=True)
                q = Quantized(data, q.scale, cfg.format)
        if key is not None:
            self._weights[key] = q
        return q

    # ------------------------------------------------------------------ the GEMM
    def _gemm(self, call: Call, x: dict[str, torch.Tensor], q: dict[str, Quantized] | None) -> torch.Tensor:
        if call.kind == LINEAR:
            _, _, bias = linear_operands(call)
            if q is None:
                return F.linear(x["input"], x["weight"], bias)
            qi, qw = q["input"], q["weight"]
            if qw.block is not None:
                return kernels.fp8_block_linear(qi.data, _group_scale(qi, qw.block[1]), qw.data, qw.scale,
                                                block=qw.block, bias=bias, out_dtype=x["input"].dtype)
            if qi.group is not None:
                raise ValueError(f"dbr_quant.inspect: layer {call.op.fqn!r} has group-scaled activations but "
                                 "per-channel / per-tensor weights (Scaling changed weight_granularity): only the "
                                 "block GEMM applies group scales; set Scaling(input_granularity=...) too")
            ws = qw.scale.reshape(-1) if qw.scale.dim() else qw.scale
            return kernels.fp8_linear(qi.data, qi.scale, qw.data, ws, bias=bias, out_dtype=x["input"].dtype)
        if call.kind == MATMUL:
            if q is None:
                return call.func(x["a"], x["b"])
            out = kernels.fp8_matmul(q["a"].data, q["a"].scale, q["b"].data, q["b"].scale)
            return out.to(torch.promote_types(x["a"].dtype, x["b"].dtype))
        a = sdpa_arguments(call)
        if q is None:
            rest = {k: v for k, v in a.items() if k not in ("query", "key", "value")}
            return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], **rest)
        out = kernels.fp8_attention(
            q["q"].data, q["q"].scale, q["k"].data, q["k"].scale, q["v"].data, q["v"].scale,
            attn_mask=a.get("attn_mask"), is_causal=bool(a.get("is_causal", False)),
            softmax_scale=a.get("scale"), fmt=q["q"].format)
        return out.to(x["q"].dtype)


def _group_scale(q: Quantized, group: int) -> torch.Tensor:
    """An activation scale in the block GEMM's layout [..., ⌈K/group⌉]: a per-tensor or per-token scale is the
    same value in every group (what ``check_combination`` allows with block weights)."""
    groups = -(-q.data.shape[-1] // group)
    if q.group is not None:
        if q.group != group:
            raise ValueError(f"dbr_quant.inspect: activation groups of {q.group} channels, weight blocks of {group}")
        return q.scale
    s = q.scale.float()
    s = s.reshape(*q.data.shape[:-1], 1) if s.numel() > 1 else s.reshape([1] * q.data.dim())
    return s.expand(*q.data.shape[:-1], groups).contiguous()


def _quantize_weight(w: torch.Tensor, cfg: TensorQConfig) -> Quantized:
    """As convert() does it: the weight observer of ``cfg`` (per output channel or per tensor), or the block
    scales (each block's amax / fmt.max)."""
    if cfg.granularity == "block":
        q, scale = kernels.block_quantize_weight(w.detach(), cfg.block, cfg.format)
        return Quantized(q, scale, cfg.format, block=cfg.block)
    per_channel = cfg.granularity == "channel"
    observer = cfg.observer.create(cfg.format, 0 if per_channel else None)
    observer(w.detach())
    scale = observer.scale().to(w.device)
    scale = scale.unsqueeze(1) if per_channel else scale
    return Quantized(kernels.quantize(w, scale, cfg.format), scale, cfg.format)


def _raise_no_quantizer() -> Quantized:
    raise RuntimeError("the 'output' tensor has no FP8 scale: it is not quantized")
