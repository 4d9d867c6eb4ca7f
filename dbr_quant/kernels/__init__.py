"""FP8 kernels behind one dispatch point.

Every quantized subgraph calls one of the entry points below. Each is generated from the kernel's
declaration in :mod:`.table` (its signature, docstring and launch counter are written there, once) and does
three things: while ``fx_rewriter`` captures a graph it calls the graph op instead (``dispatch.capture_with``);
it counts its launches (:func:`count_launches`); it runs the implementation of the backend for its tensors'
device (:func:`_impl`: ``$DBR_QUANT_BACKEND`` or :func:`use_backend`, else chosen per device). The
``reference`` backend is plain torch with exact FP8 semantics, the CPU default (its GEMMs run in bf16 or fp32,
see :mod:`.cpu` and :func:`use_cpu_gemm`); ``triton`` / ``triton-interpret`` run the Triton kernels
(:mod:`.triton.backend`). :func:`fp8_moe_block` is a composition of entry points, not a kernel of its own.

The entry points read this thread's settings (``dispatch._tls``: graph ops while capturing, launch counters
inside ``count_launches``, the forced backend) as plain attributes rather than through the accessor
functions: they run once per launch, and on small shapes the runtime's Python is the cost.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar, cast

import torch

from dbr_quant.formats import FP8Format
from dbr_quant.kernels import table
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.cpu.features import current_gemm_path, use_cpu_gemm
from dbr_quant.kernels.dispatch import (
    BACKENDS,
    _env_backend,
    _env_cache,
    count_launches,
    current_backend,
    graph_ops,
    record_launch,  # noqa: F401  (called by the generated entry points)
    resolve_backend,
    use_backend,
)
from dbr_quant.kernels.dispatch import (
    _tls as _settings,  # this thread's backend / graph ops / launch counters (read per launch)
)
from dbr_quant.kernels.op_table import KernelOp, build_function, call_arguments
from dbr_quant.kernels.reference import block as reference_block  # noqa: F401  (kernels.reference_block: checkpoints)
from dbr_quant.kernels.reference import dense as reference
from dbr_quant.kernels.reference import grouped as reference_grouped  # noqa: F401  (kernels.reference_grouped)
from dbr_quant.kernels.reference import mx as reference_mx  # noqa: F401  (kernels.reference_mx: checkpoints, quantize)
from dbr_quant.kernels.routing import MoeRouting, moe_route
from dbr_quant.kernels.triton import backend as triton_backend

__all__ = [
    "BACKENDS", "graph_ops", "count_launches", "current_backend", "resolve_backend", "use_backend", "current_gemm_path",
    "use_cpu_gemm",
    "quantize", "dynamic_quantize", "dequantize", "dynamic_scale", "fp8_linear", "fp8_mlp", "fp8_matmul",
    "fp8_attention", "layer_norm_quantize", "MoeRouting", "moe_route", "moe_quantize", "fp8_grouped_linear",
    "fp8_moe_block", "fp8_grouped_block_linear", "block_quantize_weight", "group_quantize",
    "layer_norm_group_quantize", "fp8_block_linear", "mx_quantize", "fp8_mx_linear", "fp8_weight_only_linear",
    "fp8_grouped_weight_only_linear", "fp8_grouped_mx_linear",
]

F = TypeVar("F", bound=Callable[..., Any])
# ``_env_cache`` once $DBR_QUANT_BACKEND was read and found unset: the backend is "auto" unless this thread forces one
_ENV_AUTO: list[str | None] = [None]


def _impl(t: torch.Tensor, ref: ModuleType = reference, fp8_mma: bool = True) -> ModuleType:
    """The implementation module for the backend that runs on ``t``'s device: ``ref`` (the op's reference module)
    for "reference", the CPU backend for "cpu" (the choice of "auto" off CUDA), else the Triton backend (on a
    CUDA device without FP8 tensor cores only for an op whose kernel does not need them: ``fp8_mma`` False)."""
    backend = _settings.backend  # current_backend() inlined: this runs once per launch
    if backend is None:
        backend = (_env_cache[0] if _env_cache else _env_backend()) or "auto"
    if (backend == "auto" and not t.is_cuda) or backend == "cpu":
        return cpu_backend
    if backend == "reference":
        return ref
    # auto on CUDA: cpu without FP8 tensor cores (or without triton); a forced Triton backend needs no device
    if backend == "auto" and resolve_backend(t.device, fp8_mma) == "cpu":
        return cpu_backend
    return triton_backend


def _graph_op(ops: Any, name: str) -> Any:
    """``ops.<name>``, or a clear error while the graph rewriter has no such op yet."""
    op = getattr(ops, name, None)
    if op is None:
        raise NotImplementedError(f"dbr_quant.kernels.{name}: the graph rewriter (fx_rewriter) has no {name} op "
                                  "yet; run this model eagerly (without rewrite/compile)")
    return op


def _entry_point(op: KernelOp[F]) -> F:
    """``op``'s public function, with its declaration's signature and docstring: while a graph is captured the
    graph op; else count the launches and run the backend's implementation (``op.launch`` on it, for an op
    that is several calls); an op without a Triton kernel runs the reference everywhere, or, where
    ``op.without_triton`` says why Triton cannot, the plain backend chosen (reference or cpu) and that error on
    Triton. The body reads this module's ``_settings``,
    ``_graph_op``, ``_impl`` and ``record_launch`` at call time, as a hand-written entry point would.

    The common case comes first: nothing set on this thread (``_settings.all_default``), no backend in the
    environment and a tensor off CUDA run the CPU backend, as ``_impl`` would choose, with one thread-local read
    and no further call (on small shapes the runtime's Python is the cost, and this runs once per launch)."""
    args = call_arguments(op.parameters)

    def run_on(backend: str) -> str:
        if op.launch is not None:
            return f"return _launch({backend}, {', '.join(op.hook_arguments(op.launch))})"
        return f"return {backend}.{op.name}({args})"

    dispatched = op.launch is not None or op.triton is not None or bool(op.without_triton)  # else reference only
    body = []
    if dispatched:
        body += [f"if _settings.all_default and not {op.device}.is_cuda and _env_cache == _ENV_AUTO:",
                 f"    {run_on('cpu_backend')}"]
    body += ["if (ops := _settings.graph_ops) is not None:",
             f"    return _graph_op(ops, {op.name!r})({args})"]
    backend = f"_impl({op.device}, _reference{'' if op.fp8_tensor_cores else ', False'})"
    if op.without_triton:  # the plain backends (reference, cpu) run it; Triton has no kernel for it
        body += [f"_backend = {backend}", "if _backend is triton_backend:",
                 "    raise NotImplementedError(_without_triton)"]
        backend = "_backend"
    body += ["if _settings.counters:", *(f"    record_launch({name!r})" for name in op.launches)]
    if op.more_launches is not None:
        body += [f"_backend = {backend}", "if _settings.counters:",
                 f"    _more_launches(_backend, {', '.join(op.hook_arguments(op.more_launches))})"]
        backend = "_backend"
    if dispatched:
        body.append(run_on(backend))
    else:
        body.append(f"return _reference.{op.name}({args})")
    bound = {"_reference": op.reference, "_launch": op.launch, "_more_launches": op.more_launches,
             "_without_triton": op.without_triton or None}
    bound = {name: value for name, value in bound.items() if value is not None}  # only what the body reads
    return cast(F, build_function(op.name, op.parameters, body, module_globals=globals(), bound=bound, doc=op.doc,
                                  annotations=op.declaration.__annotations__))


quantize = _entry_point(table.quantize)
dynamic_quantize = _entry_point(table.dynamic_quantize)
dequantize = _entry_point(table.dequantize)
dynamic_scale = _entry_point(table.dynamic_scale)
fp8_linear = _entry_point(table.fp8_linear)
fp8_mlp = _entry_point(table.fp8_mlp)
layer_norm_quantize = _entry_point(table.layer_norm_quantize)
fp8_matmul = _entry_point(table.fp8_matmul)
fp8_attention = _entry_point(table.fp8_attention)
moe_quantize = _entry_point(table.moe_quantize)
fp8_grouped_linear = _entry_point(table.fp8_grouped_linear)
fp8_grouped_block_linear = _entry_point(table.fp8_grouped_block_linear)
block_quantize_weight = _entry_point(table.block_quantize_weight)
group_quantize = _entry_point(table.group_quantize)
layer_norm_group_quantize = _entry_point(table.layer_norm_group_quantize)
fp8_block_linear = _entry_point(table.fp8_block_linear)
mx_quantize = _entry_point(table.mx_quantize)
fp8_mx_linear = _entry_point(table.fp8_mx_linear)
fp8_weight_only_linear = _entry_point(table.fp8_weight_only_linear)
fp8_grouped_weight_only_linear = _entry_point(table.fp8_grouped_weight_only_linear)
fp8_grouped_mx_linear = _entry_point(table.fp8_grouped_mx_linear)


def fp8_moe_block(x: torch.Tensor, routing: MoeRouting, topk_weights: torch.Tensor, w13_q: torch.Tensor,
                  w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor, h_scale: torch.Tensor, *,
                  x_scale: torch.Tensor | None = None, activation: str = "swiglu", fmt: FP8Format = FP8Format.E4M3,
                  bias13: torch.Tensor | None = None, bias2: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.float32, deterministic: bool = False) -> torch.Tensor:
    """An MoE block's experts after routing, ``Σ_j w[t, j]·down_e(act(gate_up_e(x_t)))``, in three launches:

    1. quantize x: ``x_scale`` None → dynamic per-token scales; one value → static; [E] → per-expert static
       scales (``moe_quantize``: rows gathered and sorted by expert while quantizing);
    2. gate_up grouped GEMM (``w13_q`` [E, 2I, H] stacked [gate; up] for gated activations), epilogue
       ``act(gate)·up`` quantized with the down projection's input scale ``h_scale`` (one value or [E]);
    3. down grouped GEMM (``w2_q`` [E, H, I]) with the routing-weighted scatter-add into [T, H].
    """
    if x.dim() != 2:
        raise ValueError(f"fp8_moe_block: x must be [tokens, hidden], got {tuple(x.shape)}")
    if x_scale is None:
        x_q, xs = dynamic_quantize(x, fmt, per_token=True)
        x_sorted = False
    elif x_scale.numel() == 1:
        x_q, xs, x_sorted = quantize(x, x_scale, fmt), x_scale, False
    else:
        x_q, xs, x_sorted = moe_quantize(x, x_scale, routing, fmt), x_scale, True
    h_q = fp8_grouped_linear(x_q, xs, w13_q, w13_scale, routing, x_sorted=x_sorted, bias=bias13,
                             activation=activation, out_scale=h_scale, out_fmt=fmt)
    return fp8_grouped_linear(h_q, h_scale, w2_q, w2_scale, routing, x_sorted=True, bias=bias2,
                              topk_weights=topk_weights, out_dtype=out_dtype, deterministic=deterministic)
