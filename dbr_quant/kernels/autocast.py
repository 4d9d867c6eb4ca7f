"""How an FP8 kernel answers ``torch.autocast``, written once for the eager converted model and its graph.

The rule: a kernel runs with autocast off (its values are its exact result, not what autocast would make of the
backend's own torch calls), then its result takes the dtype the op it replaces gives under autocast. The GEMM
kernels replace a linear / matmul / SDPA, which autocast runs in its lower-precision dtype (torch/amp/
autocast_mode.py's op lists; aten/src/ATen/autocast_mode.h: a float64 result stays float64, an FP8 result is no
autocast dtype), and a fused residual is the model's ``y + residual`` after it: the two dtypes promoted. Every
other kernel (quantize, the fused norm + quantize, the MoE experts block, whose modules accumulate in the hidden
states' dtype: measured on transformers 5 Mixtral / Qwen2-MoE experts, which return float32 under autocast) keeps
its dtype.

Who applies it: the eager converted model runs its fused kernels through :data:`AUTOCAST_KERNELS` (an op table
for ``dispatch.capture_with``) and its MoE experts and single ops with autocast off; a rewritten graph's
``dbr_quant::`` ops carry an Autocast kernel (``fx_rewriter/oplib.py``) that calls :func:`run_autocast`, so under
``torch.compile`` / ``torch.export`` the cast is an ordinary node after the op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from dbr_quant import kernels
from dbr_quant.kernels.dispatch import capture_with
from dbr_quant.kernels.table import TABLE

__all__ = ["AUTOCAST_ELIGIBLE", "LOWER_PRECISION", "autocast_off", "autocast_result", "run_autocast",
           "AUTOCAST_KERNELS", "parameter_index", "exact_arguments"]

T = TypeVar("T")

# what autocast casts to its lower-precision dtype (aten/src/ATen/autocast_mode.h, is_autocast_eligible)
AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)
# the kernels whose result is a linear / matmul / SDPA result (the grouped GEMMs run inside the experts block)
LOWER_PRECISION = frozenset({"fp8_linear", "fp8_mlp", "fp8_matmul", "fp8_attention", "fp8_block_linear",
                             "fp8_mx_linear", "fp8_weight_only_linear"})
_LAYER_NORMS = frozenset({"layer_norm_quantize", "layer_norm_group_quantize"})
_BY_NAME = {op.name: op for op in TABLE}


def parameter_index(name: str, parameter: str) -> int | None:
    """The position of kernel ``name``'s parameter ``parameter`` (None: it has none)."""
    op = _BY_NAME.get(name)
    names = [] if op is None else [p.name for p in op.parameters]
    return names.index(parameter) if parameter in names else None


def _replace(name: str, args: tuple, kwargs: dict, parameter: str, new: Callable[[Any], Any]) -> tuple[tuple, dict]:
    """``args`` / ``kwargs`` with kernel ``name``'s ``parameter`` (positional or keyword) mapped by ``new``."""
    index = parameter_index(name, parameter)
    if index is None:
        return args, kwargs
    if index < len(args):
        return (*args[:index], new(args[index]), *args[index + 1:]), kwargs
    return (args, {**kwargs, parameter: new(kwargs[parameter])}) if parameter in kwargs else (args, kwargs)


def _float32(value: Any) -> Any:
    """A lower-precision tensor or dtype as float32; anything else (float64, FP8, None) as it is."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    return torch.float32 if value in (torch.float16, torch.bfloat16) else value


def exact_arguments(name: str, args: tuple, kwargs: dict, device: str) -> tuple[tuple, dict]:
    """Kernel ``name``'s arguments as it runs under ``device``'s autocast (see the module docstring).

    A GEMM kernel's lower-precision ``out_dtype`` (a model's activations in autocast's dtype choose it) is made
    float32: the exact result, then :func:`autocast_result`'s one cast. Same values where only that cast
    follows; with a fused residual the sum is not rounded to bf16 before it is promoted back (the residual stream
    keeps float32, as the graph captured on float32 inputs computes it). A fused LayerNorm (not RMSNorm) on CUDA
    takes float32 inputs: CUDA's autocast runs ``layer_norm`` in float32 (its fp32 op list), the CPU's does not."""
    if name in LOWER_PRECISION:
        return _replace(name, args, kwargs, "out_dtype", _float32)
    if device == "cuda" and name in _LAYER_NORMS:
        index = parameter_index(name, "rms")
        if not (args[index] if index is not None and index < len(args) else kwargs.get("rms", False)):
            for parameter in ("x", "weight", "bias"):
                args, kwargs = _replace(name, args, kwargs, parameter, _float32)
    return args, kwargs


@contextmanager
def autocast_off(device: str) -> Iterator[None]:
    """Autocast off for ``device`` inside the block (a flag, not a torch function: no tracing mode records it)."""
    was = torch.is_autocast_enabled(device)
    torch.set_autocast_enabled(device, False)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, was)


def autocast_result(name: str, out: T, dtype: torch.dtype, residual: torch.Tensor | None = None) -> T:
    """Kernel ``name``'s result ``out`` (computed with autocast off) in the dtype autocast to ``dtype`` gives the op
    it replaces (see the module docstring)."""
    if name not in LOWER_PRECISION or not isinstance(out, torch.Tensor) or out.dtype not in AUTOCAST_ELIGIBLE:
        return out
    want = dtype if residual is None else torch.promote_types(dtype, residual.dtype)
    return out if out.dtype == want else out.to(want)  # type: ignore[return-value]


def run_autocast(name: str, run: Callable[[], T], device: str, residual: torch.Tensor | None = None) -> T:
    """``run()`` (kernel ``name``) with autocast off, its result as :func:`autocast_result` says; just ``run()``
    when autocast is off for ``device``."""
    if not torch.is_autocast_enabled(device):
        return run()
    dtype = torch.get_autocast_dtype(device)
    with autocast_off(device):
        out = run()
    return autocast_result(name, out, dtype, residual)


def _device(args: tuple, kwargs: dict) -> str:
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return "cpu" if first is None else first.device.type


class _AutocastKernels:
    """The op table (``dispatch.capture_with``) through which the eager converted model runs its fused kernels
    under autocast: each entry runs the kernel's entry point by :func:`run_autocast`."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        entry = getattr(kernels, name)
        index = parameter_index(name, "residual")

        def run(*args: Any, **kwargs: Any) -> Any:
            residual = kwargs.get("residual") if index is None or index >= len(args) else args[index]
            device = _device(args, kwargs)
            if torch.is_autocast_enabled(device):
                args, kwargs = exact_arguments(name, args, kwargs, device)
            with capture_with(None):  # the entry point itself, not this table again
                return run_autocast(name, lambda: entry(*args, **kwargs), device, residual)

        return run


AUTOCAST_KERNELS = _AutocastKernels()
