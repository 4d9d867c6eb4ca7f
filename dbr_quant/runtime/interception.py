"""Interception: ``__torch_function__`` (a thread-local TorchFunctionMode) and module calls.

Both are overridden only while a prepared or converted model runs, for the calling thread only: the body
of ``nn.Module.__call__`` — ``Module._call_impl``, which the stock ``__call__`` calls — is swapped for a
dispatcher that falls through to the original unless this thread is inside a run, and the swap is
reference-counted across threads and undone on every exit path, exceptions (KeyboardInterrupt included)
too. What each intercepted call *does* is decided by the run object (``runs.py``): record it, observe
it, or execute it in FP8.

Why ``_call_impl`` and not ``__call__`` itself: assigning a dunder on ``nn.Module`` makes CPython update
the call slot of every Module subclass loaded (≈ 150 µs per swap pair with transformers imported, paid
on every forward); a plain attribute costs 0.1 µs. Tracers that wrap ``Module.__call__`` (torch.fx,
torch.export) still wrap outside us. A submodule compiled with ``Module.compile()`` bypasses
``_call_impl`` and is not intercepted (its compiled graph runs as is).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_globals
from torch.overrides import TorchFunctionMode

from dbr_quant.integrations.accelerate import has_opaque_hook


class InterceptingRun(Protocol):
    """What interception needs of a run (runtime/runs.py): where intercepted calls go, and whether they go
    there now."""

    @property
    def record(self) -> object: ...  # the model record it runs for (a nested call of the same model is inside it)

    routes_functions: bool  # whether torch functions reach the run (set by `intercepting`)

    def function_call(self, func: Any, args: tuple, kwargs: dict) -> Any: ...

    def module_call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any: ...


class _ThreadRun(threading.local):
    # the run this thread is inside (a class default: reading it unset is not a failed lookup)
    run: InterceptingRun | None = None


_tls = _ThreadRun()
_patch_lock = threading.Lock()
_patch_depth = 0
# Inside `suspended()` (torch's C guard) no torch function reaches any mode, and module calls ask this C flag
# (one call, no Python frame) whether to reach the run.
_functions_off = torch._C._is_torch_function_all_disabled
# What Module._call_impl was when we swapped it (the stock one unless someone else wraps it too). We call
# through it and put it back, rather than assuming the stock function.
_outer_call = nn.Module._call_impl


def original_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call a module the stock way (its hooks included), bypassing interception of this call."""
    return _outer_call(module, *args, **kwargs)


def _intercepting_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    run = _tls.run
    if run is None or _functions_off():  # outside a run, or inside its own work (`suspended`)
        return _outer_call(module, *args, **kwargs)
    return run.module_call(module, args, kwargs)


class _FunctionMode(TorchFunctionMode):
    """Routes every torch function called during a run to the run (the mode stack is thread-local)."""

    def __init__(self, run: InterceptingRun) -> None:
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}  # never reached inside `suspended()`: torch calls no mode there
        if _tls.run is not self.run:  # a nested run's own work (its handler runs with its mode popped, ours next)
            return func(*args, **kwargs)
        body = _OPEN_BODIES.get(func)
        if body is not None:  # torch's Python body, with this mode on again: its linears are seen one by one
            with _FunctionMode(self.run):
                return body(*args, **kwargs)
        return self.run.function_call(func, args, kwargs)


class _Globals(dict):
    """A function's globals seen through one override: lookups of other names reach the live module dict."""

    def __init__(self, module_globals: dict, **override: Any) -> None:
        super().__init__(override)
        self.module_globals = module_globals

    def __missing__(self, key: str) -> Any:
        return self.module_globals[key]


def _open_body(func: Any) -> Any:
    """A copy of a torch Python function whose ``has_torch_function`` check answers False.

    Why: a torch function that checks for overrides hands a whole call to a torch-function mode, which runs
    it with the mode popped, so nothing inside is seen: ``F.multi_head_attention_forward`` would be one
    opaque call, with its in-projection (``in_proj_weight``, most of an attention's weights) and its output
    projection inside it. Running this copy while the mode is on again lets every op inside reach the run —
    torch's own code, not a re-implementation. None (the call stays opaque) if torch's code changed shape."""
    code = getattr(func, "__code__", None)
    if code is None or "has_torch_function" not in code.co_names:
        return None
    body = types.FunctionType(code, _Globals(func.__globals__, has_torch_function=lambda *_: False),
                              func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


_OPEN_BODIES = {f: b for f in (F.multi_head_attention_forward,) if (b := _open_body(f)) is not None}

# Modules whose forward takes a fused C++ fast path (torch._transformer_encoder_layer_fwd,
# torch._native_multi_head_attention) when nothing overrides torch functions, skipping the linears inside.
# Every phase of a model that holds one runs with the mode on, so torch declines the fast path the same way
# when prepare traces, calibrate observes and the converted model runs ("some Tensor argument
# has_torch_function"). Thread-local, unlike torch.backends.mha.set_fastpath_enabled, a process-wide switch.
FAST_PATH_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)


def intercepting(run: InterceptingRun, functions: bool = True) -> AbstractContextManager[None]:
    """Route this thread's torch functions and module calls to ``run`` for the duration of the block.

    ``functions=False`` intercepts module calls only (a calibration run whose recorded ops all run as
    modules has nothing to do per torch function, and the mode's trip costs microseconds per call)."""
    return _Interception(run, functions)


class _Interception:
    """:func:`intercepting`'s block. A class rather than a generator-based context manager: it is entered once per
    forward, and a generator's frame and ``contextlib`` wrapper cost about a microsecond more, which a small
    model's forward feels. Global state (``Module._call_impl``) and this thread's run are restored on every exit
    path, a failure while entering included."""

    __slots__ = ("run", "functions", "previous", "enable", "mode")

    def __init__(self, run: InterceptingRun, functions: bool) -> None:
        self.run = run
        self.functions = functions

    def __enter__(self) -> None:
        global _patch_depth, _outer_call
        with _patch_lock:
            if _patch_depth == 0:
                _outer_call = nn.Module._call_impl
                nn.Module._call_impl = _intercepting_call  # type: ignore[method-assign, assignment]  # the point
            _patch_depth += 1
        run = self.run
        self.previous = _tls.run
        _tls.run = run
        run.routes_functions = self.functions
        self.enable = self.mode = None
        try:
            # started from code that runs as written (a run's `suspended` work, or the caller's own
            # DisableTorchFunction): this run intercepts its calls all the same
            if _functions_off():
                self.enable = torch._C._EnableTorchFunction()
                self.enable.__enter__()
            if self.functions:
                mode = _FunctionMode(run)
                mode.__enter__()
                self.mode = mode
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, typ: Any, value: Any, tb: Any) -> None:
        global _patch_depth
        try:
            try:
                if self.mode is not None:
                    self.mode.__exit__(typ, value, tb)
            finally:
                if self.enable is not None:
                    self.enable.__exit__(typ, value, tb)
        finally:
            _tls.run = self.previous
            with _patch_lock:
                _patch_depth -= 1
                if _patch_depth == 0:
                    nn.Module._call_impl = _outer_call  # type: ignore[method-assign]  # put back


@contextlib.contextmanager
def routing_functions(run: InterceptingRun) -> Iterator[None]:
    """Route torch functions to ``run`` for the block too, when its ``intercepting`` block does not already
    (a calibration run that intercepts module calls only, around a linear whose pre-hooks must run first)."""
    if run.routes_functions:
        yield
        return
    with _FunctionMode(run):
        yield


def current_run() -> InterceptingRun | None:
    """The run this thread is inside, or None."""
    return _tls.run


def is_patched() -> bool:
    """True while some thread is inside a run (tests use it to check global state is restored)."""
    return nn.Module._call_impl is _intercepting_call


# ``with suspended():`` runs the block without interception: a run's own bookkeeping and kernels, a
# recognised op's forward, a module run as written. It is torch's ``DisableTorchFunction`` itself, a C context
# manager (no Python frame to enter or leave: it is entered once or twice per op): inside it no torch function
# reaches a mode (so the kernels' many small torch calls skip the Python mode's trip, which cost more than the
# ops themselves) and ``_intercepting_call`` lets module calls run the stock way. (This is the run's one
# switch: no flag beside it to keep in step.) A run started inside it (a prepared model called by code that runs
# as written) switches torch functions on again for its forward (``intercepting``).
suspended = torch._C.DisableTorchFunction


def has_pre_hooks(module: nn.Module) -> bool:
    """Forward pre-hooks (the module's, global ones, or an accelerate hook other than its transparent device
    hooks): code that may change the module's input before its forward sees it."""
    return bool(module._forward_pre_hooks or _module_globals._global_forward_pre_hooks) or (
        "_hf_hook" in module.__dict__ and has_opaque_hook(module))


def has_global_hooks() -> bool:
    """Forward hooks registered for every module (``register_module_forward_hook``: profilers, activation
    statistics): they see every linear call, so no fast path may skip one."""
    return bool(_module_globals._global_forward_hooks or _module_globals._global_forward_pre_hooks)


def has_hooks(module: nn.Module) -> bool:
    """Forward hooks (user code that could observe the module's inputs and outputs): the module's, global ones
    (``register_module_forward_hook``: profilers, activation statistics), or an accelerate hook other than
    its device/offload hooks (those are transparent: see integrations/accelerate.py)."""
    return bool(module._forward_hooks or module._forward_pre_hooks) or has_global_hooks() or (
        "_hf_hook" in module.__dict__ and has_opaque_hook(module))


class _ThreadDisabled(threading.local):
    on = False  # a class default: reading it unset is a plain attribute hit, not a failed lookup (once per forward)


_disabled = _ThreadDisabled()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside the block, prepared and converted models run their original high-precision path."""
    before = _disabled.on
    _disabled.on = True
    try:
        yield
    finally:
        _disabled.on = before


def is_disabled() -> bool:
    return _disabled.on
