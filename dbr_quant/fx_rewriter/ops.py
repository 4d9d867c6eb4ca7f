"""``torch.library`` ops (namespace ``dbr_quant``, registered by ``oplib.define``): the FP8 kernels as opaque
graph leaves, generated from the kernel table (``kernels.table``).

For every kernel whose arguments all have a graph form (:data:`GRAPH_FORMS`), three functions with the
kernel's parameters are generated:

* the op's body: the arguments back in their Python form, then the kernel's entry point (``kernels.<name>``),
  so the graph runs the same kernel dispatch as eager;
* its fake: the declaration's output rule (shape and dtype only), so ``torch.export`` and ``torch.compile``
  trace the op as a single node;
* its capture-time entry in :class:`GraphOps`, the table that kernel entry points call while a graph is
  captured (see ``kernels.dispatch.capture_with``): the arguments in their graph form, then the op.

A gradient reaching any op is a clear error (``oplib``): straight-through gradients go around them, through
``dbr_quant::straight_through`` (ops/straight_through.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from dbr_quant import kernels  # noqa: F401  (the generated op bodies call kernels.<name>)
from dbr_quant.formats import FP8Format
from dbr_quant.fx_rewriter.lowering import ensure_lowerings
from dbr_quant.fx_rewriter.moe_ops import graph_fp8_moe_experts, graph_fp8_moe_gated
from dbr_quant.fx_rewriter.oplib import define
from dbr_quant.kernels.cpu import upcast
from dbr_quant.kernels.op_table import KernelOp, build_function, call_arguments, positional
from dbr_quant.kernels.table import TABLE


@dataclasses.dataclass(frozen=True)
class GraphForm:
    """How a kernel argument (its annotation in ``kernels.table``) crosses into a graph op: the type in the
    op's schema (what ``torch.library.infer_schema`` reads) and the expressions, ``{}`` the argument, that
    convert it into and out of the graph."""

    schema: Any
    to_graph: str = "{}"
    from_graph: str = "{}"


GRAPH_FORMS = {
    "Tensor": GraphForm(Tensor),
    "Tensor | None": GraphForm(Optional[Tensor]),  # noqa: UP045  (the typing form: infer_schema's table has it)
    "torch.dtype": GraphForm(torch.dtype),
    "bool": GraphForm(bool),
    "int": GraphForm(int),
    "float": GraphForm(float),
    "float | None": GraphForm(Optional[float]),  # noqa: UP045
    "FP8Format": GraphForm(str, "_format_name({})", "_format({})"),
    "str | None": GraphForm(str, '{} or ""', "{} or None"),  # an activation: None is "" in a graph
    "tuple[int, int]": GraphForm(list[int], "list({})", "tuple({})"),
}
GRAPH_RESULTS = {"Tensor": Tensor, "tuple[Tensor, Tensor]": tuple[Tensor, Tensor],
                 "tuple[Tensor, Tensor, Tensor]": tuple[Tensor, Tensor, Tensor]}
NO_GRAPH_FORM = {"MoeRouting"}  # data-dependent row counts: the MoE experts op (moe_ops.py) holds the routing

_FORMATS = {f.value: f for f in FP8Format}


def _format(name: str) -> FP8Format:
    """The format an op's ``fmt`` string names (a dict look-up: this runs on every op call)."""
    fmt = _FORMATS.get(name)
    return fmt if fmt is not None else FP8Format.parse(name)


def _format_name(fmt: FP8Format | str) -> str:
    return FP8Format.parse(fmt).value


def _has_graph_form(op: KernelOp[Any]) -> bool:
    annotations = [p.annotation for p in op.parameters]
    if any(a in NO_GRAPH_FORM for a in annotations):
        return False
    unknown = [a for a in [*annotations, op.signature.return_annotation]
               if a not in GRAPH_FORMS and a not in GRAPH_RESULTS]
    if unknown:
        raise TypeError(f"dbr_quant.fx_rewriter.ops: kernel {op.name} has arguments of types {unknown}, which have no "
                        "graph form; add them to GRAPH_FORMS / GRAPH_RESULTS (or NO_GRAPH_FORM: then no graph op)")
    return True


def _define(op: KernelOp[Any]) -> None:
    """The op, its fake and its GraphOps entry for kernel ``op`` (see the module docstring)."""
    params = op.parameters
    forms = {p.name: GRAPH_FORMS[p.annotation] for p in params}
    python_args = call_arguments(params, lambda p: forms[p.name].from_graph.format(p.name))
    schema = {p.name: forms[p.name].schema for p in params} | {"return": GRAPH_RESULTS[op.signature.return_annotation]}
    body = build_function(op.name, positional(params), [f"return kernels.{op.name}({python_args})"],
                          module_globals=globals(), annotations=schema, doc=op.doc)
    fake = build_function(op.name, positional(params), ["ensure_lowerings()", f"return _rule({python_args})"],
                          module_globals=globals(), bound={"_rule": op.declaration})
    define(op.name)(body).register_fake(fake)
    graph_args = call_arguments(params, lambda p: forms[p.name].to_graph.format(p.name), positional=True)
    capture = build_function(op.name, params, [f"return _op({graph_args})"], module_globals=globals(),
                             bound={"_op": getattr(torch.ops.dbr_quant, op.name)})
    setattr(GraphOps, op.name, staticmethod(capture))


class GraphOps:
    """Kernel entry points → custom ops (what ``kernels.*`` call while a graph is captured): one entry per
    kernel with a graph op (added below, from the table), and the whole MoE experts call (moe_ops.py; with the
    module's own gate function: two ops, the gate between them)."""

    fp8_moe_experts = staticmethod(graph_fp8_moe_experts)
    fp8_moe_gated = staticmethod(graph_fp8_moe_gated)


for _op in TABLE:
    if _has_graph_form(_op):
        _define(_op)


@define("fp8_to_bf16")
def fp8_to_bf16(q: Tensor) -> Tensor:
    """Exact FP8 → bf16 upcast (the CPU backend's bit moves). Not emitted by rewrite(): the inductor
    lowering of fp8_linear calls it for weights, whose upcast inductor's own code does 10× slower."""
    return upcast.fp8_to_bf16(q)


@fp8_to_bf16.register_fake
def _(q):
    ensure_lowerings()
    return torch.empty_like(q, dtype=torch.bfloat16)


@define("fp8_to_fp32")
def fp8_to_fp32(q: Tensor) -> Tensor:
    """Exact FP8 → fp32 upcast (bit moves), for the fp32 CPU GEMM path; used like ``fp8_to_bf16``."""
    return upcast.fp8_to_fp32(q)


@fp8_to_fp32.register_fake
def _(q):
    ensure_lowerings()
    return torch.empty_like(q, dtype=torch.float32)
