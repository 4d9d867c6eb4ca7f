"""E4M3 on the CPU in one pass of C, compiled on first use: the exact upcast to fp32 / bf16 (optionally times
a scale per row) and the saturating quantize; torch ops as the fallback.

Why: on the CPU reference path every GEMM upcasts its FP8 weight per call (no high-precision copy is
kept), and every quantized activation goes through ``x · (1/s)``, a clamp and torch's FP8 cast. In torch
the upcast needs four passes (at batch 1 it cost more than the GEMM: 1536×384 ≈ 580 µs to fp32, ≈ 250 µs
to bf16 on one Zen 4 core; the loop below ≈ 80 µs, ``benchmarks/upcast.py``), and torch's FP8 cast is
scalar code (≈ 150 µs for 32 sentences' 1536-wide MiniLM activation), three passes before it. Here each is
one vectorized pass.

The C file has no dependencies (no torch headers), so it builds in well under a second with the system C
compiler and is called through ctypes (which releases the GIL: threads serving the model run in
parallel). It is compiled with ``-march=native`` into a cache keyed by the source, the compiler and this
CPU's feature flags, so a cache shared between different machines never hands one a binary it cannot run.
No compiler, a failed build, or ``DBR_QUANT_CPU_DECODE=torch`` → the torch path (same bits).

Subnormals are decoded by an int → float conversion and quantized by an exact ×2⁹ and a round-to-integer,
never by scaling a subnormal float, so the bits do not depend on the denormals-are-zero mode
(``torch.set_flush_denormal``). E4M3's NaN code comes out as ±480 from the upcast, exactly as the torch
fast path (NaN input is unsupported on the fast paths); the quantize keeps NaN (code 0x7F with its sign),
like torch's cast.
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

/* Per-row scaled upcast to fp32: dst = decode(src) · scale[row] (one fp32 multiply, rounded once), the operand
   a dequantize-first GEMM takes. scale_stride 0: one scale for all rows. */
void dbr_e4m3_to_fp32_scaled(const uint8_t *src, float *dst, int64_t rows, int64_t cols, const float *scale,
                             int64_t scale_stride) {
    for (int64_t r = 0; r < rows; ++r) {
        const float s = scale[r * scale_stride];
        const uint8_t *in = src + r * cols;
        float *out = dst + r * cols;
        for (int64_t i = 0; i < cols; ++i) {
            uint32_t bits = e4m3_bits(in[i]);
            float v;
            memcpy(&v, &bits, 4);
            out[i] = v * s;
        }
    }
}

/* fp32 value → E4M3 code: saturate to ±448, round to nearest even, NaN → 0x7F with its sign; equal bit for bit
   to clamp(-448, 448) followed by torch's cast. Normal results (|y| ≥ 2^-6) round in the integer domain
   (add half an ulp of the 3-bit mantissa, ties to even, then drop 20 bits; the exponent re-biases 127 → 7 by
   subtracting 120 << 3). Subnormal results are |y|·2^9 rounded to an integer (k · 2^-9, k = 0..8; 8 is the
   smallest normal code, so the two ranges meet): ×512 is exact and adding 2^23 rounds to an integer in the
   FPU's default round-to-nearest-even mode. Branch-free so the loops vectorize. */
static inline uint8_t e4m3_code(float y) {
    uint32_t b;
    memcpy(&b, &y, 4);
    uint32_t sign = (b >> 24) & 0x80u;
    uint32_t a = b & 0x7FFFFFFFu;
    uint32_t is_nan = 0u - (uint32_t)(a > 0x7F800000u);
    uint32_t c = a > 0x43E00000u ? 0x43E00000u : a;  /* saturate at 448 (infinities too) */
    uint32_t normal = ((c + 0x7FFFFu + ((c >> 20) & 1u)) >> 20) - (120u << 3);
    float cf;
    memcpy(&cf, &c, 4);
    float t = cf * 512.0f + 8388608.0f;
    uint32_t tb;
    memcpy(&tb, &t, 4);
    uint32_t code = c >= 0x3C800000u ? normal : tb - 0x4B000000u;
    code = (code & ~is_nan) | (0x7Fu & is_nan);
    return (uint8_t)(code | sign);
}

/* dst = E4M3(x · (1/scale[row])): the reciprocal once per row, as torch.reciprocal does, then one multiply. */
void dbr_quantize_e4m3_fp32(const float *x, uint8_t *dst, int64_t rows, int64_t cols, const float *scale,
                            int64_t scale_stride) {
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / scale[r * scale_stride];
        const float *in = x + r * cols;
        uint8_t *out = dst + r * cols;
        for (int64_t i = 0; i < cols; ++i) out[i] = e4m3_code(in[i] * inv);
    }
}

void dbr_quantize_e4m3_bf16(const uint16_t *x, uint8_t *dst, int64_t rows, int64_t cols, const float *scale,
                            int64_t scale_stride) {
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / scale[r * scale_stride];
        const uint16_t *in = x + r * cols;
        uint8_t *out = dst + r * cols;
        for (int64_t i = 0; i < cols; ++i) {
            uint32_t bits = (uint32_t)in[i] << 16;
            float v;
            memcpy(&v, &bits, 4);
            out[i] = e4m3_code(v * inv);
        }
    }
}

/* A small FP8 linear in one call (both operands ≤ SMALL elements, checked by the caller), where torch's per-op
   cost, not arithmetic, is the time: y[m,n] = act(Σ_k (x[m,k]·sx[m]) · (w[n,k]·sw[n]) + b[n]) + r[m,n], the
   operands dequantized first as the reference's fp32 GEMMs do, the sum in k order with every product and
   every addition rounded to fp32 (built with -ffp-contract=off: no fused multiply-adds). act: 0 none, 1 relu
   (torch's: NaN and -0 pass). Output fp32, or E4M3 codes of y·(1/so) when out_q is given. */
#define SMALL 4096
void dbr_small_linear(const uint8_t *xq, const float *xs, int64_t xs_stride, const uint8_t *wq, const float *ws,
                      int64_t ws_stride, const float *bias, const float *residual, int32_t act, int64_t M,
                      int64_t N, int64_t K, float *out, uint8_t *out_q, const float *out_scale) {
    float xd[SMALL], wd[SMALL];
    for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
            uint32_t bits = e4m3_bits(wq[n * K + k]);
            float v;
            memcpy(&v, &bits, 4);
            wd[n * K + k] = v * ws[n * ws_stride];
        }
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) {
            uint32_t bits = e4m3_bits(xq[m * K + k]);
            float v;
            memcpy(&v, &bits, 4);
            xd[m * K + k] = v * xs[m * xs_stride];
        }
    const float inv = out_q ? 1.0f / out_scale[0] : 0.0f;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; ++k) acc += xd[m * K + k] * wd[n * K + k];
            float y = bias ? acc + bias[n] : acc;
            if (act == 1) y = y < 0.0f ? 0.0f : y;
            if (residual) y += residual[m * N + n];
            if (out_q) out_q[m * N + n] = e4m3_code(y * inv);
            else out[m * N + n] = y;
        }
}
"""

# -ffp-contract=off: a·b + c stays two roundings (no FMA), so results do not depend on the CPU having FMA
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")
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
    key = hashlib.sha256("\0".join([_SOURCE, cc, version, _cpu_flags(), *_FLAGS]).encode()).hexdigest()[:20]
    target = _cache_dir() / f"e4m3_decode_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "decode.c"
            src.write_text(_SOURCE)
            out = Path(tmp) / "decode.so"
            cmd = [cc, *_FLAGS, "-o", str(out), str(src)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                warnings.warn(f"dbr_quant: building the C E4M3 decoder failed ({' '.join(cmd)}): "
                              f"{done.stderr.strip()[:500]}; using the slower torch upcast. Set {ENV_VAR}=torch "
                              "to silence this.", RuntimeWarning, stacklevel=3)
                return None
            os.replace(out, target)  # atomic: concurrent builders (processes) never load a half-written file
    lib = ctypes.CDLL(str(target))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("dbr_e4m3_to_fp32", "dbr_e4m3_to_bf16"):
        getattr(lib, name).argtypes = [ptr, ptr, i64]
    for name in ("dbr_e4m3_to_fp32_scaled", "dbr_quantize_e4m3_fp32", "dbr_quantize_e4m3_bf16"):
        getattr(lib, name).argtypes = [ptr, ptr, i64, i64, ptr, i64]  # src, dst, rows, cols, scale, scale stride
    lib.dbr_small_linear.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int32, i64, i64, i64, ptr, ptr,
                                     ptr]
    for name in ("dbr_e4m3_to_fp32", "dbr_e4m3_to_bf16", "dbr_e4m3_to_fp32_scaled", "dbr_quantize_e4m3_fp32",
                 "dbr_quantize_e4m3_bf16", "dbr_small_linear"):
        getattr(lib, name).restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None when disabled or unavailable."""
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


def _rows(x: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows, cols, scale stride) when ``scale`` is one fp32 value or one per row of ``x``'s last dim (shape
    x.shape[:-1] + (1,)), contiguous, so the C loop can index it; None for any other broadcast."""
    if scale.dtype != torch.float32 or not scale.is_cpu or type(scale) is not torch.Tensor:
        return None
    n = x.numel()
    if scale.numel() == 1 and scale.dim() <= x.dim():
        return 1, n, 0
    if x.dim() and scale.dim() == x.dim() and scale.shape[-1] == 1 and scale.shape[:-1] == x.shape[:-1] \
            and scale.is_contiguous():
        cols = x.shape[-1]
        return (n // cols if cols else 0), cols, 1
    return None


def _raw_cpu(x: torch.Tensor) -> bool:
    """A contiguous CPU tensor (or a module's parameter) the C loop may read raw."""
    return (type(x) is torch.Tensor or type(x) is torch.nn.Parameter) and x.is_cpu and x.is_contiguous()


def _plain_cpu(x: torch.Tensor) -> bool:
    """As :func:`_raw_cpu`, with no autograd to record (the quantize and upcast keep torch's graph where the
    input asks for one; their bits are the same either way)."""
    return _raw_cpu(x) and not (x.requires_grad and torch.is_grad_enabled())


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """``clamp(x.float() · (1/scale), ±448).to(float8_e4m3fn)`` in one pass (bit for bit); ``x`` fp32 or bf16,
    ``scale`` (fp32) one value or one per row. None when the C library is unavailable or the inputs are of
    another kind (the caller then takes the torch path)."""
    lib = library()
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or not _plain_cpu(x):
        return None
    shape = _rows(x, scale)
    if shape is None:
        return None
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    fn = lib.dbr_quantize_e4m3_fp32 if x.dtype == torch.float32 else lib.dbr_quantize_e4m3_bf16
    fn(x.data_ptr(), out.data_ptr(), shape[0], shape[1], scale.data_ptr(), shape[2])
    return out


def decode_e4m3_scaled(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``q.float() · scale`` (fp32; ``scale`` one value or one per row, each product rounded once) in one pass,
    written into ``out`` if given; None when the C library is unavailable or the inputs are of another kind."""
    lib = library()
    if lib is None or q.dtype != torch.float8_e4m3fn or not _plain_cpu(q):
        return None
    shape = _rows(q, scale)
    if shape is None:
        return None
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    lib.dbr_e4m3_to_fp32_scaled(q.data_ptr(), out.data_ptr(), shape[0], shape[1], scale.data_ptr(), shape[2])
    return out


SMALL = 4096  # the C buffers' size: both operands of small_linear hold at most this many elements
_ACTIVATIONS = {None: 0, "relu": 1}  # the ones whose C result is torch's bit for bit


def small_linear(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, activation: str | None, residual: torch.Tensor | None,
                 out_dtype: torch.dtype, out_scale: torch.Tensor | None, out_e4m3: bool) -> torch.Tensor | None:
    """``act(F.linear(x_q·x_scale, w_q·w_scale, bias)) + residual`` for E4M3 operands of at most :data:`SMALL`
    elements each, in one C call (sum in k order, fp32), returned in fp32 or, with ``out_scale``, as E4M3
    codes. ``x_scale``: one value or one per row; ``w_scale``: one value or one per output channel (N,).
    None when the call does not fit (other dtypes, activations, layouts): the caller's torch path. Inference
    only, like every FP8 kernel here (FP8 weights cannot require grad): a bias that requires grad is read as is
    and the result records no graph, so the numbers never depend on the grad mode."""
    lib = library()
    if lib is None or activation not in _ACTIVATIONS or x_q.dtype != torch.float8_e4m3fn \
            or w_q.dtype != torch.float8_e4m3fn or w_q.dim() != 2 or x_q.dim() == 0:
        return None
    n, k = w_q.shape
    if x_q.shape[-1] != k or not 0 < w_q.numel() <= SMALL or not 0 < x_q.numel() <= SMALL:
        return None
    if out_scale is not None:
        if not out_e4m3 or out_scale.numel() != 1 or out_scale.dtype != torch.float32 or not _raw_cpu(out_scale):
            return None
    elif out_dtype != torch.float32:
        return None
    if not (_raw_cpu(x_q) and _raw_cpu(w_q)):
        return None
    xs = _rows(x_q, x_scale)
    if xs is None or w_scale.dtype != torch.float32 or not _raw_cpu(w_scale):
        return None
    if w_scale.numel() == 1 and w_scale.dim() <= 1:
        w_stride = 0
    elif w_scale.shape == (n,):
        w_stride = 1
    else:
        return None
    shape = (*x_q.shape[:-1], n)
    for t, want in ((bias, (n,)), (residual, shape)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != want or not _raw_cpu(t)):
            return None
    y = torch.empty(shape, dtype=torch.float8_e4m3fn if out_scale is not None else torch.float32)
    null = None
    lib.dbr_small_linear(x_q.data_ptr(), x_scale.data_ptr(), xs[2], w_q.data_ptr(), w_scale.data_ptr(), w_stride,
                         null if bias is None else bias.data_ptr(), null if residual is None else residual.data_ptr(),
                         _ACTIVATIONS[activation], x_q.numel() // k, n, k,
                         null if out_scale is not None else y.data_ptr(),
                         y.data_ptr() if out_scale is not None else null,
                         null if out_scale is None else out_scale.data_ptr())
    return y
