"""The object dbr_quant's ``InspectRun`` calls for every recorded quantized op: ``execute(call, env)``.

Layers without features run exactly as convert would (``ops.basic.run_basic``). Layers with features
run through :meth:`Inspector._run`: hooks per tensor, then the GEMM in FP8 (same kernels: per-tensor / channel,
block, MX, weight-only) or in high precision. A tensor the layer does not quantize (a weight-only linear's input,
``LayerInfo.quantizes``) skips quantization and its FP8 hooks. Weights are quantized once per layer and setting
and cached for the inspector's lifetime
(on a prepared model with the weight observer convert would use; on a converted model the stored FP8
weight is used unless ``Scaling`` changes it, then the dequantized weight is re-quantized).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dbr_quant import kernels
from dbr_quant.formats import safe_scale
from dbr_quant.inspect.experts import run_experts
from dbr_quant.inspect.features import (
    Feature,
    LayerInfo,
    Quantized,
    Quantizer,
    TensorContext,
    feature_pass,
    not_quantized,
)
from dbr_quant.inspect.layers import RecordedLayer
from dbr_quant.kernels.reference.mx import MX_BLOCK
from dbr_quant.moe.experts import MoeState
from dbr_quant.ops.basic import (
    PER_TOKEN_GRANULARITIES,
    PER_TOKEN_SLOTS,
    Call,
    Env,
    linear_hp_weight,
    linear_operands,
    run_basic,
    sdpa_arguments,
)
from dbr_quant.ops.call import OpRecord
from dbr_quant.ops.heads import head_view, operand_scale
from dbr_quant.ops.mappings import LINEAR, MATMUL
from dbr_quant.qconfig import TensorQConfig
from dbr_quant.quantize.weight_quantization import quantize_weight
from dbr_quant.quantize.weights import fp8_weight_of
from dbr_quant.runtime.runs import observed_inputs

LogSink = Callable[[int, str, str, str, float], None]  # step, layer, tensor, stat, value


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
    def execute(self, call: Call, env: Env) -> torch.Tensor:
        op = call.op
        name = self.names.get(id(op)) if op is not None else None
        features = self.plan.get(name) if name is not None else None
        if op is None or name is None or not features:
            return run_basic(call, env)
        return self._run(call, op, env, features, self.layers[name])

    def experts(self, module: nn.Module, st: MoeState, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """An MoE experts module's call (from ``moe.call.experts_forward``): each expert tensor is a layer."""
        return run_experts(self, module, st, x, ids, weights)

    # ------------------------------------------------------------------ the per-layer pipeline
    def _run(self, call: Call, op: OpRecord, env: Env, features: tuple[Feature, ...], layer: LayerInfo) -> torch.Tensor:
        fp8 = all(f.use_fp8(layer) is not False for f in features)
        want_q = fp8 or any(f.overrides("log_quantized") for f in features)
        if call.kind == LINEAR:
            x = linear_operands(call)[0]
            w = _hp_weight(call)
            if not fp8 and call.module is not None:
                w = self.hp_weights.get(id(call.module), w)
            inputs = {"input": x, "weight": w}
        else:
            inputs = observed_inputs(call.kind, call.args, call.kwargs)
        processed: dict[str, torch.Tensor] = {}
        quantized: dict[str, Quantized] = {}
        for name, t in inputs.items():
            cfg = self._tensor_cfg(layer, name, features)
            quantize = self._quantizer(call, op, env, name, cfg, t) if layer.quantizes(name) else \
                not_quantized(layer.name, name)
            ctx = TensorContext(layer, name, self.step, fp8, self._logger(layer.name, name), quantize)
            processed[name], q = feature_pass(features, ctx, t, name == "weight", want_q and layer.quantizes(name),
                                              fp8, quantize)
            if q is not None:
                quantized[name] = q
        y = self._gemm(call, op, processed, quantized if fp8 else None)
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
    def _quantizer(self, call: Call, op: OpRecord, env: Env, name: str, cfg: TensorQConfig, t: torch.Tensor
                   ) -> Quantizer:
        """quantize(x) with this tensor's scale; quantize(None) on a weight gives the cached FP8 weight."""
        if name == "weight":
            def weight(x: torch.Tensor | None) -> Quantized:
                if x is None or x is t:
                    return self._fp8_weight(call, op, cfg, env)
                quantized = quantize_weight(x.detach(), cfg)  # a feature's processed weight, as convert would
                return Quantized.weight(quantized.qdata, quantized.scale, cfg.format, quantized.block)
            return weight
        op_cfg = op.qconfig.activation

        def activation(x: torch.Tensor | None) -> Quantized:
            x = t if x is None else x
            if cfg.granularity == "group" and call.kind == LINEAR:  # block-scaled linears: per token per group
                data, scale = kernels.group_quantize(x, cfg.group_size, cfg.format)
                return Quantized(data, scale, cfg.format, group=cfg.group_size)
            if cfg.granularity == "mx" and call.kind == LINEAR:  # MXFP8 linears: E8M0 codes per 32 along K
                data, code = kernels.mx_quantize(x, cfg.format, cfg.mx_scale_rounding == "ceil")
                return Quantized(data, code, cfg.format, group=MX_BLOCK)
            # matmul / attention operands of a "group" / "mx" model: per token where the operand allows it (as run)
            token = cfg.granularity in PER_TOKEN_GRANULARITIES and name in PER_TOKEN_SLOTS
            if token or op.qconfig.dynamic:
                scale = kernels.dynamic_scale(x, cfg.format, per_token=token)
            else:
                scale = operand_scale(env.input_scale(call, name, t), x, f"{call.kind} {op.fqn} '{name}'")
                if cfg.format != op_cfg.format:  # same amax, other format
                    scale = safe_scale(scale * op_cfg.format.max, cfg.format)
            return Quantized(kernels.quantize(x, head_view(scale), cfg.format), scale, cfg.format)
        return activation

    def _fp8_weight(self, call: Call, op: OpRecord, cfg: TensorQConfig, env: Env) -> Quantized:
        m = call.module
        key = (id(op), cfg) if m is not None else None
        if key is not None and key in self._weights:
            return self._weights[key]
        stored = fp8_weight_of(m) if m is not None else None
        if stored is not None and cfg == op.qconfig.weight:
            # a module's own rows also when convert stacked a gated pair
            q = Quantized.weight(stored.qdata, stored.scale, cfg.format, stored.block)
        else:
            hessians = getattr(getattr(env, "record", None), "hessians", None)
            rounding = None
            if stored is None and hessians is not None and cfg == op.qconfig.weight \
                    and hessians.wants(op) and hessians.has_data(op.weight_owner):
                # a prepared model whose convert will round with GPTQ: measure that rounding, not nearest
                rounding = functools.partial(hessians.round, op.weight_owner, type(m).__name__, keep=True)
            quantized = quantize_weight(_hp_weight(call).detach(), cfg, rounding=rounding)
            q = Quantized.weight(quantized.qdata, quantized.scale, cfg.format, quantized.block)
        if key is not None:
            self._weights[key] = q
        return q

    # ------------------------------------------------------------------ the GEMM
    def _gemm(self, call: Call, op: OpRecord, x: dict[str, torch.Tensor], q: dict[str, Quantized] | None
              ) -> torch.Tensor:
        if call.kind == LINEAR:
            _, _, bias = linear_operands(call)
            if q is None:
                return F.linear(x["input"], x["weight"], bias)
            qw = q["weight"]
            qi = q.get("input")
            if qi is None:  # weight-only FP8 (W8A16): the input as it is
                ws = qw.scale.reshape(-1) if qw.scale.dim() else qw.scale
                return kernels.fp8_weight_only_linear(x["input"], qw.data, ws, bias=bias, out_dtype=x["input"].dtype)
            if (qw.scale.dtype == torch.uint8) != (qi.scale.dtype == torch.uint8):
                mx = "weight" if qi.group is None else "input"
                raise ValueError(f"dbr_quant.inspect: layer {op.fqn!r} has an MX {mx} and a non-MX other operand; the "
                                 "MX GEMM needs E8M0 scales on both (Scaling: set input_granularity and "
                                 "weight_granularity together)")
            if qw.scale.dtype == torch.uint8:  # MXFP8: E8M0 codes on both operands
                return kernels.fp8_mx_linear(qi.data, qi.scale, qw.data, qw.scale, bias=bias,
                                             out_dtype=x["input"].dtype)
            if qw.block is not None:
                return kernels.fp8_block_linear(qi.data, _group_scale(qi, qw.block[1]), qw.data, qw.scale,
                                                block=qw.block, bias=bias, out_dtype=x["input"].dtype)
            if qi.group is not None:
                raise ValueError(f"dbr_quant.inspect: layer {op.fqn!r} has group-scaled activations but "
                                 "per-channel / per-tensor weights (Scaling changed weight_granularity): only the "
                                 "block GEMM applies group scales; set Scaling(input_granularity=...) too")
            ws = qw.scale.reshape(-1) if qw.scale.dim() else qw.scale
            return kernels.fp8_linear(qi.data, qi.scale, qw.data, ws, bias=bias, out_dtype=x["input"].dtype)
        if call.kind == MATMUL:
            if q is None:
                return call.func(x["a"], x["b"])
            out = kernels.fp8_matmul(q["a"].data, head_view(q["a"].scale), q["b"].data, head_view(q["b"].scale))
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


def _hp_weight(call: Call) -> torch.Tensor:
    """A linear call's weight [N, K] in high precision: its module's (dequantized when stored in FP8), or the
    functional call's weight operand."""
    w = linear_hp_weight(call.module)[0] if call.module is not None else linear_operands(call)[1]
    assert w is not None, "a functional linear call always has its weight operand"
    return w


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


def _raise_no_quantizer() -> Quantized:
    raise RuntimeError("the 'output' tensor has no FP8 scale: it is not quantized")
