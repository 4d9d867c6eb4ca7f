"""Straight-through gradients for a converted model's FP8 ops (one mechanism for every kind of op).

The forward value is the FP8 one, computed without autograd. When the caller wants gradients (grad mode
on and some input or parameter of the op requires grad), the op's high-precision reference also runs —
the ops as the user wrote them, FP8 weights dequantized — and ``dbr_quant::straight_through`` returns the
FP8 value with the reference's gradient. So activation quantization is straight-through (identity), the
gradient flows through the dequantized weights (``grad_x = grad_y · W_dq``), and every tensor the ops read
that requires grad gets its gradient: inputs, residuals, biases, norm weights, high-precision weights of
functional linears. FP8 weights themselves are frozen (they never require grad).

Cost, only on that path: the reference's forward beside the FP8 one, and what autograd keeps for backward
(as when training the high-precision model). Inference (``no_grad`` / ``inference_mode``, or nothing that
requires grad) pays one grad-mode check per op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

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


def _requires_grad(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, Tensor) and v.requires_grad for v in value)
    return False


def wants_gradient(calls: Sequence[Any], extra: Sequence[Any] = ()) -> bool:
    """Whether grad mode is on and any tensor the ``calls`` read (arguments, their modules' own parameters,
    ``extra``) requires grad: then the FP8 op must carry a gradient."""
    if not _is_grad_enabled():
        return False
    for call in calls:
        if any(_requires_grad(a) for a in call.args) or any(_requires_grad(v) for v in call.kwargs.values()):
            return True
        module = call.module
        if module is not None and any(p is not None and p.requires_grad for p in module._parameters.values()):
            return True
    return any(_requires_grad(v) for v in extra)


def run_straight_through(fp8: Callable[[], Any], reference: Callable[[], Any], where: Callable[[], str]) -> Any:
    """``fp8()``'s value with ``reference()``'s gradient (see the module docstring). ``where`` names the op
    and module for the error when the two disagree in structure."""
    with torch.no_grad():
        value = fp8()
    ref = reference()
    if not isinstance(ref, Tensor) or not ref.requires_grad:
        return value
    if not isinstance(value, Tensor) or value.shape != ref.shape:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise RuntimeError(f"dbr_quant: no straight-through gradient for {where()}: its FP8 output {shape} and "
                           f"its high-precision reference {tuple(ref.shape)} differ. Run it under torch.no_grad(), "
                           "or exclude the module from quantization (QConfig override) to train through it.")
    return straight_through_op(value, ref)
