"""Straight-through gradients for a converted model's FP8 ops (one mechanism for every kind of op).

The forward value is the FP8 one, computed without autograd. When the caller wants gradients (grad mode
on and some input or parameter of the op requires grad), the op's gradient is that of its high-precision
reference — the ops as the user wrote them, FP8 weights dequantized. So activation quantization is
straight-through (identity), the gradient flows through the dequantized weights (``grad_x = grad_y · W_dq``),
and every tensor the ops read that requires grad gets its gradient: inputs, residuals, biases, norm weights,
high-precision weights of functional linears, MoE routing weights. FP8 weights are frozen (never require grad).

Eagerly the reference runs in backward only (:class:`_Deferred`, recomputed as activation checkpointing
does): a grad-mode forward costs the FP8 one plus one autograd node per op. While ``fx_rewriter`` captures a
graph (with example inputs that require grad) the reference is captured beside the FP8 ops and joined by
``dbr_quant::straight_through`` (FP8 value, gradient to the reference): the same gradients. Inference
(``no_grad`` / ``inference_mode``) pays one grad-mode check per op. Not covered: double backward
(``create_graph``: torch's once-differentiable error), ``dbr_quant.inspect`` sessions (their layers run
as the inspector decides).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from dbr_quant.kernels import graph_ops
from dbr_quant.ops.tags import is_placeholder

_is_grad_enabled = torch._C.is_grad_enabled


@torch.library.custom_op("dbr_quant::straight_through", mutates_args=())
def straight_through_op(value: Tensor, reference: Tensor) -> Tensor:
    """``value`` (the FP8 path's output); its gradient goes to ``reference`` (a custom op, not an
    ``autograd.Function``, so ``fx_rewriter.rewrite`` captures it as one node with this gradient)."""
    return value.clone()  # an op's output may not alias its input


@straight_through_op.register_fake
def _(value: Tensor, reference: Tensor) -> Tensor:
    return torch.empty_like(value)


def _backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
    return None, grad.to(ctx.reference_dtype)


def _setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    ctx.reference_dtype = inputs[1].dtype


straight_through_op.register_autograd(_backward, setup_context=_setup_context)


def substitute(value: Any, sub: dict[int, Tensor]) -> Any:
    """``value`` with the tensors that ``sub`` maps (by id) replaced, also inside a list / tuple argument."""
    if isinstance(value, Tensor):
        return sub.get(id(value), value)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(sub.get(id(v), v) if isinstance(v, Tensor) else v for v in value)
    return value


def _tensors(calls: Sequence[Any], extra: Sequence[Any]) -> list[Tensor]:
    """The tensors the ops read: arguments (and list elements), ``extra``, and the parameters of their modules
    that require grad (a linear's bias, a norm module's weight) — each once."""
    found: dict[int, Tensor] = {}

    def add(value: Any) -> None:
        if isinstance(value, Tensor):
            found.setdefault(id(value), value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, Tensor):
                    found.setdefault(id(v), v)

    for call in calls:
        for a in call.args:
            add(a)
        for v in call.kwargs.values():
            add(v)
        if call.module is not None:
            for p in call.module._parameters.values():
                if p is not None and p.requires_grad:
                    add(p)
    for v in extra:
        add(v)
    return [t for t in found.values() if not is_placeholder(t)]


def wants_gradient(calls: Sequence[Any], extra: Sequence[Any] = ()) -> list[Tensor] | None:
    """When grad mode is on and a tensor the ``calls`` read (see :func:`_tensors`) requires grad: those
    tensors (the FP8 op must carry a gradient to them); else None (inference: one grad-mode check)."""
    if not _is_grad_enabled():
        return None
    tensors = _tensors(calls, extra)
    return tensors if any(t.requires_grad for t in tensors) else None


Reference = Callable[[dict[int, Tensor]], Any]  # the high-precision ops, given tensor substitutions by id


class _Deferred(torch.autograd.Function):
    """Eager: the FP8 value now; the reference runs only in backward (recomputed, as activation checkpointing
    does), so a grad-mode forward costs what the FP8 one does plus this node."""

    @staticmethod
    def forward(ctx: Any, fp8: Callable[[], Tensor], reference: Reference, where: Callable[[], str],
                *tensors: Tensor) -> Tensor:
        ctx.reference, ctx.where, ctx.originals = reference, where, tensors
        ctx.save_for_backward(*tensors)  # an in-place change before backward is torch's usual error
        return fp8()

    @staticmethod
    @torch.autograd.function.once_differentiable  # a double backward is torch's clear error, not a wrong value
    def backward(ctx: Any, grad: Tensor) -> tuple:
        saved = ctx.saved_tensors
        with torch.enable_grad():
            # activations are cut from the graph that made them (their gradient goes back through it once,
            # from here); leaf tensors (inputs, parameters) are used as they are
            inputs = [t if t.is_leaf else t.detach().requires_grad_(t.requires_grad) for t in saved]
            sub = {id(o): i for o, i in zip(ctx.originals, inputs) if i is not o}
            ref = ctx.reference(sub)
            _check(grad, ref, ctx.where)
            wanted = [i for i in inputs if i.requires_grad]
            grads = iter(torch.autograd.grad(ref, wanted, grad.to(ref.dtype), allow_unused=True)
                         if ref.requires_grad and wanted else [None] * len(wanted))
        return (None, None, None, *(next(grads) if i.requires_grad else None for i in inputs))


def _check(value: Any, ref: Any, where: Callable[[], str]) -> None:
    if not isinstance(ref, Tensor) or not isinstance(value, Tensor) or value.shape != ref.shape:
        shape = lambda t: tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__  # noqa: E731
        raise RuntimeError(f"dbr_quant: no straight-through gradient for {where()}: its FP8 output {shape(value)} "
                           f"and its high-precision reference {shape(ref)} differ. Run it under torch.no_grad(), or "
                           "exclude the module from quantization (QConfig override) to train through it.")


def run_straight_through(fp8: Callable[[], Tensor], reference: Reference, tensors: list[Tensor],
                         where: Callable[[], str]) -> Tensor:
    """``fp8()``'s value with the gradient of ``reference`` (see the module docstring) for ``tensors`` (from
    :func:`wants_gradient`). ``where`` names the op and module for errors. While ``fx_rewriter`` captures a
    graph the reference runs now, beside the FP8 ops, joined by ``dbr_quant::straight_through``; eagerly it
    runs in backward."""
    if graph_ops() is None:
        return _Deferred.apply(fp8, reference, where, *tensors)
    with torch.no_grad():
        value = fp8()
    ref = reference({})
    if not isinstance(ref, Tensor) or not ref.requires_grad:
        return value
    _check(value, ref, where)
    return straight_through_op(value, ref)
