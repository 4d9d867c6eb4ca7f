"""E4M3 on the CPU in one pass of C, compiled on first use: the exact upcast to fp32 / bf16 (optionally times
a scale per row) and the saturating quantize; torch ops as the fallback.

Why: on the CPU backend (:mod:`dbr_quant.kernels.cpu.backend`) every GEMM upcasts its FP8 weight per call (no
high-precision copy is kept), and every quantized activation goes through ``x · (1/s)``, a clamp and torch's FP8
cast. In torch the upcast needs four passes (at batch 1 it cost more than the GEMM: 1536×384 ≈ 580 µs to fp32, ≈ 250
µs to bf16 on one Zen 4 core; the loop below ≈ 70-80 µs for either, ``benchmarks/upcast.py``; its AVX-512 / AVX2
paths, through the hardware fp16 → fp32 conversion, are 2.5× faster than its portable loop), and torch's FP8 cast is
scalar code (≈ 150 µs for 32 sentences' 1536-wide MiniLM activation), three passes before it. Here each is one
vectorized pass.

The C file (``csrc/e4m3.c``, package data) has no dependencies (no torch headers), so it builds in well under a
second with the system C compiler and is called through ctypes (which releases the GIL: threads serving the model
run in parallel). Large passes split over torch's thread count with OpenMP, built against the OpenMP runtime file
torch ships and loaded (one thread team for both; at 2 threads here: MiniLM, 32 sentences, bf16 path, FP8 / fp32
0.82 → 0.76); where torch has no GNU OpenMP, or the compiler none, each pass runs on one thread. It is compiled with
``-march=native`` into a cache keyed by the source, the compiler and this CPU's feature flags, so a cache shared
between different machines never hands one a binary it cannot run (:mod:`dbr_quant.kernels.cpu.build`: the compiler
from ``$CC``, with arguments; a failed build remembered; a read-only cache falls back to a per-user temp folder). No
compiler, a failed build, or ``DBR_QUANT_CPU_DECODE=torch`` → the torch path, with one warning where the kernels
were wanted (``features.describe()`` says which runs, and why). The torch path gives the same bits for every
quantize and upcast; a small linear (:func:`small_linear`) sums in k order here and in torch's GEMM order there, so
its fp32 outputs differ by rounding (within the dot product's error bound).

Subnormals are decoded by an int → float conversion and quantized by an exact ×2⁹ and a round-to-integer,
never by scaling a subnormal float, so the bits do not depend on the denormals-are-zero mode
(``torch.set_flush_denormal``). E4M3's NaN code comes out as ±480 from the upcast, exactly as the torch
fast path (NaN input is unsupported on the fast paths); the quantize keeps NaN (code 0x7F with its sign),
like torch's cast.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from pathlib import Path

import torch

from dbr_quant.kernels.cpu import build as cpu_build

ENV_VAR = "DBR_QUANT_CPU_DECODE"  # "torch" forces the fallback; "c" (default) uses the compiled loop

SOURCE = Path(__file__).parent / "csrc" / "e4m3.c"  # package data: shipped in the wheel, compiled on first use
# compiled as one translation unit after e4m3.c (it uses that file's decode and OpenMP set-up)
GEMM_SOURCE = Path(__file__).parent / "csrc" / "fp8_gemm.c"

# -ffp-contract=off: a·b + c stays two roundings (no FMA), so results do not depend on the CPU having FMA
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")
_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None (unavailable / disabled); "why": status()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() + platform.machine()


def _torch_openmp() -> Path | None:
    """The GNU OpenMP runtime torch loaded (Linux wheels ship it in torch/lib), to build against: the library
    then shares torch's thread team instead of starting a second OpenMP runtime. None elsewhere (another
    runtime, or none): the library is built single-threaded."""
    found = sorted(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*"))
    return found[0] if found else None


def _build(march: str = "native") -> tuple[ctypes.CDLL | None, str]:
    """(the library for ``-march=<march>``, found in the cache or compiled, and where from) or (None, why not):
    ``native`` in use; tests also build other targets (e.g. ``x86-64-v3``: AVX2 without AVX-512; ``x86-64``: the
    portable loops) to check every code path on any machine. Warns once where this call found a new reason
    the kernels are unavailable (a remembered failed build stays quiet: cpu.describe() tells)."""
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in _FLAGS)
    try:
        # read here, not at import: only a process that builds or loads needs it
        source = SOURCE.read_text() + "\n" + GEMM_SOURCE.read_text()
    except OSError as e:
        outcome = cpu_build.Outcome(None, f"the C source is missing from this installation ({e}); reinstall "
                                          "dbr_quant", news=True)
    else:
        outcome = cpu_build.build(source, flags, [_cpu_flags()], _torch_openmp())
    if outcome.path is None:
        if outcome.news:
            warnings.warn(f"dbr_quant: the C E4M3 kernels are unavailable: {outcome.reason}. Using the slower torch "
                          f"ops; set {ENV_VAR}=torch to choose them without this warning.", RuntimeWarning,
                          stacklevel=4)
        return None, outcome.reason
    lib = ctypes.CDLL(str(outcome.path))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("dbr_e4m3_to_fp32", "dbr_e4m3_to_bf16"):
        getattr(lib, name).argtypes = [ptr, ptr, i64]
    for name in ("dbr_e4m3_to_fp32_scaled", "dbr_quantize_e4m3_fp32", "dbr_quantize_e4m3_bf16"):
        getattr(lib, name).argtypes = [ptr, ptr, i64, i64, ptr, i64]  # src, dst, rows, cols, scale, scale stride
    lib.dbr_small_linear.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int32, i64, i64, i64, ptr, ptr,
                                     ptr]
    lib.dbr_set_parallel_min.argtypes = [i64]
    # x, is bf16, codes, rows, cols, per token, scales
    lib.dbr_dynamic_quantize_e4m3.argtypes = [ptr, ctypes.c_int32, ptr, i64, i64, ctypes.c_int32, ptr]
    lib.dbr_dynamic_quantize_e4m3.restype = None
    # x, x scale, its stride, w, w scale, its stride, bias, M, N, K, mode, y
    lib.dbr_fp8_gemm.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, ctypes.c_int32, ptr]
    lib.dbr_fp8_gemm.restype = ctypes.c_int
    lib.dbr_fp8_gemm_isa.argtypes = []
    lib.dbr_fp8_gemm_isa.restype = ctypes.c_int
    for name in ("dbr_e4m3_to_fp32", "dbr_e4m3_to_bf16", "dbr_e4m3_to_fp32_scaled", "dbr_quantize_e4m3_fp32",
                 "dbr_quantize_e4m3_bf16", "dbr_small_linear", "dbr_set_parallel_min"):
        getattr(lib, name).restype = None
    return lib, outcome.reason


def library() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None when disabled or unavailable (:func:`status` says why)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                mode = os.environ.get(ENV_VAR, "c").strip().lower()
                if mode not in ("c", "torch"):
                    raise ValueError(f"{ENV_VAR}={mode!r}: use 'c' (compiled decoder) or 'torch'")
                lib, why = None, f"disabled by {ENV_VAR}=torch"
                if mode == "c":
                    try:
                        lib, why = _build()
                    except OSError as e:  # the built file would not load (another machine's, truncated)
                        why = f"the built library would not load ({e})"
                        warnings.warn(f"dbr_quant: the C E4M3 kernels are unavailable: {why}; using the slower "
                                      "torch ops.", RuntimeWarning, stacklevel=2)
                _state["why"] = why
                _state["lib"] = lib
    return _state["lib"]  # type: ignore[return-value]


def status() -> tuple[bool, str]:
    """(whether the C kernels run, why: where the library came from, or why the torch ops run instead); builds
    the library if no call has yet."""
    lib = library()
    return lib is not None, str(_state["why"])


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


def dynamic_quantize_e4m3(x: torch.Tensor, per_token: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reference's ``dynamic_quantize`` for E4M3 (the scale from the amax of each row, or of the tensor,
    non-finite values ignored, through ``formats.safe_scale``; then the quantize), bit for bit, in one C call
    that reads each row twice while it is in cache (the torch ops: ~10 passes and as many dispatches). ``x``
    fp32 or bf16. None when the C library is unavailable or the input is of another kind."""
    lib = library()
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or not _plain_cpu(x) or x.dim() == 0 \
            or x.numel() == 0:
        return None
    cols = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty((*x.shape[:-1], 1) if per_token else (), dtype=torch.float32)
    lib.dbr_dynamic_quantize_e4m3(x.data_ptr(), int(x.dtype == torch.bfloat16), out.data_ptr(), x.numel() // cols,
                                  cols, int(per_token), scale.data_ptr())
    return out, scale


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


def _scale_strides(x_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, n: int) -> tuple[int, int] | None:
    """(x scale stride, w scale stride) for a C linear: ``x_scale`` one fp32 value or one per row of ``x_q``,
    ``w_scale`` one fp32 value or one per output channel (n,), both readable raw; None otherwise."""
    xs = _rows(x_q, x_scale)
    if xs is None or w_scale.dtype != torch.float32 or not _raw_cpu(w_scale):
        return None
    if w_scale.numel() == 1 and w_scale.dim() <= 1:
        return xs[2], 0
    return (xs[2], 1) if w_scale.shape == (n,) else None


SMALL = 4096  # the C buffers' size: both operands of small_linear hold at most this many elements
_ACTIVATIONS = {None: 0, "relu": 1}  # the ones whose C result is torch's bit for bit


def tail_in_c(x_q: torch.Tensor, w_q: torch.Tensor, activation: str | None, residual: torch.Tensor | None,
              out_dtype: torch.dtype, out_scale: torch.Tensor | None, out_e4m3: bool) -> bool:
    """Whether :func:`small_linear` computes this epilogue itself; else the caller runs it in torch on the C
    call's fp32 result (same bits: each step is the same fp32 operation either way)."""
    if activation not in _ACTIVATIONS:
        return False
    if residual is not None and (residual.dtype != torch.float32 or not _raw_cpu(residual) or w_q.dim() != 2
                                 or residual.shape != (*x_q.shape[:-1], w_q.shape[0])):
        return False
    if out_scale is not None:
        return out_e4m3 and out_scale.numel() == 1 and out_scale.dtype == torch.float32 and _raw_cpu(out_scale)
    return out_dtype == torch.float32


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
    strides = _scale_strides(x_q, x_scale, w_scale, n)
    if strides is None:
        return None
    shape = (*x_q.shape[:-1], n)
    for t, want in ((bias, (n,)), (residual, shape)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != want or not _raw_cpu(t)):
            return None
    y = torch.empty(shape, dtype=torch.float8_e4m3fn if out_scale is not None else torch.float32)
    null = None
    lib.dbr_small_linear(x_q.data_ptr(), x_scale.data_ptr(), strides[0], w_q.data_ptr(), w_scale.data_ptr(), strides[1],
                         null if bias is None else bias.data_ptr(), null if residual is None else residual.data_ptr(),
                         _ACTIVATIONS[activation], x_q.numel() // k, n, k,
                         null if out_scale is not None else y.data_ptr(),
                         y.data_ptr() if out_scale is not None else null,
                         null if out_scale is None else out_scale.data_ptr())
    return y


# what dbr_fp8_gemm_isa() returns → the code path (csrc/fp8_gemm.c's header describes each)
GEMM_ISAS = ("portable C", "AVX2-FMA", "AVX-512F FMA", "AVX512-BF16 vdpbf16ps")


def gemm_isa() -> str | None:
    """The fused GEMM's code path in the library built for this CPU; None without the C library."""
    if "isa" not in _state:
        lib = library()
        _state["isa"] = None if lib is None else GEMM_ISAS[lib.dbr_fp8_gemm_isa()]
    return _state["isa"]  # type: ignore[return-value]


def gemm_tiles_any_batch() -> bool:
    """Whether the fused GEMM is the fast one at every batch (the BF16 build's VNNI tiles), not only at
    decode-sized batches (its in-register GEMV)."""
    return gemm_isa() == GEMM_ISAS[3]


# Which linears the CPU backend runs on the fused GEMM. The bf16 GEMM path's (scales on the fp32 sum, the
# reference's order; no bf16 rounding of the result): every batch where the library has its AVX512-BF16 tiles (as
# fast as oneDNN's bf16 GEMM on decoded weights, without the decode passes), else at most FUSED_GEMV_ROWS rows
# (the FMA tiles lose to torch's GEMM on larger batches; at decode size the kernel reads 1 byte per weight, not
# 1 + 2 + 2). The fp32 GEMM path's: none (FUSED_FP32_ROWS): it keeps torch's fp32 GEMM on operands dequantized
# first at every batch, compressed-tensors' own sum, so transformers reproduces a saved checkpoint's linears bit for
# bit (tests/checkpoints/test_transformers_load.py, tests/kernels/test_cpu_gemm.py). The kernel's DEQUANTIZE_FIRST
# order (built and tested) would run its decode-sized batches 2-4× faster, at the price of that promise.
FUSED_GEMV_ROWS = 4
FUSED_FP32_ROWS = 0


def fused_rows(bf16_path: bool) -> int:
    """The most activation rows an FP8 linear runs on :func:`fp8_gemm` for, on the bf16 or the fp32 GEMM path."""
    if not bf16_path:
        return FUSED_FP32_ROWS
    return 1 << 62 if gemm_tiles_any_batch() else FUSED_GEMV_ROWS


def describe_fused() -> str:
    """One line for benchmark and demo output: the fused GEMM's code path and which linears it runs."""
    isa = gemm_isa()
    if isa is None:
        return "fused FP8 GEMM: unavailable (no C library)"
    rows = fused_rows(True)
    on = "every batch" if rows > 1 << 40 else f"batches of <= {rows} rows"
    return (f"fused FP8 GEMM (E4M3 decoded in the K loop): {isa}; runs the bf16 path's linears at {on}; the fp32 "
            "path keeps torch's fp32 GEMM on dequantized operands")


SCALES_FIRST, DEQUANTIZE_FIRST = 0, 1  # fp8_gemm's orders: scales on the fp32 sum (the reference's), or operands


def fp8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, order: int) -> torch.Tensor | None:
    """``x_q·x_scale @ (w_q·w_scale)ᵀ + bias`` in fp32 with the E4M3 weight decoded inside the GEMM's K loop
    (``csrc/fp8_gemm.c``; never written out at full width): ``order`` :data:`SCALES_FIRST` sums the exact
    products and scales the sum (the reference's order), :data:`DEQUANTIZE_FIRST` sums products of the operands
    dequantized first (compressed-tensors' order, the fp32 GEMM path's). Either sum runs in the kernel's own
    order, within the dot product's fp32 error bound of a torch GEMM's. ``x_scale``: one value or one per row;
    ``w_scale``: one value or one per output channel (N,); ``bias`` fp32 (N,). Inference only (no autograd).
    None when the call does not fit (other dtypes or layouts, no C library): the caller's torch path."""
    lib = library()
    if lib is None or x_q.dtype != torch.float8_e4m3fn or w_q.dtype != torch.float8_e4m3fn or w_q.dim() != 2 \
            or x_q.dim() == 0 or not (_raw_cpu(x_q) and _raw_cpu(w_q)):
        return None
    n, k = w_q.shape
    if x_q.shape[-1] != k or n == 0 or k == 0 or x_q.numel() == 0:
        return None
    strides = _scale_strides(x_q, x_scale, w_scale, n)
    if strides is None:
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not _raw_cpu(bias)):
        return None
    y = torch.empty((*x_q.shape[:-1], n), dtype=torch.float32)
    if lib.dbr_fp8_gemm(x_q.data_ptr(), x_scale.data_ptr(), strides[0], w_q.data_ptr(), w_scale.data_ptr(), strides[1],
                        None if bias is None else bias.data_ptr(), x_q.numel() // k, n, k, order, y.data_ptr()) != 0:
        raise MemoryError(f"kernels.cpu.fp8_gemm: no memory for the decode buffers of a {x_q.numel() // k}×{n}×{k} "
                          "FP8 linear; free memory or run smaller batches")
    return y
