"""Which torch functions and modules dbr_quant recognises, and what kind of op each one is.

Quantizeable kinds run in FP8 after convert. Fusable kinds are never quantized themselves; they can
join a subgraph (a fusion) behind a quantizeable op. Adding an op = one line in FUNC_KINDS (and, for a
new quantizeable kind, an executor in ``ops.basic``). See docs/extending.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbr_quant.quantize.weights import FP8Weight

LINEAR = "linear"
MATMUL = "matmul"
SDPA = "sdpa"
NORM = "norm"
ACT = "act"
ADD = "add"
MUL = "mul"
DIV = "div"
SOFTMAX = "softmax"
PASSTHROUGH = "passthrough"  # dropout in eval, same-dtype casts: identity inside a fused subgraph

QUANTIZEABLE = frozenset({LINEAR, MATMUL, SDPA})
# ops that get an index in their module's record (so a later forward can be matched against the trace)
INDEXED = QUANTIZEABLE | {NORM}

FUNC_KINDS: dict[object, str] = {
    F.linear: LINEAR,
    torch.matmul: MATMUL,
    Tensor.matmul: MATMUL,
    Tensor.__matmul__: MATMUL,
    torch.bmm: MATMUL,
    Tensor.bmm: MATMUL,
    F.scaled_dot_product_attention: SDPA,
    F.layer_norm: NORM,
    F.rms_norm: NORM,
    F.relu: ACT,
    torch.relu: ACT,
    Tensor.relu: ACT,
    F.gelu: ACT,
    F.silu: ACT,
    torch.add: ADD,
    Tensor.add: ADD,
    Tensor.__add__: ADD,
    Tensor.__radd__: ADD,
    torch.mul: MUL,
    Tensor.mul: MUL,
    Tensor.__mul__: MUL,
    Tensor.__rmul__: MUL,
    torch.div: DIV,
    Tensor.div: DIV,
    Tensor.__truediv__: DIV,
    F.softmax: SOFTMAX,
    torch.softmax: SOFTMAX,
    Tensor.softmax: SOFTMAX,
    F.dropout: PASSTHROUGH,
    Tensor.to: PASSTHROUGH,
    Tensor.contiguous: PASSTHROUGH,
}


# matmuls whose second operand can be a linear's weight: ``x @ W`` = ``F.linear(x, Wᵀ)`` for a 2-D W
MATMUL_AS_LINEAR = frozenset({torch.matmul, Tensor.matmul, Tensor.__matmul__})


def is_weight_operand(t: object) -> bool:
    """A 2-D parameter, a view of one (``A.t()``, ``W[:E]``), or a converted FP8 weight (or a view of one)."""
    return isinstance(t, Tensor) and t.dim() == 2 and (
        type(t) is FP8Weight or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter))


def call_kind(func: object, args: tuple, kwargs: dict) -> str | None:
    """The kind of a torch function call (FUNC_KINDS), except that an activation × parameter matmul (a LoRA
    written ``x @ A.t() @ B.t()``, ``torch.matmul(x, self.w)``) is a LINEAR whose weight is the parameter,
    transposed: every phase classifies the call the same way, so the trace's record matches at run time."""
    kind = FUNC_KINDS.get(func)
    if kind == MATMUL and func in MATMUL_AS_LINEAR and len(args) > 1 and is_weight_operand(args[1]) \
            and isinstance(args[0], Tensor) and not is_weight_operand(args[0]):
        return LINEAR
    return kind


def activation_name(func: object, args: tuple, kwargs: dict) -> str | None:
    """The epilogue name of an activation call (relu, gelu, gelu_tanh, silu)."""
    if func in (F.relu, torch.relu, Tensor.relu):
        return "relu"
    if func is F.silu:
        return "silu"
    if func is F.gelu:
        approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
        return "gelu_tanh" if approximate == "tanh" else "gelu"
    return None


def is_passthrough(func: object, args: tuple, kwargs: dict) -> bool:
    """True when the call returns its input unchanged (eval dropout, a cast to the same dtype)."""
    if func is F.dropout:
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        return not training or p == 0
    if func is Tensor.contiguous:
        return True
    if func is Tensor.to:
        x = args[0]
        rest = list(args[1:]) + list(kwargs.values())
        return all((r == x.dtype) or (r is None) for r in rest) and len(rest) > 0
    return False


def is_device_move(args: tuple, kwargs: dict) -> bool:
    """``Tensor.to(device)`` (optionally ``non_blocking``): a move that changes neither dtype nor layout. When it
    returns its input it moved nothing; accelerate's device hooks do such moves at every module boundary."""
    rest = args[1:]
    if len(rest) > 1 or set(kwargs) - {"device", "non_blocking"} or (rest and "device" in kwargs):
        return False
    return isinstance(rest[0], (str, int, torch.device)) if rest else "device" in kwargs


def is_linear_module(module: nn.Module) -> bool:
    """A module that computes ``x·Wᵀ + b``: an nn.Linear with the stock forward (subclasses with their own
    forward stay opaque), or Hugging Face's ``Conv1D`` (GPT-2), which stores W transposed. A weight that is no
    parameter of its own (``nn.utils.parametrizations.weight_norm`` computes it per call) stays opaque too: its
    forward's ``F.linear`` is recorded as a functional linear."""
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward and "weight" in module._parameters
    return _is_hf_conv1d(module)


def is_transposed_linear(module: nn.Module) -> bool:
    """Hugging Face ``Conv1D`` stores its weight as (in_features, out_features)."""
    return _is_hf_conv1d(module)


def _is_hf_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.") and hasattr(module, "nf")


def rms_norm_module_eps(module: nn.Module) -> float | None:
    """eps of a Hugging Face-style RMSNorm module (LlamaRMSNorm and kin: weight · x/√(mean x² + eps) written
    as elementwise ops), else None. The tracer also checks it numerically against F.rms_norm."""
    if isinstance(module, nn.RMSNorm) or not type(module).__name__.endswith("RMSNorm") or module._modules:
        return None
    weight = module._parameters.get("weight")
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if weight is None or weight.dim() != 1 or len(module._parameters) != 1 or not isinstance(eps, float):
        return None
    return eps


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The high-precision weight of a linear module as (out_features, in_features)."""
    w = module._parameters["weight"]
    assert w is not None, "a linear module's weight parameter (mappings.is_linear_module)"
    return w.t() if _is_hf_conv1d(module) else w


def linear_bias(module: nn.Module) -> torch.Tensor | None:
    """The bias of a linear module (its parameter; None when it has none)."""
    params = module._parameters
    return params["bias"] if "bias" in params else getattr(module, "bias", None)


def is_container(module: nn.Module) -> bool:
    """Containers whose iteration/len user code relies on: their state is kept out of ``_modules``."""
    return isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))
