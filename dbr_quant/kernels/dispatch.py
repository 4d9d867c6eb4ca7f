"""Backend selection, launch counting and graph capture: this thread's settings that every kernel call reads.

Every kernel entry point in ``dbr_quant.kernels`` runs the backend :func:`resolve_backend` picks for its
tensors' device (``kernels._impl`` inlines the common case), records its launches with :func:`record_launch`
(so tests can assert that a fusion fired and how many kernels a forward launched), and while
:func:`capture_with` is active calls the graph op table instead of running.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.util
import os
import threading
import warnings
from collections.abc import Iterator

import torch

# "reference": plain torch, the exact FP8 semantics (kernels/reference); "cpu": the same semantics computed fast
# (kernels/cpu/backend.py, C kernels and bf16/fp32 GEMMs); "triton"(-interpret): the GPU kernels. Plus "auto" (the
# default): chosen per device (resolve_backend).
BACKENDS = ("reference", "cpu", "triton", "triton-interpret")
ENV_VAR = "DBR_QUANT_BACKEND"

class _ThreadSettings(threading.local):
    """Per-thread settings with class-level defaults: reading an unset one is a plain attribute hit, not a
    failed lookup (``getattr(local, name, None)`` on a bare ``threading.local`` costs ≈ 1 µs per miss, and
    every kernel call reads two or three of them)."""

    backend: str | None = None
    graph_ops = None
    counters: tuple = ()
    # True while none of the three above is set on this thread (no backend forced, no graph captured, no launches
    # counted): then an entry point reads this one setting, not three (kept in step by `_changed_setting`)
    all_default: bool = True


_tls = _ThreadSettings()


def _changed_setting() -> None:
    """After any change of this thread's settings: recompute ``all_default`` from them."""
    _tls.all_default = _tls.backend is None and _tls.graph_ops is None and not _tls.counters


_env_cache: list = []  # [value] once read: the variable is read on the first kernel call, not per call


def _env_backend() -> str | None:
    if _env_cache:
        return _env_cache[0]
    name = os.environ.get(ENV_VAR)
    if name is None or name == "":
        _env_cache.append(None)
        return None
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={name!r} is not a backend; use one of {BACKENDS}")
    _env_cache.append(name)
    return name


def current_backend() -> str:
    """The backend asked for: the innermost ``use_backend`` block, else $DBR_QUANT_BACKEND, else "auto"."""
    forced = _tls.backend
    if forced is not None:
        return forced
    return _env_backend() or "auto"


def fp8_tensor_cores(device: torch.device) -> bool:
    """CUDA devices of compute capability 8.9 (Ada) or newer have FP8 tensor cores."""
    return device.type == "cuda" and _capability(device) >= (8, 9)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once per device: the automatic backend choice runs on every
    kernel call, and ``torch.cuda.get_device_capability`` reads the device's properties each time."""
    return torch.cuda.get_device_capability(device)


@functools.cache
def triton_installed() -> bool:
    """Whether the triton package can be imported (found without importing it: that costs seconds). It is an
    optional dependency: only the Triton backends need it, and it has no macOS/Windows wheels."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # an import hook refuses it, or sys.modules["triton"] is None
        return False


def resolve_backend(device: torch.device, needs_fp8_tensor_cores: bool = True) -> str:
    """The backend that runs for tensors on ``device``: an explicit choice, else ``triton`` on CUDA with
    FP8 tensor cores (when triton is installed), else ``cpu`` (the CPU, and CUDA below 8.9: FP8 storage,
    bf16 compute). A kernel that does not need FP8 tensor cores (``needs_fp8_tensor_cores=False``: the
    weight-only GEMM) gets ``triton`` on every CUDA device."""
    backend = current_backend()
    if backend != "auto":
        return backend
    if device.type != "cuda" or (needs_fp8_tensor_cores and not fp8_tensor_cores(device)):
        return "cpu"
    if triton_installed():
        return "triton"
    if fp8_tensor_cores(device):
        _warn_no_triton(device)
    return "cpu"


@functools.cache
def _warn_no_triton(device: torch.device) -> None:
    warnings.warn(f"dbr_quant.kernels: {device} has FP8 tensor cores but the triton package is not installed, so "
                  "the cpu backend (FP8 storage, bf16 compute) runs there; pip install triton for the FP8 "
                  "kernels", stacklevel=3)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the block with ``name`` as backend (thread-local; nests)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; use one of {BACKENDS}")
    with _thread_setting("backend", name):
        yield


@contextlib.contextmanager
def _thread_setting(name: str, value) -> Iterator[None]:
    """Set a thread-local setting for the block and restore the previous value (so blocks nest)."""
    previous = getattr(_tls, name)
    setattr(_tls, name, value)
    _changed_setting()
    try:
        yield
    finally:
        setattr(_tls, name, previous)
        _changed_setting()


def record_launch(kernel: str) -> None:
    """Count one launch of ``kernel`` in every active ``count_launches`` block of this thread."""
    for counter in _tls.counters:
        counter[kernel] += 1


@contextlib.contextmanager
def count_launches() -> Iterator[collections.Counter]:
    """``with count_launches() as counts:`` → ``counts[kernel_name]`` launches inside the block."""
    counter: collections.Counter = collections.Counter()
    stack = _tls.counters
    _tls.counters = (*stack, counter)
    _changed_setting()
    try:
        yield counter
    finally:
        _tls.counters = stack
        _changed_setting()


def graph_ops():
    """The op table that kernel entry points call instead of running, while a graph is being captured
    (``dbr_quant.fx_rewriter`` installs its ``torch.library`` custom ops here), else None."""
    return _tls.graph_ops


@contextlib.contextmanager
def capture_with(ops) -> Iterator[None]:
    """Within the block, kernel entry points call ``ops.<name>(...)`` (graph leaves) instead of running."""
    with _thread_setting("graph_ops", ops):
        yield
