"""How the ``dbr_quant::`` ops are registered: the low-level ``torch.library.Library`` API, not ``custom_op``.

A ``torch.library.custom_op`` call from eager Python costs ≈ 18 µs on top of its body on CPU (measured on
a 16×16 ``fp8_linear``: a Python autograd kernel that builds a dataclass and re-dispatches, the backend
wrapper's aliasing check, a ``torch._disable_dynamo`` wrapper), more than the whole 16×16 kernel. A rewritten
GraphModule calls one op per quantized kernel, so that overhead made rewritten eager slower than converted eager.

:func:`define` registers the same things ``custom_op`` does, with one Python frame per call on the plain path:

* the schema, inferred from the function's annotations (``torch.library.infer_schema``) — same as custom_op;
* the body as the ``CompositeExplicitAutograd`` kernel (every backend; the body dispatches by device itself);
* a fake implementation (``torch.library.register_fake``) for ``torch.compile`` / ``torch.export``;
* an ``Autograd`` kernel. With plain CPU/CUDA tensors and no input needing a gradient (the inference case,
  no_grad or not) it calls the body directly — no re-dispatch. When an input needs a gradient the op runs
  below autograd inside an ``autograd.Function`` whose backward raises the "captured for inference" error
  (straight-through gradients are built around these ops, from the high-precision reference: straight_through.py). Any
  other dispatch key below autograd (fake / functional tensors, Python modes, subclasses, conjugate views)
  takes the ordinary re-dispatch, so tracing sees the op as one node.

Under ``torch.inference_mode()`` the dispatcher skips the Autograd kernel and calls the body directly.

* an ``AutocastCPU`` / ``AutocastCUDA`` kernel: inside a ``torch.autocast`` region the op runs below autocast
  with autocast off and its result takes the dtype the op it replaces gives under autocast
  (``kernels.autocast.run_autocast``, the rule the eager converted model follows). ``torch.library.register_autocast``
  would cast the inputs instead (FP8 operands and fp32 scales included), which changes what is quantized. While
  ``torch.compile`` / ``torch.export`` trace, this kernel runs at trace time, so the graph holds the op and then
  an ordinary cast node: the compiled code does not depend on autocast's state when it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import _C

from dbr_quant.kernels.autocast import exact_arguments, parameter_index, run_autocast

LIB = torch.library.Library("dbr_quant", "FRAGMENT")  # a module global: the registrations live as long as it does

_BELOW_AUTOGRAD = _C._after_autograd_keyset
_BELOW_INPLACE_OR_VIEW = _C._after_ADInplaceOrView_keyset
_PLAIN_BACKENDS = frozenset({_C.DispatchKey.CPU, _C.DispatchKey.CUDA})
_AUTOCAST_KEYS = _C.DispatchKeySet(_C.DispatchKey.AutocastCPU) | _C.DispatchKeySet(_C.DispatchKey.AutocastCUDA)
OPS: dict[str, Op] = {}  # every op defined here, by name (tests check each one's registrations)
_plain_keysets: dict[int, bool] = {}  # DispatchKeySet.raw_repr() → nothing but a CPU/CUDA kernel below autograd


def _is_plain(keyset: _C.DispatchKeySet) -> bool:
    """Whether only a dense CPU/CUDA kernel lies below autograd (no fake / functional tensors, Python modes,
    subclasses, conjugate views): then the body can run directly. Cached: DispatchKeySet ops cost ~2 µs."""
    raw = keyset.raw_repr()
    plain = _plain_keysets.get(raw)
    if plain is None:
        plain = _plain_keysets[raw] = (keyset & _BELOW_INPLACE_OR_VIEW).highestPriorityTypeId() in _PLAIN_BACKENDS
    return plain


def no_gradient_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"dbr_quant::{name} has no gradient: this graph was captured for inference (fx_rewriter.rewrite with "
        "example inputs that do not require grad). For straight-through gradients (FP8 forward, backward "
        "through the dequantized weights) rewrite with example inputs that require grad, or run the converted "
        "model eagerly; for inference run it under torch.no_grad() / torch.inference_mode().")


class _InferenceOnly(torch.autograd.Function):
    """Runs an op below autograd; its outputs carry a grad_fn whose backward is the inference-only error
    when a gradient reaches it. None reaching it is no error: in a graph captured with straight-through
    gradients the FP8 ops run in grad mode, and ``dbr_quant::straight_through`` sends their outputs None."""

    @staticmethod
    def forward(ctx, op, keyset, *args):
        ctx.op_name = op._opname
        ctx.set_materialize_grads(False)
        with _C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _BELOW_AUTOGRAD, *args)

    @staticmethod
    def backward(ctx, *grads):
        if any(g is not None for g in grads):
            raise no_gradient_error(ctx.op_name)
        return (None,) * len(ctx.needs_input_grad)


class Op:
    """A defined op: ``Op.register_fake`` as a decorator, ``Op.default`` the ``OpOverload`` graphs call."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name, self.fn = name, fn
        schema = torch.library.infer_schema(fn, mutates_args=())
        LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        LIB.impl(name, fn, "CompositeExplicitAutograd")
        self.default = getattr(torch.ops.dbr_quant, name).default
        op = self.default

        def autograd_kernel(keyset, *args):
            if _C.is_grad_enabled() and _C._any_requires_grad(*args):
                return _InferenceOnly.apply(op, keyset, *args)
            if _is_plain(keyset):
                return fn(*args)
            with _C._AutoDispatchBelowAutograd():
                return op.redispatch(keyset & _BELOW_AUTOGRAD, *args)

        LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
        for device in ("cpu", "cuda"):
            LIB.impl(name, _autocast_kernel(name, op, device), "Autocast" + device.upper())
        OPS[name] = self

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(f"dbr_quant::{self.name}", fake, lib=LIB)
        return fake

    def __call__(self, *args):
        return self.default(*args)


def _autocast_kernel(name: str, op: torch._ops.OpOverload, device: str) -> Callable:
    """The op's kernel for ``device``'s autocast key (see the module docstring)."""
    index = parameter_index(name, "residual")

    def kernel(*args):
        exact, _ = exact_arguments(name, args, {}, device) if torch.is_autocast_enabled(device) else (args, {})

        def below() -> object:
            with _C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
                return op(*exact)

        return run_autocast(name, below, device, None if index is None else args[index])

    return kernel


def define(name: str) -> Callable[[Callable], Op]:
    """``@define("fp8_linear")`` over an annotated function: the op ``torch.ops.dbr_quant.fp8_linear``."""
    return lambda fn: Op(name, fn)
