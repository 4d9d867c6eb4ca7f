"""The ``triton`` / ``triton-interpret`` backend: each kernel in the table (``kernels.table``) that names a
Triton kernel (``TritonKernel``), as a function of this module with the kernel's signature that calls it.

The kernel modules are imported on first use, so CPU-only users never pay Triton's import cost (and a
missing triton package is an error that says what to do, raised when a Triton kernel is first called).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from dbr_quant.kernels.op_table import KernelOp, build_function, call_arguments
from dbr_quant.kernels.table import TABLE


def _mod(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"dbr_quant.kernels.triton.{name}")
    except ModuleNotFoundError as e:
        if e.name != "triton" and not (e.name or "").startswith("triton."):
            raise
        raise ImportError(f"dbr_quant.kernels.triton.{name}: the triton backend needs the triton package, which is not "
                          "installed (pip install triton; Linux only), or run the reference backend "
                          "(kernels.use_backend('reference') / DBR_QUANT_BACKEND=reference)") from e


def _forwarder(op: KernelOp[Any]) -> Any:
    """``op``'s function here: ``_mod(module).<function>(<op's arguments>)``, one element of its result
    where the kernel computes more (``dynamic_scale``: the scale of ``dynamic_quantize``)."""
    kernel = op.triton
    assert kernel is not None
    pick = "" if kernel.output is None else f"[{kernel.output}]"
    body = [f"return _mod({kernel.module!r}).{kernel.function or op.name}({call_arguments(op.parameters)}){pick}"]
    return build_function(op.name, op.parameters, body, module_globals=globals(), doc=op.doc,
                          annotations=op.declaration.__annotations__)


globals().update({op.name: _forwarder(op) for op in TABLE if op.triton is not None})
