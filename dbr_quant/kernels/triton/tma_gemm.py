"""Hopper (sm_90) FP8 linear: TMA loads through tensor descriptors and a persistent tile schedule.

The dense (:mod:`gemm`) and the block-scaled (:mod:`block_gemm`) linears launch this kernel instead of
their own on sm_90 for large M (:func:`use_tma`); elsewhere (sm_89, small M, unaligned operands, the
interpreter unless asked) they keep their kernels. One kernel serves both: ``SCALE_K == 0`` is the dense
path (per-tensor/row/channel scales applied once in the epilogue), ``SCALE_K > 0`` the block-scaled one.

What changes against the pointer kernels, learned from Triton's tutorial 09-persistent-matmul.py
(``matmul_kernel_tma_persistent``, host-side ``triton.tools.tensor_descriptor.TensorDescriptor``):

* A and W tiles arrive by TMA (``cp.async.bulk.tensor``): one thread issues a whole tile copy into
  swizzled shared memory, no address arithmetic nor masks in registers. The descriptor's bounds replace
  the masks: rows past M or the W rows, and K past K, are filled with zeros by the hardware. A gate tile
  whose last columns run past N reads up rows there; those output columns are masked at the store.
* Persistent: ``min(tiles, SMs)`` programs each walk tiles ``pid, pid + programs, …`` in
  :func:`gemm_core.grouped_tile` order, so the launch fills the GPU once and the next tile's loads
  overlap the current tile's epilogue (``tl.range(..., flatten=True)`` software-pipelines across tiles).
* The descriptors are built on the host (no ``triton.set_allocator``, no global memory for them): the
  driver passes them as ``__grid_constant__`` kernel parameters. Triton 3.6 to 3.9 take the same
  ``tensordesc<fp8e4nv[BM, BK]>`` signature, and the interpreter runs them (3.7; 3.6's interpreter
  cannot iterate ``tl.range`` over tensor bounds, so interpreter tests need the pinned Triton).

The epilogue is :func:`gemm_core.linear_epilogue`, as in every other linear. Each dense step's dot is
promoted to the fp32 accumulator (``max_num_imprecise_acc=BLOCK_K``, see :func:`gemm_core.main_loop`).
TMA needs 16-byte aligned bases and row strides: a K-contiguous FP8 operand with K % 16 == 0.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator

import torch
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.dense import GATED
from dbr_quant.kernels.triton import gemm_aot
from dbr_quant.kernels.triton import gemm_core as core
from dbr_quant.kernels.triton.common import AotEntry, Kernel, cdiv, device_function, on_interpreter

__all__ = ["AOT_CONFIGS", "KERNEL_CHOICES", "TMA_CONFIGS", "TMA_MIN_ROWS", "aot_attrs", "aot_options",
           "forced_kernel", "launch_linear", "may_use_tma", "tma_config", "use_tma"]

@dataclasses.dataclass(frozen=True)
class TmaConfig(core.GemmConfig):
    """A tile config plus ``flatten``: whether ``tl.range`` software-pipelines across tiles (the next tile's
    TMA loads overlap this tile's epilogue) or only within a tile's K loop (fewer live registers); and
    ``epilogue_halves``: the epilogue on the tile's two column halves, one after the other (fewer live registers)."""

    flatten: bool = True
    epilogue_halves: bool = False

    def constexprs(self) -> dict[str, int]:
        return {**super().constexprs(), "FLATTEN": self.flatten, "EPILOGUE_HALVES": self.epilogue_halves}

    def gated(self) -> TmaConfig:
        """The same tile: its BLOCK_N is already the gated width (see TMA_CONFIGS)."""
        return dataclasses.replace(self, name=self.name + "-gated")


# 128×64 output tiles, 8 warps (two consumer warpgroups of 64×64 wgmma: 32 accumulator registers a thread,
# 64 when gated), BLOCK_K 128 = one 128-byte swizzled TMA row per operand row and one scale pair per step for
# 128-wide scale blocks; smem 4 stages × (128 + 64) × 128 B = 96 KB. Gated kernels keep the tile (two
# accumulators). 128×128 tiles spill: the epilogue (gemm_core.linear_epilogue) on 64 values a thread needs
# 255+ registers for gelu + bias + fp32 residual + fp16 out (12 B spilled under triton 3.6, also with 3
# stages, BLOCK_K 64 or 4 warps on 128×64 / 64×128); 128×64 with 8 warps needs 150.
#
# "tma-wide" (dense, ungated linears: the q/k/v, o and down projections, fc1 + GELU) is the FP8 tile of Triton's
# tutorial 09-persistent-matmul.py narrowed to what our epilogue fits: 128×128×128, 8 warps, 4 stages, pipelined
# across tiles (flatten), the epilogue run on two 128×64 halves (the tutorial's EPILOGUE_SUBTILE). It halves the
# shared-memory reads per FLOP of the 128×64 tile and matches the pointer kernel's large tile, which measured faster
# than the 128×64 TMA tile (README "Measured on a GPU"). ptxas (triton 3.7.1, sm_90), heaviest epilogues: 150–180
# registers, 0 spills; without the halves 255 registers and 16 B spilled (gelu + fp32 residual + fp32 out).
# Gated tiles of this size reach 255 registers even with the halves and block-scaled gated ones spill ~0.8 KB, so
# those keep "tma". Not yet timed on a GPU: benchmarks/gpu.py's TMA column runs it (forced_kernel("tma")), and
# AUTO_TMA stays off until a GPU run measures it faster than the pointer kernel.
TMA_CONFIGS: dict[str, core.GemmConfig] = {
    "tma": TmaConfig("tma", 128, 64, 128, GROUP_M=8, num_warps=8, num_stages=4, flatten=False),
    "tma-wide": TmaConfig("tma-wide", 128, 128, 128, GROUP_M=8, num_warps=8, num_stages=4, flatten=True,
                          epilogue_halves=True),
}
# Rows above which sm_90 would take the TMA kernel automatically: the pointer kernels' "large" range
# (gemm.pick_config). Below it a 128-row tile is mostly padding and decode GEMVs are bound by streaming W.
TMA_MIN_ROWS = 128
# Whether the automatic choice takes the TMA kernel at all. Measured on an H100 (make gpu-check, 2026-11-26,
# triton 3.6, benchmarks/gpu.py section 1): this 128×64 tile was slower than the pointer kernel in 24 of the
# 25 GEMM rows (Llama-3-8B qkv at M = 8192: 0.853 vs 0.727 ms; 70B gate_up M = 8192: 12.0 vs 11.1 ms), so it
# runs only when asked for (``kernel="tma"`` / :func:`forced_kernel`) until a tile beats the pointer kernel.
AUTO_TMA = False
TMA_ALIGN = 16  # bytes: TMA descriptors need 16-byte aligned base addresses and strides
KERNEL_CHOICES = ("tma", "classic")  # what forced_kernel / the wrappers' ``kernel=`` accept (None: automatic)

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("dbr_quant_gemm_kernel", default=None)


@contextlib.contextmanager
def forced_kernel(kernel: str | None) -> Iterator[None]:
    """Within the block, the dense and block-scaled linears launch ``kernel`` ("tma": this module's, on any
    device where it compiles, "classic": the pointer kernels) unless a call passes ``kernel=`` itself;
    ``None`` restores the automatic choice. For benchmarks that time both through the op table."""
    if kernel is not None and kernel not in KERNEL_CHOICES:
        raise ValueError(f"forced_kernel: unknown kernel {kernel!r}; use one of {KERNEL_CHOICES} or None")
    token = _forced.set(kernel)
    try:
        yield
    finally:
        _forced.reset(token)


def tma_config(gated: bool, block_scaled: bool) -> core.GemmConfig:
    """The TMA tile a linear launches when no ``config`` is given: "tma-wide" for dense ungated linears,
    "tma" for gated or block-scaled ones (whose wide tiles spill; see TMA_CONFIGS)."""
    return TMA_CONFIGS["tma" if gated or block_scaled else "tma-wide"]


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def _num_programs(device: torch.device) -> int:
    """One program per SM; the interpreter runs programs one after another, so 3 make each walk several tiles."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3


def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D operand TMA can read: unit stride along K, 16-byte aligned base and row stride."""
    return (t.stride(1) == 1 and t.data_ptr() % TMA_ALIGN == 0
            and (t.stride(0) * t.element_size()) % TMA_ALIGN == 0)


def may_use_tma(kernel: str | None) -> bool:
    """False when :func:`use_tma` is False whatever the operands: automatic choice (no ``kernel``, none forced)
    while AUTO_TMA is off. Lets a wrapper skip preparing what only the TMA kernel needs."""
    return kernel is not None or AUTO_TMA or _forced.get() is not None


def use_tma(op: str, kernel: str | None, a: torch.Tensor, w: torch.Tensor, m: int, config_given: bool,
            block_k: int = 0) -> bool:
    """Whether ``op`` launches the TMA kernel for A = ``a`` (m × K) and W = ``w``.

    ``kernel`` ("tma", "classic" or None; None defers to :func:`forced_kernel`, then chooses): automatic is
    the pointer kernel while AUTO_TMA is off (measured slower, see there); with it on, TMA on sm_90 when
    m > TMA_MIN_ROWS, both operands are TMA-ready, no pointer-kernel ``config`` was
    given and (block-scaled) the scale block's K is a multiple of the TMA tile's BLOCK_K. A forced "tma"
    that cannot run raises instead of silently timing the other kernel."""
    kernel = kernel if kernel is not None else _forced.get()
    if kernel is None and not AUTO_TMA:  # decided without looking at the operands (this runs on every launch)
        return False
    if kernel is not None and kernel not in KERNEL_CHOICES:
        raise ValueError(f"{op}: unknown kernel {kernel!r}; use one of {KERNEL_CHOICES} or None")
    if kernel == "classic":
        return False
    ready = _tma_ready(a) and _tma_ready(w)
    if kernel == "tma":
        if not ready:
            raise ValueError(f"{op}: kernel='tma' needs K-contiguous FP8 operands with 16-byte aligned bases and "
                             f"row strides (K % 16 == 0); got strides {a.stride()} and {w.stride()}. Use "
                             "kernel=None to fall back to the pointer kernel")
        return True
    return (AUTO_TMA and not on_interpreter() and not config_given and m > TMA_MIN_ROWS and ready
            and _is_sm90(a.device)
            and (block_k == 0 or block_k % TMA_CONFIGS["tma"].BLOCK_K == 0))


# ---------------------------------------------------------------------------------------------------
# device side


@device_function
def tma_main_loop(a_desc, w_desc, a_scale_ptr, w_scale_ptr, off_m, off_n, a_rows, cols, mask_m, mask_n,
                  N, K, UP_SCALE_ROW, stride_sa, stride_sw,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                  SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, PROMOTE: tl.constexpr):
    """:func:`gemm_core.main_loop` with TMA loads: ``acc = A[off_m:, :] · W[off_n:, :]ᵀ`` (and, GATED,
    ``acc_up`` from W rows ``off_n + N``) over K in BLOCK_K steps, scales as there (SCALE_K > 0: per block,
    applied to each step's dot; else after the loop, by the epilogue). ``a_rows``/``cols`` and their masks
    index the block scales only: the descriptors zero-fill what lies outside the operands."""
    if SCALE_K > 0:
        sa_ptrs = a_scale_ptr + a_rows * stride_sa
        sw_ptrs = w_scale_ptr + (cols // SCALE_N) * stride_sw
        sw_up_ptrs = w_scale_ptr + (cols // SCALE_N + UP_SCALE_ROW) * stride_sw
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if GATED:
        acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    else:
        acc_up = acc
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        off_k = k * BLOCK_K
        a = a_desc.load([off_m, off_k])
        w = w_desc.load([off_n, off_k])
        if SCALE_K > 0:
            kb = off_k // SCALE_K
            sa = tl.load(sa_ptrs + kb, mask=mask_m, other=0.0)
            acc += tl.dot(a, w.T) * sa[:, None] * tl.load(sw_ptrs + kb, mask=mask_n, other=0.0)[None, :]
            if GATED:
                sw_up = tl.load(sw_up_ptrs + kb, mask=mask_n, other=0.0)
                acc_up += tl.dot(a, w_desc.load([off_n + N, off_k]).T) * sa[:, None] * sw_up[None, :]
        elif PROMOTE:
            acc = tl.dot(a, w.T, acc, max_num_imprecise_acc=BLOCK_K)
            if GATED:
                acc_up = tl.dot(a, w_desc.load([off_n + N, off_k]).T, acc_up, max_num_imprecise_acc=BLOCK_K)
        else:  # the whole K sum in the tensor core (GemmConfig.promote)
            acc = tl.dot(a, w.T, acc)
            if GATED:
                acc_up = tl.dot(a, w_desc.load([off_n + N, off_k]).T, acc_up)
    return acc, acc_up


def _fp8_linear_tma_kernel(
    a_desc, w_desc, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_scale_ptr,
    M, N, K, UP_SCALE_ROW, NUM_PROGRAMS,
    stride_om, stride_on, stride_rm, stride_rn, stride_xs, stride_ws,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE: tl.constexpr,
    FLATTEN: tl.constexpr, EPILOGUE_HALVES: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
    EXP_BIAS: tl.constexpr,
):
    """out[M, N] = epilogue(A · Wᵀ) for every tile ``pid, pid + NUM_PROGRAMS, …``; A and W are TMA
    descriptors with blocks [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K]. Scales: SCALE_K == 0 → per
    tensor/row/channel through strides stride_xs/stride_ws (0: per tensor); SCALE_K > 0 → per block,
    sx [M, KB] and sw [rows, KB] with stride_xs = stride_ws = KB (as block_gemm's kernel)."""
    tiles = ((M + BLOCK_M - 1) // BLOCK_M) * ((N + BLOCK_N - 1) // BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = core.grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        mask_m = rm < M
        mask_n = rn < N
        acc, acc_up = tma_main_loop(a_desc, w_desc, x_scale_ptr, w_scale_ptr, off_m, off_n, rm, rn, mask_m, mask_n,
                                    N, K, UP_SCALE_ROW, stride_xs, stride_ws,
                                    BLOCK_M, BLOCK_N, BLOCK_K, GATED, SCALE_N, SCALE_K, PROMOTE)
        if EPILOGUE_HALVES:  # the epilogue on two BLOCK_M × BLOCK_N/2 halves (tutorial 09's EPILOGUE_SUBTILE):
            # half the epilogue's live values, so a 128×128 tile's heaviest epilogue fits in registers
            acc_left, acc_right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            up_left, up_right = tl.split(tl.permute(tl.reshape(acc_up, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            rn_left = off_n + tl.arange(0, BLOCK_N // 2)
            rn_right = rn_left + BLOCK_N // 2
            core.linear_epilogue(acc_left, up_left, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_ptr,
                                 out_scale_ptr, rm, rn_left, mask_m, rn_left < N, N,
                                 stride_xs, stride_ws, stride_rm, stride_rn, stride_om, stride_on,
                                 SCALE_K, ACTIVATION, GATED, HAS_BIAS, HAS_RESIDUAL, OUT_KIND,
                                 FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)
            core.linear_epilogue(acc_right, up_right, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_ptr,
                                 out_scale_ptr, rm, rn_right, mask_m, rn_right < N, N,
                                 stride_xs, stride_ws, stride_rm, stride_rn, stride_om, stride_on,
                                 SCALE_K, ACTIVATION, GATED, HAS_BIAS, HAS_RESIDUAL, OUT_KIND,
                                 FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)
        else:
            core.linear_epilogue(acc, acc_up, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_ptr, out_scale_ptr,
                                 rm, rn, mask_m, mask_n, N,
                                 stride_xs, stride_ws, stride_rm, stride_rn, stride_om, stride_on,
                                 SCALE_K, ACTIVATION, GATED, HAS_BIAS, HAS_RESIDUAL, OUT_KIND,
                                 FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


# M (1 when decoding), UP_SCALE_ROW, the program count and the scale strides (0, 1 or KB) would each
# multiply the variants if specialized
TMA_LINEAR_KERNEL = Kernel(_fp8_linear_tma_kernel, ("M", "UP_SCALE_ROW", "NUM_PROGRAMS", "stride_xs", "stride_ws"))


# ---------------------------------------------------------------------------------------------------
# host side


def launch_linear(a: torch.Tensor, w_q: torch.Tensor, ep: core.EpilogueOperands, xs: torch.Tensor,
                  ws: torch.Tensor, bias: torch.Tensor | None, n: int, activation: str | None, *,
                  stride_xs: int, stride_ws: int, block: tuple[int, int] = (1, 0), up_scale_row: int = 0,
                  config: core.GemmConfig | None = None) -> None:
    """Launch the TMA kernel for ``ep.out = epilogue(a · w_qᵀ)`` (a: m × K, w_q: rows × K, both TMA-ready),
    with the operands the dense/block wrapper prepared. ``block`` = (SCALE_N, SCALE_K): (1, 0) dense."""
    m, k = a.shape
    cfg = config or tma_config(activation in GATED, block[1] > 0)
    if not isinstance(cfg, TmaConfig):  # a plain tile config: pipelined within tiles only, as the default
        cfg = TmaConfig(**dataclasses.asdict(cfg), flatten=False)
    if block[1] % cfg.BLOCK_K:
        raise ValueError(f"TMA linear: BLOCK_K={cfg.BLOCK_K} must divide the scale block's K ({block[1]})")
    if not (m and n):
        return
    programs = min(cdiv(m, cfg.BLOCK_M) * cdiv(n, cfg.BLOCK_N), _num_programs(a.device))
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [cfg.BLOCK_M, cfg.BLOCK_K])
    w_desc = TensorDescriptor(w_q, [w_q.shape[0], k], [w_q.stride(0), 1], [cfg.BLOCK_N, cfg.BLOCK_K])
    TMA_LINEAR_KERNEL[(programs,)](
        a_desc, w_desc, ep.out_view, xs, ws, *ep.pointers(bias, xs),
        m, n, k, up_scale_row, programs,
        *ep.strides(), stride_xs, stride_ws,
        **cfg.constexprs(), SCALE_N=block[0], SCALE_K=block[1], **ep.constexprs(activation, bias is not None),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compilation table: sm_90 only (the dispatcher never picks this kernel elsewhere)


def _descriptor(fmt: FP8Format, rows: int, cols: int) -> str:
    return f"tensordesc<{gemm_aot.PTR[fmt].removeprefix('*')}[{rows}, {cols}]>"


def _entry(cfg: core.GemmConfig, block: tuple[int, int] | None, fmt_a: FP8Format, fmt_w: FP8Format,
           activation: str | None, has_bias: bool, res_dtype: str | None, out: str | FP8Format) -> AotEntry:
    """One row: the linear entry of :func:`gemm_core.linear_aot_entry` with descriptors for A and W."""
    scales: dict[str, object] = {"SCALE_N": block[0], "SCALE_K": block[1]} if block else {"SCALE_N": 1, "SCALE_K": 0}
    words = f"sm_90 block={block[0]}x{block[1]} " if block else "sm_90 "
    name, desc, kernel, sig, consts = gemm_aot.linear_aot_entry("_fp8_linear_tma_kernel", TMA_LINEAR_KERNEL, cfg, fmt_a,
                                                            fmt_w, activation, has_bias, res_dtype, out, scales, words)
    tile = cfg.gated() if activation in GATED else cfg  # as linear_aot_entry
    sig.update(a_desc=_descriptor(fmt_a, tile.BLOCK_M, tile.BLOCK_K),
               w_desc=_descriptor(fmt_w, tile.BLOCK_N, tile.BLOCK_K))
    params = {p.name for p in kernel.jit.params}
    return (name, desc, kernel, sig, {key: v for key, v in consts.items() if key in params})


def _launched(cfg: core.GemmConfig, block: tuple[int, int] | None, activation: str | None) -> bool:
    """Whether the wrappers launch ``cfg`` for this block and activation when no config is given (tma_config)."""
    return tma_config(activation in GATED, block is not None) is cfg


# dense (no block) and the 128x128 blocks of the checkpoints in use, each with every epilogue variant, on the
# tile tma_config gives it
AOT_CONFIGS: list[AotEntry] = [_entry(cfg, block, *variant) for cfg in TMA_CONFIGS.values()
                               for block in (None, (128, 128)) for variant in gemm_aot.linear_variants()
                               if _launched(cfg, block, variant[2])]


def aot_options(entry: AotEntry) -> dict[str, int]:
    """``num_warps``/``num_stages`` of an AOT_CONFIGS entry (launch options, not constexprs)."""
    return gemm_aot.config_options(TMA_CONFIGS, entry)


def aot_attrs(entry: AotEntry) -> dict:
    """Divisibility by 16 of pointers, N, K and the output/residual row strides, as the JIT finds for
    aligned shapes (the descriptors carry their own strides)."""
    return gemm_aot.aligned_attrs(entry, ("N", "K", "stride_om", "stride_rm"))

