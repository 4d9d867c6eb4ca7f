"""FP8 execution of single recorded ops (the "basic ops"); fused subgraphs in fusions.py build on them.

Each executor gets the intercepted call and an ``env`` (the converted model's run context) that hands
out activation scales and FP8 weights; the arithmetic itself is in ``dbr_quant.kernels``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dbr_quant import kernels
from dbr_quant.kernels.autocast import AUTOCAST_ELIGIBLE, autocast_off
from dbr_quant.kernels.reference.mx import MX_WEIGHT_BLOCK
from dbr_quant.ops.call import Call, Env, not_float_activation
from dbr_quant.ops.call import linear_hp_weight as linear_hp_weight  # where runs and inspect read it
from dbr_quant.ops.heads import head_view, operand_scale
from dbr_quant.ops.mappings import LINEAR, MATMUL, MATMUL_AS_LINEAR, SDPA, linear_bias, linear_weight
from dbr_quant.ops.straight_through import run_straight_through, substitute, wants_gradient
from dbr_quant.ops.tags import tag_of
from dbr_quant.quantize.weight_quantization import quantize_weight
from dbr_quant.quantize.weights import FP8Weight, adjacent_rows, fp8_weight_of

_is_grad_enabled = torch._C.is_grad_enabled  # read once per quantized op


def stored_fp8_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp8 weight (N×K), scale (N,) or 0-d) that convert stored for a linear module, else None.

    The gate and up projections of a gated MLP are stored as adjacent rows of one [gate; up] buffer (so
    the fused GEMM reads both without a copy); each module's weight is its own rows of it.
    """
    w = fp8_weight_of(module)
    return None if w is None else (w.qdata, w.scale)


def stacked_gate_up(gate: Call, up: Call) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The [gate; up] FP8 weight and scales when convert stacked this pair (and they still share one
    buffer: a device move copies them apart, then the fused GEMM concatenates per call), else None.
    Block-scaled pairs: scales [gate block rows; up block rows], the layout of ``fp8_block_linear``'s gated path."""
    g, u = gate.module, up.module
    if g is None or u is None or (tag := tag_of(u)) is None or tag.stacked_after is not g:
        return None
    gw, uw = fp8_weight_of(g), fp8_weight_of(u)
    if gw is None or uw is None:
        return None
    q = adjacent_rows(gw.qdata, uw.qdata)
    s = adjacent_rows(gw.scale, uw.scale)
    if q is None or s is None:
        # the FP8 data concatenated as bytes: under torch.autocast, cat's dtype promotion refuses FP8 ("Unexpected
        # floating ScalarType in at::autocast::prioritize"), and a rewritten graph does this cat on every call
        data = torch.cat([gw.qdata.view(torch.uint8), uw.qdata.view(torch.uint8)]).view(gw.qdata.dtype)
        return data, torch.cat([gw.scale, uw.scale])
    return q, s


def linear_operands(call: Call) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(x, weight-or-None-if-stored-FP8, bias) of a linear call, module or functional."""
    if call.module is not None:
        m = call.module
        return call.args[0], None if fp8_weight_of(m) is not None else linear_weight(m), linear_bias(m)
    args, kw = call.args, call.kwargs
    x = args[0]
    if call.func in MATMUL_AS_LINEAR:  # x @ W (W a parameter, mappings.call_kind): the linear's weight is Wᵀ
        return x, (args[1] if len(args) > 1 else kw["other"]).mT, None
    w = args[1] if len(args) > 1 else kw["weight"]
    b = args[2] if len(args) > 2 else kw.get("bias")
    return x, w, b


def _stored(w: torch.Tensor | None) -> FP8Weight | None:
    """A functional linear's weight when it is (a view of) a parameter convert stored in FP8 (param_weights.py)
    in the [out, in] orientation the GEMM reads; None otherwise (then it is quantized per call)."""
    return w if type(w) is FP8Weight and not w.transposed else None


def weight_block(call: Call) -> tuple[int, int] | None:
    """The (rows, columns) block of a block-scaled linear's weight (stored, or per the config when the weight
    is quantized per call), else None."""
    w = fp8_weight_of(call.module) if call.module is not None else _stored(linear_operands(call)[1])
    if w is not None:
        return w.block
    assert call.op is not None, "executors run recorded ops"
    wcfg = call.op.qconfig.weight
    return wcfg.block if wcfg.granularity == "block" else MX_WEIGHT_BLOCK if wcfg.granularity == "mx" else None


def fp8_weight(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 weight and its scale: stored on the module by convert, else quantized now as convert would store
    it (the weight observer's scale: the cheap dynamic-scale kernel where the observer's scale is the amax).
    Block-scaled (see :func:`weight_block`): scale [⌈N/bn⌉, ⌈K/bk⌉]."""
    stored = stored_fp8_weight(call.module) if call.module is not None else None
    if stored is not None:
        return stored
    _, w, _ = linear_operands(call)
    if type(w) is FP8Weight:
        if not w.transposed:
            return w.qdata, w.scale
        w = w.dequantize()  # stored in the other orientation: its scales run along this GEMM's reduction
    assert w is not None and call.op is not None, "executors run recorded linear ops, which read a weight"
    quantized = quantize_weight(w, call.op.qconfig.weight, per_call=True)
    return quantized.qdata, quantized.scale


def linear_parts(call: Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, int] | None]:
    """(fp8 weight, its scale, bias, block) of a linear call: :func:`fp8_weight`, the bias of
    :func:`linear_operands` and :func:`weight_block` in one read of the module (the runtime's hot path: a
    converted ``nn.Linear`` costs two dict lookups here, then its ``FP8Weight``'s fields)."""
    m = call.module
    if m is not None:
        params = m._parameters
        param = params.get("weight")
        if type(param) is FP8Weight:  # a converted linear module, whose bias is a parameter (or None) but oddly
            bias = params["bias"] if "bias" in params else linear_bias(m)
            return param.qdata, param.scale, bias, param.block
    _, w, bias = linear_operands(call)
    stored = _stored(w)
    if stored is not None:
        return stored.qdata, stored.scale, bias, stored.block
    w_q, w_scale = fp8_weight(call)
    return w_q, w_scale, bias, weight_block(call)


# Per-token scales only for operands whose rows are not the GEMM's reduction dimension (a scale along
# K could not be taken out of the dot product): linear inputs, matmul's left operand, q and k.
PER_TOKEN_SLOTS = ("input", "a", "q", "k")
# Activation granularities that run per token on those slots outside a block / MX linear's input (finest there)
PER_TOKEN_GRANULARITIES = ("token", "group", "mx")


def quantized_input(call: Call, slot: str, x: torch.Tensor, env: Env, block: tuple[int, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8, scale) of an activation: a static scale from the env, or a dynamic one in the same kernel.
    "group" activations outside a block linear's input (matmul / attention operands) are quantized per token
    where the slot allows it (the finest granularity those kernels take), else per tensor. The input of a
    linear whose weight is block-scaled (``block``): scale [..., ⌈K/bk⌉], dynamic per-token groups in one
    launch for "group" activations, else the op's own scheme with its scale repeated per group."""
    assert call.op is not None, "executors run recorded ops"
    cfg = call.op.qconfig
    if cfg.dynamic:
        if not x.is_floating_point():  # a static scale's read checks it (the runs' input_scale)
            raise not_float_activation(call.op, slot, x)
        if block is not None and cfg.activation.granularity == "group":
            return kernels.group_quantize(x, block[1], cfg.activation.format)
        if block is not None and cfg.activation.granularity == "mx":
            return kernels.mx_quantize(x, cfg.activation.format, cfg.activation.mx_scale_rounding == "ceil")
        per_token = cfg.activation.granularity in PER_TOKEN_GRANULARITIES and slot in PER_TOKEN_SLOTS
        x_q, scale = kernels.dynamic_quantize(x, cfg.activation.format, per_token)
    else:
        scale = env.input_scale(call, slot, x)
        if scale.dim() == 1:  # one per head (attention_scales="head"), fitted to x's heads (ops/heads.py)
            scale = operand_scale(scale, x, f"{call.kind} {call.op.fqn} '{slot}'")
        x_q = kernels.quantize(x, head_view(scale), cfg.activation.format)
    return (x_q, scale) if block is None else (x_q, as_group_scale(scale, x_q, block[1]))


def linear_input(call: Call, x: torch.Tensor, env: Env, block: tuple[int, int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear's input as its GEMM takes it: :func:`quantized_input`, or (x, None) for weight-only FP8
    (``QConfig.weight_only``: the input stays high precision, :func:`linear_kernel` then runs the W8A16 GEMM)."""
    assert call.op is not None, "executors run recorded ops"
    if call.op.qconfig.weight_only:
        if not x.is_floating_point():
            raise not_float_activation(call.op, "input", x)
        return x, None
    return quantized_input(call, "input", x, env, block)


def as_group_scale(scale: torch.Tensor, x_q: torch.Tensor, group: int) -> torch.Tensor:
    """An activation scale in the per-token-group layout [..., ⌈K/group⌉] of the block GEMM: group scales as
    they are, a per-tensor (0-d or one value) or per-token ([..., 1]) scale repeated over the groups."""
    kb = math.ceil(x_q.shape[-1] / group)
    want = (*x_q.shape[:-1], kb)
    if tuple(scale.shape) == want:
        return scale
    return scale.reshape(scale.shape if scale.dim() == x_q.dim() else ()).expand(want).contiguous()


def run_linear(call: Call, env: Env, *, x: torch.Tensor | None = None, activation: str | None = None,
               residual: torch.Tensor | None = None, x_fp8: tuple[torch.Tensor, torch.Tensor | None] | None = None,
               out_scale: torch.Tensor | None = None, out_fmt=None) -> torch.Tensor:
    """One FP8 linear: quantize the input (unless ``x_fp8`` = (fp8 data, scale) is given: a previous
    kernel already did), GEMM with epilogue; FP8 output with ``out_scale`` for the next op."""
    w_q, w_scale, bias, block = linear_parts(call)
    x = call.args[0] if x is None else x
    kw = {} if out_scale is None else {"out_scale": out_scale, "out_fmt": out_fmt}
    x_q, x_scale = linear_input(call, x, env, block) if x_fp8 is None else x_fp8
    return linear_kernel(x_q, x_scale, w_q, w_scale, block, bias=bias, activation=activation,
                         residual=residual, out_dtype=x.dtype, **kw)


def linear_kernel(x_q: torch.Tensor, x_scale: torch.Tensor | None, w_q: torch.Tensor, w_scale: torch.Tensor,
                  block: tuple[int, int] | None, **epilogue: Any) -> torch.Tensor:
    """``kernels.fp8_linear``, or ``kernels.fp8_block_linear`` for a block-scaled weight (the input scale
    brought to the per-token-group layout), ``kernels.fp8_mx_linear`` for MX (E8M0 codes: uint8 scales), or
    ``kernels.fp8_weight_only_linear`` for a high-precision input (``x_scale`` None, :func:`linear_input`)."""
    if x_scale is None:
        return kernels.fp8_weight_only_linear(x_q, w_q, w_scale, **epilogue)
    if w_scale.dtype == torch.uint8:
        return kernels.fp8_mx_linear(x_q, x_scale, w_q, w_scale, **epilogue)
    if block is None:
        return kernels.fp8_linear(x_q, x_scale, w_q, w_scale, **epilogue)
    return kernels.fp8_block_linear(x_q, as_group_scale(x_scale, x_q, block[1]), w_q, w_scale, block=block,
                                    **epilogue)


def run_matmul(call: Call, env: Env, *, a: torch.Tensor | None = None, b: torch.Tensor | None = None
               ) -> torch.Tensor:
    a = call.args[0] if a is None else a
    b = call.args[1] if b is None else b
    a_q, a_s = quantized_input(call, "a", a, env)
    b_q, b_s = quantized_input(call, "b", b, env)
    out = kernels.fp8_matmul(a_q, head_view(a_s), b_q, head_view(b_s))
    return _in_dtype(out, torch.promote_types(a.dtype, b.dtype))


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(call: Call) -> dict[str, Any]:
    bound = dict(zip(_SDPA_ARGS, call.args))
    bound.update(call.kwargs)
    return bound


def run_sdpa(call: Call, env: Env) -> torch.Tensor:
    assert call.op is not None, "executors run recorded ops"
    a = sdpa_arguments(call)
    q, k, v = a["query"], a["key"], a["value"]
    q_q, q_s = quantized_input(call, "q", q, env)
    k_q, k_s = quantized_input(call, "k", k, env)
    v_q, v_s = quantized_input(call, "v", v, env)
    out = kernels.fp8_attention(
        q_q, q_s, k_q, k_s, v_q, v_s,
        attn_mask=a.get("attn_mask"), is_causal=bool(a.get("is_causal", False)),
        softmax_scale=a.get("scale"), fmt=call.op.qconfig.activation.format,
    )
    return _in_dtype(out, q.dtype)


def _in_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A GEMM kernel's fp32 result in its inputs' dtype. No cast when it already is (a graph captured on fp32
    inputs then holds no cast node pinning float32) or under autocast, where the kernel's result already has the
    dtype autocast gives the op (kernels/autocast.py)."""
    if out.dtype == dtype or torch.is_autocast_enabled(out.device.type):
        return out
    return out.to(dtype)


EXECUTORS: dict[str, Callable[[Call, Env], torch.Tensor]] = {LINEAR: run_linear, MATMUL: run_matmul, SDPA: run_sdpa}


def autocast_on() -> bool:
    """Whether a ``torch.autocast`` region is active on the CPU or CUDA (read once per converted forward)."""
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


def run_basic_autocast(call: Call, env: Env) -> torch.Tensor:
    """:func:`run_basic` inside a ``torch.autocast`` region. Linear, matmul and SDPA are on autocast's
    lower-precision list (torch/amp/autocast_mode.py's op lists), so the FP8 op returns the autocast dtype as
    the op it replaces would; its kernels run with autocast off, so its values are the FP8 op's exact result
    (outside autocast: the same bits, then cast) rather than whatever autocast makes of the kernels' own torch
    calls. A float64 input stays float64, as autocast leaves it. The straight-through gradient's reference runs
    under the same autocast (in backward, where the caller's autocast is over), as activation checkpointing's
    recomputation does."""
    op = call.op
    x = next((a for a in (*call.args, *call.kwargs.values()) if isinstance(a, torch.Tensor)), None)
    device = "cpu" if x is None else x.device.type
    if op is None or not op.quantize or not torch.is_autocast_enabled(device):
        return run_basic(call, env)  # an op that runs as written: autocast treats it as it treats any torch op
    dtype = torch.get_autocast_dtype(device)

    def fp8() -> torch.Tensor:
        with autocast_off(device):  # not a torch function: no interception mode sees it
            out = EXECUTORS[call.kind](call, env)
        return out.to(dtype) if out.dtype in AUTOCAST_ELIGIBLE else out

    if _is_grad_enabled() and (tensors := wants_gradient((call,))) is not None:
        def reference(sub: dict[int, torch.Tensor]) -> Any:
            with torch.autocast(device, dtype=dtype):
                return _reference(call, sub)
        return run_straight_through(fp8, reference, tensors, lambda: f"{call.kind} {op.fqn}")
    return fp8()


def _reference(call: Call, sub: dict[int, torch.Tensor]) -> Any:
    """The op as written, on the tensors ``sub`` substitutes (the straight-through gradient's reference)."""
    return call.run_original(tuple(substitute(a, sub) for a in call.args),
                             {k: substitute(v, sub) for k, v in call.kwargs.items()})


def run_basic(call: Call, env: Env) -> torch.Tensor:
    """Run one recorded op: in FP8 when it is quantized, else as written."""
    op = call.op
    if op is None or not op.quantize:
        return call.run_original()
    if _is_grad_enabled() and (tensors := wants_gradient((call,))) is not None:
        # the FP8 value, the high-precision op's gradient (straight_through.py)
        return run_straight_through(lambda: EXECUTORS[call.kind](call, env), lambda sub: _reference(call, sub),
                                    tensors, lambda: f"{call.kind} {op.fqn}")
    return EXECUTORS[call.kind](call, env)
