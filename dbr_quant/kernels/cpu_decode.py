"""Exact E4M3 → fp32 / bf16 upcast in one pass of C, compiled on first use; torch bit moves as the fallback.

Why: on the CPU reference path every GEMM upcasts its FP8 weight per call (no high-precision copy is
kept). The torch version (:func:`reference.e4m3_to_fp32`) needs four passes over the data, and at batch 1
it costs more than the GEMM: 1536×384 takes ≈ 580 µs to fp32 and ≈ 250 µs to bf16 on one Zen 4 core,
the loop below ≈ 80 µs for either (measured with ``benchmarks/upcast.py``).

The C file has no dependencies (no torch headers), so it builds in well under a second with the system C
compiler and is called through ctypes (which releases the GIL: threads serving the model decode in
parallel). It is compiled with ``-march=native`` into a cache keyed by the source, the compiler and this
CPU's feature flags, so a cache shared between different machines never hands one a binary it cannot run.
No compiler, a failed build, or ``DBR_QUANT_CPU_DECODE=torch`` → the torch path (same bits).

Subnormals are decoded by an int → float conversion, not by scaling a subnormal float, so the result
does not depend on the denormals-are-zero mode (``torch.set_flush_denormal``). E4M3's NaN code comes out
as ±480, exactly as the torch fast path (NaN input is unsupported on the fast paths).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

ENV_VAR = "DBR_QUANT_CPU_DECODE"  # "torch" forces the fallback; "c" (default) uses the compiled loop

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* Written without branches so the compiler vectorizes the loops. One E4M3 code → its fp32 bit pattern.
   Normal codes: exponent and mantissa move up by 20 bits and the exponent is re-biased (7 → 127) by
   adding 120 << 23. Subnormal codes (exponent 0): mantissa · 2^-9
   through an exact int → float conversion. */
static inline uint32_t e4m3_bits(uint32_t c) {
    uint32_t m = c & 0x7Fu;
    uint32_t normal = (m << 20) + (120u << 23);
    float sub = (float)(int32_t)(c & 7u) * 0x1p-9f;
    uint32_t sub_bits;
    memcpy(&sub_bits, &sub, 4);
    uint32_t is_normal = 0u - (uint32_t)(m > 7u);  /* all ones for a normal code: a select, no branch */
    return (normal & is_normal) | (sub_bits & ~is_normal) | ((c & 0x80u) << 24);
}

void dbr_e4m3_to_fp32(const uint8_t *src, uint32_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = e4m3_bits(src[i]);
}

/* bf16 is the top half of fp32; E4M3's 3 mantissa bits fit in bf16's 7, so the truncation is exact. */
void dbr_e4m3_to_bf16(const uint8_t *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = (uint16_t)(e4m3_bits(src[i]) >> 16);
}
"""

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None (build failed / disabled)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() + platform.machine()


def _cache_dir() -> Path:
    base = os.environ.get("DBR_QUANT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dbr_quant")
    return Path(base)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256("\0".join([_SOURCE, cc, version, _cpu_flags()]).encode()).hexdigest()[:20]
    target = _cache_dir() / f"e4m3_decode_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "decode.c"
            src.write_text(_SOURCE)
            out = Path(tmp) / "decode.so"
            cmd = [cc, "-O3", "-march=native", "-fPIC", "-shared", "-o", str(out), str(src)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                warnings.warn(f"dbr_quant: building the C E4M3 decoder failed ({' '.join(cmd)}): "
                              f"{done.stderr.strip()[:500]}; using the slower torch upcast. Set {ENV_VAR}=torch "
                              "to silence this.", RuntimeWarning, stacklevel=3)
                return None
            os.replace(out, target)  # atomic: concurrent builders (processes) never load a half-written file
    lib = ctypes.CDLL(str(target))
    for name, out_t in (("dbr_e4m3_to_fp32", ctypes.c_void_p), ("dbr_e4m3_to_bf16", ctypes.c_void_p)):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, out_t, ctypes.c_int64]
        fn.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled decoder, built on first use; None when disabled or unavailable."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                mode = os.environ.get(ENV_VAR, "c").strip().lower()
                if mode not in ("c", "torch"):
                    raise ValueError(f"{ENV_VAR}={mode!r}: use 'c' (compiled decoder) or 'torch'")
                lib = None
                if mode == "c":
                    try:
                        lib = _build()
                    except (OSError, subprocess.SubprocessError) as e:
                        warnings.warn(f"dbr_quant: the C E4M3 decoder is unavailable ({e}); using the torch "
                                      "upcast.", RuntimeWarning, stacklevel=2)
                _state["lib"] = lib
    return _state["lib"]  # type: ignore[return-value]


def reset() -> None:
    """Read $DBR_QUANT_CPU_DECODE again and reload the decoder on next use (tests)."""
    with _lock:
        _state.clear()


def decode_e4m3(q: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``q`` (float8_e4m3fn, CPU) upcast exactly to ``dtype`` (fp32 or bf16) by the C loop, written into
    ``out`` if given; None when the C decoder is not available or ``q`` is not a plain contiguous CPU
    tensor (the caller then takes the torch path)."""
    lib = library()
    if lib is None or q.device.type != "cpu" or not q.is_contiguous() or type(q) is not torch.Tensor:
        return None
    if out is None:
        out = torch.empty(q.shape, dtype=dtype)
    fn = lib.dbr_e4m3_to_fp32 if dtype == torch.float32 else lib.dbr_e4m3_to_bf16
    fn(q.data_ptr(), out.data_ptr(), q.numel())
    return out
