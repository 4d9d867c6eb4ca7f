"""The ``triton`` / ``triton-interpret`` backend: each kernel in the table (``kernels.table``) that names a
Triton kernel (``TritonKernel``), as a function of this module with the kernel's signature that calls it.

The kernel modules are imported on first use, so CPU-only users never pay Triton's import cost (and a
missing triton package is an error that says what to do, raised when a Triton kernel is first called).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from dbr_quant.kernels.op_table import KernelOp, build_function, call_arguments
from dbr_quant.kernels.table import TABLE

_IMPORTED: dict[str, ModuleType] = {}  # kernel modules whose import finished


def _mod(module: str) -> ModuleType:
    """The kernel module named ``module`` (in full). Once imported, two dict look-ups rather than
    ``importlib.import_module`` (~0.5 µs of Python per kernel call); still in ``sys.modules``, so that a module
    removed from there is imported (or found missing) again, as importlib would."""
    imported = _IMPORTED.get(module)
    if imported is not None and sys.modules.get(module) is imported:
        return imported
    try:
        imported = _IMPORTED[module] = importlib.import_module(module)
        return imported
    except ModuleNotFoundError as e:
        if e.name != "triton" and not (e.name or "").startswith("triton."):
            raise
        raise ImportError(f"{module}: the triton backend needs the triton package, which is not "
                          "installed (pip install triton; Linux only), or run the reference backend "
                          "(kernels.use_backend('reference') / DBR_QUANT_BACKEND=reference)") from e


def _forwarder(op: KernelOp[Any]) -> Any:
    """``op``'s function here: ``_mod(module).<function>(<op's arguments>)``, one element of its result
    where the kernel computes more (``dynamic_scale``: the scale of ``dynamic_quantize``)."""
    kernel = op.triton
    assert kernel is not None
    pick = "" if kernel.output is None else f"[{kernel.output}]"
    module = f"dbr_quant.kernels.triton.{kernel.module}"
    body = [f"return _mod({module!r}).{kernel.function or op.name}({call_arguments(op.parameters)}){pick}"]
    return build_function(op.name, op.parameters, body, module_globals=globals(), doc=op.doc,
                          annotations=op.declaration.__annotations__)


globals().update({op.name: _forwarder(op) for op in TABLE if op.triton is not None})
