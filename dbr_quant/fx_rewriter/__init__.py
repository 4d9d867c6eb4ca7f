"""FX rewriter: a converted model → a ``torch.fx.GraphModule`` with no interception left.

Approach: the define-by-run runtime itself is the tracer. ``torch.export`` in non-strict mode runs the
converted model's Python (Hugging Face shape logic, kwargs, ModelOutput returns and all) on fake
tensors while our interception is active; every FP8 kernel call is routed to a ``torch.library``
custom op (``dbr_quant::fp8_linear``, ``::quantize``, ``::fp8_attention``, …) and so lands in the
graph as one opaque node. Nothing needs to be symbolically traceable, and the graph computes exactly
what eager does (the ops call the same kernel dispatch).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import warnings
from typing import Any

import torch
from torch import nn
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.fx.graph import _PyTreeCodeGen
from torch.utils._config_module import ConfigModule
from torch.utils._pytree import tree_flatten, tree_map, tree_structure

from dbr_quant.fx_rewriter.lowering import lowering_cache_key
from dbr_quant.fx_rewriter.ops import GraphOps
from dbr_quant.kernels.cpu.features import current_gemm_path, use_cpu_gemm
from dbr_quant.kernels.dispatch import capture_with

__all__ = ["rewrite", "RewriteError", "compile_frozen", "gemm_path_cache_key"]


class RewriteError(RuntimeError):
    """The model or the example inputs cannot be rewritten (the message says why and what to do)."""


def _config(module: object) -> ConfigModule:
    """A torch config module (``torch.compiler.config`` …) as what it is at run time, so its ``patch`` is typed
    (torch installs it on the module object, where a type checker does not see it)."""
    assert isinstance(module, ConfigModule)
    return module


def _spec(obj: Any) -> list[tuple]:
    leaves, _ = tree_flatten(obj)
    return [("tensor", t.dtype, t.dim()) if isinstance(t, torch.Tensor) else (type(t).__name__,) for t in leaves]


def _check_inputs(traced: tuple[tuple, dict], args: tuple, kwargs: dict) -> None:
    t_args, t_kwargs = traced
    problems = []
    if len(args) != len(t_args):
        problems.append(f"{len(args)} positional argument(s), the trace had {len(t_args)}")
    has_tensor = lambda v: any(isinstance(t, torch.Tensor) for t in tree_flatten(v)[0])  # noqa: E731
    # keyword arguments without tensors (flags such as use_cache=False) may be added or left out
    odd = sorted(k for k in set(kwargs) ^ set(t_kwargs) if has_tensor(kwargs.get(k, t_kwargs.get(k))))
    if odd:
        problems.append(f"keyword arguments {sorted(kwargs)}, the trace had {sorted(t_kwargs)} (tensors in {odd})")
    if not problems:
        for i, (a, b) in enumerate(zip(args, t_args)):
            if _spec(a) != _spec(b):
                problems.append(f"positional argument {i} is {_spec(a)}, the trace had {_spec(b)}")
        for k in set(kwargs) & set(t_kwargs):
            if has_tensor(kwargs[k]) and _spec(kwargs[k]) != _spec(t_kwargs[k]):
                problems.append(f"keyword argument {k!r} is {_spec(kwargs[k])}, the trace had {_spec(t_kwargs[k])}")
    if problems:
        raise RewriteError("rewrite(): the example inputs do not match the ones prepare() traced: "
                           + "; ".join(problems) + ". Pass inputs of the same structure, dtypes and ranks "
                           "(sizes may differ), or none to reuse prepare()'s.")


def _dynamic_shapes(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The first two dimensions of every tensor input (batch and sequence, by convention) may vary; export
    keeps them symbolic where the model allows. Feature dimensions stay fixed: the weights fix them."""
    auto = lambda t: {i: Dim.AUTO for i in range(min(t.dim(), 2))} if isinstance(t, torch.Tensor) else None  # noqa: E731
    return tree_map(auto, args), {k: tree_map(auto, v) for k, v in kwargs.items()}


def _no_size_one_specialization(args: tuple, kwargs: dict) -> contextlib.AbstractContextManager:
    """torch.export specializes a ``Dim.AUTO`` dimension whose example size is 0 or 1 to that size, and says so
    (``0/1 specialized; Dim.AUTO was specified …``, one log line per dimension): a batch-1 example would give a
    graph that takes batch 1 only. Size-oblivious reasoning (an export option) keeps such dimensions symbolic;
    a model that branches on the size still gets a guard. Only used when an example has such a size, so other
    captures are unchanged."""
    leaves, _ = tree_flatten((args, kwargs))
    if not any(isinstance(t, torch.Tensor) and any(n <= 1 for n in t.shape[:2]) for t in leaves):
        return contextlib.nullcontext()
    from torch.fx.experimental import _config as symbolic_shapes_config

    return _config(symbolic_shapes_config).patch({"backed_size_oblivious": True})


def rewrite(converted: nn.Module, example_inputs: Any = None, *,
            example_kwargs: dict[str, Any] | None = None) -> torch.fx.GraphModule:
    """Capture a converted model as a GraphModule of aten ops and ``dbr_quant`` custom ops.

    The result runs without dbr_quant's interception, takes the same inputs (any batch and sequence
    size) and returns the same output structure; ``torch.compile(gm, fullgraph=True)`` and
    ``torch.export.export(gm, args)`` take it as it is.

    The graph is for inference (its parameters do not require grad; a backward through an FP8 op raises)
    unless an example input requires grad: then it carries the eager model's straight-through gradients
    (each FP8 op's high-precision reference is captured too, so such a graph computes both).
    """
    record = converted.__dict__.get("_dbr_record") if isinstance(converted, nn.Module) else None
    if record is None or record.phase != "converted":
        phase = "not prepared by dbr_quant" if record is None else record.phase
        raise RewriteError(f"rewrite() needs a model returned by dbr_quant.convert(); this one is {phase}. "
                           "Run prepare → calibrate → convert first.")
    if example_inputs is None and example_kwargs is None:
        args, kwargs = record.example
    else:
        args = example_inputs if isinstance(example_inputs, tuple) else (
            () if example_inputs is None else (example_inputs,))
        kwargs = dict(example_kwargs or {})
        _check_inputs(record.example, args, kwargs)
    given = set(kwargs)
    kwargs = _without_kv_cache(converted, kwargs)
    dyn_args, dyn_kwargs = _dynamic_shapes(args, kwargs)
    # example inputs that require grad ask for a graph with the eager model's straight-through gradients
    # (straight_through.py: each FP8 op's high-precision reference is captured beside it); else inference
    trainable = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten((args, kwargs))[0])
    dynamic_shapes = {**_named(converted, dyn_args), **dyn_kwargs}
    with torch.set_grad_enabled(trainable), capture_with(GraphOps):
        try:
            exported = _export(converted, args, kwargs, dynamic_shapes)
        except GuardOnDataDependentSymNode as e:
            raise RewriteError(_data_dependent_message(e)) from e
        except RuntimeError as e:
            unknown = re.search(r"Found <class '([\w.]+)'> in output, which is not a known type", str(e))
            if unknown is None:
                raise
            name = unknown.group(1)
            raise RewriteError(f"{type(converted).__name__}.forward returns a {name} object, which torch.export cannot "
                               f"return: register it first, torch.export.register_dataclass({name.rpartition('.')[2]}) "
                               "for a dataclass (or torch.utils._pytree.register_pytree_node), then rewrite "
                               "again") from e
    gm = exported.module()
    _no_dtype_checks(gm)
    gm.graph.eliminate_dead_code()  # the runtime's placeholders and unused observer buffers
    gm.recompile()
    if not trainable:
        _inference_parameters(gm)
    implied = {k: v for k, v in kwargs.items() if k not in given}
    if implied:
        _drop_constant_inputs(gm, implied, args, {k: v for k, v in kwargs.items() if k in given})
    return gm


def _no_dtype_checks(gm: torch.fx.GraphModule) -> None:
    """torch.export puts a check of the captured dtype before each ``.to(...)`` of the model's code (Llama's
    RMSNorm: ``hidden_states.to(torch.float32)``; torch/_export/utils.py, the aten.to assertion pass), so that the
    op aliases or copies as it did while captured. Under ``torch.autocast`` activations arrive in autocast's dtype
    and the check failed (``Tensor dtype mismatch! Expected: Float``). The graph is functional (no op writes into
    a ``.to`` result), so the dtype part is dropped; the device and layout checks stay."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_tensor_metadata.default):
        if node.kwargs.get("dtype") is not None:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}


def _export(converted: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: dict) -> torch.export.ExportedProgram:
    """torch.export with size-1 dimensions kept symbolic (:func:`_no_size_one_specialization`). A model that hands
    a comparison of such a size to an op taking a Python bool (transformers' SDPA: ``is_causal = q_length > 1 and
    …``, then ``scaled_dot_product_attention(is_causal=<SymBool>)``, refused by torch's argument parser before any
    tracing hook sees it) cannot be captured that way: it is captured again with those dimensions fixed at the
    example's size, and a warning says how to get a graph that takes other sizes."""
    keep_size_one = _no_size_one_specialization(args, kwargs)
    try:
        with keep_size_one:
            return torch.export.export(converted, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
    except TypeError as e:
        if "SymBool" not in str(e) or isinstance(keep_size_one, contextlib.nullcontext):
            raise
        warnings.warn(f"rewrite(): {type(converted).__name__} passes a comparison of an input size of 1 to an op that "
                      f"needs a Python bool ({e}; e.g. transformers' SDPA attention, which computes is_causal from "
                      "the query length). The graph is captured with the example's dimensions of size 1 fixed at 1: "
                      "it takes only inputs with those sizes (a one-token decode step, say). For a graph of other "
                      "lengths, rewrite with an example of 2 tokens or more.", stacklevel=3)
    return torch.export.export(converted, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)


def _data_dependent_message(e: Exception) -> str:
    """What to do when the model's own Python branches on a value computed from the data."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    where = re.search(r"Caused by: \((.*?)\)", str(e))
    return ("rewrite(): the model's Python branches on a value computed from the input data ("
            + first.strip() + (f", at {where.group(1)}" if where else "") + "), which a graph cannot hold. In a "
            "mixture-of-experts block this is usually a loop that skips the experts no token was routed to "
            "(`if tok.numel() == 0: continue`): drop the branch (an expert called on zero rows computes "
            "nothing; dbr_quant's FP8 ops take empty inputs), or keep the experts as one module with 3-D "
            "weights (transformers 5 experts: one dbr_quant::fp8_moe_experts node with the routing inside). "
            "Otherwise run the converted model eagerly.")


def _drop_constant_inputs(gm: torch.fx.GraphModule, constants: dict, args: tuple, kwargs: dict) -> None:
    """Remove keyword inputs that rewrite() fixed (``use_cache=False``) from the graph's signature, so the
    graph is called — and exported again — with the caller's own arguments only."""
    for node in list(gm.graph.find_nodes(op="placeholder")):
        if node.target in constants:
            for user in list(node.users):
                user.replace_input_with(node, constants[node.target])
            gm.graph.erase_node(node)
    codegen = gm.graph._codegen
    assert isinstance(codegen, _PyTreeCodeGen), "torch.export's graphs flatten their inputs with a pytree spec"
    info = codegen.pytree_info  # the generated forward flattens its inputs by this spec
    codegen.pytree_info = info._replace(
        orig_args=[a for a in info.orig_args if a not in constants], in_spec=tree_structure((args, kwargs)))
    gm.recompile()


def _without_kv_cache(model: nn.Module, kwargs: dict) -> dict:
    """A Hugging Face model whose forward takes ``use_cache`` returns a ``DynamicCache`` object by default,
    which an exported graph cannot return (and a cache that grows per call is not a fixed graph). Unless
    the caller chose, the graph is captured with ``use_cache=False``: it computes the outputs of a full
    forward (logits / hidden states) without a KV cache. Generation with a cache stays on the eager model."""
    if "use_cache" in kwargs or "use_cache" not in inspect.signature(type(model).forward).parameters:
        return kwargs
    return {**kwargs, "use_cache": False}


def _inference_parameters(gm: nn.Module) -> None:
    """The graph is for inference: its parameters (new Parameter objects on the same storage, so the
    converted model is untouched) do not require grad. Then ``torch.compile`` with grad mode on (a script's
    default) compiles an inference graph, and the FP8 ops need no gradient formula."""
    for mod in gm.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.requires_grad:
                mod._parameters[name] = nn.Parameter(p.detach(), requires_grad=False)


def _named(model: nn.Module, dyn_args: tuple) -> dict[str, Any]:
    """export wants dynamic shapes keyed by the forward's parameter names."""
    named: dict[str, Any] = {}
    for i, p in enumerate(list(inspect.signature(type(model).forward).parameters.values())[1:]):
        if p.kind is p.VAR_POSITIONAL:  # forward(self, *xs): export sees one input `xs`, a tuple
            named[p.name] = tuple(dyn_args[i:])
            break
        if i >= len(dyn_args) or p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        named[p.name] = dyn_args[i]
    return named


class FrozenCompiled(nn.Module):
    """``torch.compile(gm, fullgraph=True)`` with inductor's freezing on, for inference.

    Freezing makes the weights compile-time constants, so inductor folds the FP8 weight upcast (on CPU,
    where no FP8 GEMM exists) and hands oneDNN/MKL pre-packed weights: the fastest CPU path, at the
    cost of bf16 (or, on the fp32 CPU GEMM path, fp32) copies of the linear weights inside the compiled
    artifact (the FP8 buffers stay in ``gm``). Dynamo reads the setting while it traces, which happens
    at the first call (and again for a new input shape), not at ``torch.compile()`` — so
    ``torch.compile(options={"freezing": True})`` does not freeze; this wrapper sets it around every
    call. Likewise the CPU GEMM path (``kernels.cpu``) current when this wrapper is made is pinned for
    its calls, so every (re)compile uses that choice. Calls run under ``torch.no_grad()`` (freezing is
    inference-only).
    """

    def __init__(self, gm: nn.Module) -> None:
        super().__init__()
        if isinstance(gm, torch.fx.GraphModule):
            # a GraphModule of its own (same weight tensors, new generated code): dynamo caches compiled
            # code per code object and does not guard on freezing, so compiling ``gm`` itself would reuse
            # (or later hand out) a non-frozen compile of the same graph
            gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        self.compiled = torch.compile(gm, fullgraph=True)
        self.cpu_gemm = current_gemm_path()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch._inductor import config as inductor_config

        with inductor_config.patch(freezing=True), torch.no_grad(), use_cpu_gemm(self.cpu_gemm), \
                gemm_path_cache_key(self.cpu_gemm):
            return self.compiled(*args, **kwargs)


def gemm_path_cache_key(path: str | None = None) -> contextlib.AbstractContextManager:
    """Key torch.compile's caches on what the lowering decides with while a graph compiles: the CPU GEMM path
    (default: the current one), whether the C kernels run and which fused GEMM they have, and this package's
    source (:func:`dbr_quant.fx_rewriter.lowering.lowering_cache_key`).

    The lowering decides bf16 or fp32 GEMMs, and which linears stay calls to the fused C GEMM, when it runs, but
    inductor's and AOTAutograd's caches (in memory and on disk, shared by every process of the user) key the
    graph before that: the same rewritten graph compiled under the other path, with the C kernels off, or by an
    older dbr_quant, would get that compile's code back (measured: an fp32-pinned compile returned the bf16
    one's outputs, at its speed; a compile with the C kernels on got the decomposed bf16 GEMM a run with
    ``DBR_QUANT_CPU_DECODE=torch`` had cached). ``compile_frozen`` does this itself; wrap the first call of your
    own ``torch.compile(rewrite(m))`` in it when you force a path (``use_cpu_gemm`` / ``$DBR_QUANT_CPU_GEMM``)
    or switch the C kernels."""
    tag = torch.compiler.config.cache_key_tag
    key = f"{tag}|{lowering_cache_key(path or current_gemm_path())}"
    return _config(torch.compiler.config).patch("cache_key_tag", key)


def compile_frozen(gm: torch.fx.GraphModule) -> FrozenCompiled:
    """Compile a rewritten graph for inference with its weights frozen (see :class:`FrozenCompiled`)."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise RewriteError(f"compile_frozen() takes the GraphModule that rewrite() returns, not {type(gm).__name__}")
    return FrozenCompiled(gm)
