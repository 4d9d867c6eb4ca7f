"""The CPU GEMM path: which dtype the CPU backend (:mod:`dbr_quant.kernels.cpu.backend`) upcasts FP8 operands to
before its GEMMs.

No CPU has an FP8 GEMM, so the CPU backend upcasts FP8 operands (exactly: every FP8 value is a
bf16 and an fp32 value) and runs a GEMM with fp32 accumulation in one of two dtypes:

* ``bf16``: half the operand bytes; the GEMM result is rounded once to bf16 (relative ≤ 2⁻⁸). Fast only
  where the CPU has BF16 dot products (AVX512-BF16 or AMX); elsewhere oneDNN emulates it, several
  times slower than fp32 (a 480×384×1536 matmul on an AVX-512 Xeon: bf16 14 ms, fp32 2 ms).
* ``fp32``: the GEMM result is fp32 (only the accumulation's own fp32 rounding).

The choice: the innermost :func:`use_cpu_gemm` block (thread-local; tests), else ``$DBR_QUANT_CPU_GEMM``
(``bf16`` | ``fp32`` | ``auto``; read once per process), else auto: bf16 where the CPU has native BF16
dot products, fp32 otherwise (detected once per process). Devices other than the CPU keep bf16 (the CPU backend
on CUDA below compute capability 8.9).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import TypedDict

import torch

from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3

GEMM_PATHS = ("bf16", "fp32")  # plus "auto" (the default): chosen from the CPU's features
ENV_VAR = "DBR_QUANT_CPU_GEMM"
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class _ThreadSettings(threading.local):
    """This thread's ``use_cpu_gemm`` choice. A class default, not ``getattr(local, name, None)``: a miss on
    a plain ``threading.local`` raises and catches AttributeError, ~5× the cost of a hit, on every GEMM."""

    cpu_gemm: str | None = None


_tls = _ThreadSettings()

# /proc/cpuinfo flags worth printing next to a timing (the ones that decide how fast a GEMM can be)
_SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                "amx_bf16", "amx_fp16", "sve", "bf16", "i8mm")


def _torch_check(name: str) -> bool:
    """torch's own CPUID checks (private API, so guarded: a missing one counts as absent)."""
    check = getattr(torch.cpu, name, None)
    return bool(check()) if check is not None else False


class CpuFeatures(TypedDict):
    capability: str  # torch's ATen vector capability, e.g. "AVX512"
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool
    cpuinfo_flags: list[str]  # the _SHOWN_FLAGS that /proc/cpuinfo lists


@functools.cache
def cpu_features() -> CpuFeatures:
    """What this CPU offers, as torch sees it (its ATen vector capability and CPUID checks) plus the
    relevant ``/proc/cpuinfo`` flags where that file exists (Linux)."""
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86 / aarch64
                    present = set(line.split(":", 1)[1].split())
                    flags = [flag for flag in _SHOWN_FLAGS if flag in present]
                    break
    except OSError:
        pass
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "avx2": _torch_check("_is_avx2_supported"),
        "avx512": _torch_check("_is_avx512_supported"),
        "avx512_bf16": _torch_check("_is_avx512_bf16_supported"),
        "amx": _torch_check("_is_amx_tile_supported"),
        "cpuinfo_flags": flags,
    }


def native_bf16_dot() -> bool:
    """True where bf16 GEMMs run on BF16 dot-product instructions (AVX512-BF16 or AMX), not emulated."""
    f = cpu_features()
    return bool(f["avx512_bf16"] or f["amx"])


def detected_gemm_path() -> str:
    """What ``auto`` picks on this CPU: bf16 with native BF16 dot products, else fp32."""
    return "bf16" if native_bf16_dot() else "fp32"


def _parse_env(value: str | None) -> str:
    if value is None or value == "" or value == "auto":
        return "auto"
    if value not in GEMM_PATHS:
        raise ValueError(f"{ENV_VAR}={value!r} is not a CPU GEMM path; use one of {(*GEMM_PATHS, 'auto')}")
    return value


@functools.cache
def _process_default() -> tuple[str, str]:
    """(path, why) from ``$DBR_QUANT_CPU_GEMM`` or the CPU's features, read once per process (at the first
    GEMM: every GEMM asks, so the lookup stays off the per-op path). Tests re-read with ``cache_clear()``."""
    requested = _parse_env(os.environ.get(ENV_VAR))
    if requested != "auto":
        return requested, f"forced by {ENV_VAR}={requested}"
    return detected_gemm_path(), "auto: " + ("native" if native_bf16_dot() else "no native") + " BF16 dot products"


def current_gemm_path() -> str:
    """The CPU GEMM path that runs now, "bf16" or "fp32": the innermost ``use_cpu_gemm`` block, else
    ``$DBR_QUANT_CPU_GEMM`` (read once), else auto (bf16 with native BF16 dot products, else fp32)."""
    forced = _tls.cpu_gemm
    if forced is None:
        return _process_default()[0]
    return detected_gemm_path() if forced == "auto" else forced


def gemm_dtype(on: torch.Tensor | torch.device) -> torch.dtype:
    """The dtype the CPU backend upcasts FP8 operands to for a GEMM on the device of ``on`` (a
    tensor, or a device)."""
    if not (on.is_cpu if isinstance(on, torch.Tensor) else on.type == "cpu"):
        return torch.bfloat16
    return _DTYPES[current_gemm_path()]


@contextlib.contextmanager
def use_cpu_gemm(path: str) -> Iterator[None]:
    """Run the block with CPU GEMMs in ``path`` ("bf16", "fp32" or "auto"; thread-local; nests).
    A compiled graph keeps the path it was compiled with (see fx_rewriter.compile_frozen)."""
    if path not in (*GEMM_PATHS, "auto"):
        raise ValueError(f"use_cpu_gemm: unknown CPU GEMM path {path!r}; use one of {(*GEMM_PATHS, 'auto')}")
    previous, _tls.cpu_gemm = _tls.cpu_gemm, path
    try:
        yield
    finally:
        _tls.cpu_gemm = previous


def describe() -> str:
    """Three lines for benchmark and demo output: the GEMM path that runs, why, and the CPU features seen; whether
    the C E4M3 kernels run (else why not: torch ops take their place); the fused FP8 GEMM's code path."""
    c_active, c_why = cpu_e4m3.status()
    forced = _tls.cpu_gemm
    if forced is None:
        path, why = _process_default()
    else:
        path, why = current_gemm_path(), f"use_cpu_gemm({forced!r})"
    f = cpu_features()
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    flags = " ".join(f["cpuinfo_flags"]) or "n/a"
    return (f"CPU GEMM path: {path} ({why}); CPU: torch capability {f['capability']}, avx512_bf16 "
            f"{yes(f['avx512_bf16'])}, amx {yes(f['amx'])}, avx512 {yes(f['avx512'])}, avx2 {yes(f['avx2'])}; "
            f"/proc/cpuinfo flags: {flags}\nC E4M3 kernels: {'active' if c_active else 'inactive, torch ops instead'} "
            f"({c_why})\n{cpu_e4m3.describe_fused()}")
