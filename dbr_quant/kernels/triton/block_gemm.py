"""Triton block-scaled FP8 linear: A-group and W-block scales applied inside the K loop.

The DeepGEMM / vLLM ``w8a8_block_fp8_matmul`` structure on the layouts of :mod:`dbr_quant.kernels.reference.block`:
x_q [M, K] with per-token-group scales [M, ⌈K/bk⌉], w_q [N, K] with block scales [⌈N/bn⌉, ⌈K/bk⌉]. Each K
step's FP8 dot (wgmma on sm_90, mma.sync on sm_89) lands in a fresh fp32 tile, which is multiplied by
``x_scale[m, kb] · w_scale[n // bn, kb]`` and added to the fp32 accumulator. BLOCK_K divides bk, so a step
never straddles two scale blocks (with BLOCK_K = bk = 128, one scale pair per step). The result matches
``reference.block.fp8_block_linear(exact=True)`` up to the order of fp32 additions.

The main loop (:func:`gemm_core.main_loop` with SCALE_K = bk) and the epilogue (:func:`gemm_core.linear_epilogue`:
bias, activation incl. gated, residual, fp32/bf16/fp16 or FP8 with a static scale) are the dense kernel's.
Every load and store is masked, so ragged M (decode M = 1), N and K (not multiples of the tile nor of the
scale block) all work. Gated activations take W as [gate; up] with each half blocked on its own: the up
half's scale rows start at ⌈N/bn⌉ (UP_SCALE_ROW).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.block import DEFAULT_BLOCK, check_block, check_block_linear_operands
from dbr_quant.kernels.triton import gemm_aot, tma_gemm
from dbr_quant.kernels.triton import gemm_core as core
from dbr_quant.kernels.triton.common import AotEntry, Kernel, cdiv

__all__ = ["AOT_CONFIGS", "BLOCK_CONFIGS", "aot_attrs", "aot_options", "fp8_block_linear", "pick_block_config"]

# As gemm.CONFIGS, with BLOCK_K = 128 for decode and medium: one scale pair per K step for 128-wide
# blocks (a 64-wide step doubles the CUDA-core scaling work; large takes it to fit its registers). Each
# step's dot needs a second fp32 tile next to the accumulator, so medium uses 8 warps (with 4: 255
# registers and a 16-byte spill on sm_89).
# smem per stage = (BLOCK_M + BLOCK_N)·128 B: decode 4 × 16 KB, medium 3 × 24 KB, large 4 × 16 KB = 64 KB
# (under Ada's 99 KB per block).
BLOCK_CONFIGS: dict[str, core.GemmConfig] = {
    "decode": core.GemmConfig("decode", 64, 64, 128, GROUP_M=8, num_warps=4, num_stages=4),
    "medium": core.GemmConfig("medium", 64, 128, 128, GROUP_M=8, num_warps=8, num_stages=3),
    # BLOCK_K 64 (two K steps per 128-wide scale block): at 128 the relu+bias+fp32-residual epilogue needed
    # 255 registers and spilled 4 B on sm_89 under triton 3.9
    "large": core.GemmConfig("large", 128, 128, 64, GROUP_M=8, num_warps=8, num_stages=4),
}
MIN_BLOCK_K = 32  # an FP8 MMA consumes K in steps of 32


def pick_block_config(m: int) -> core.GemmConfig:
    """The tile config for an output of ``m`` rows (no autotuning: must also run in the interpreter)."""
    return BLOCK_CONFIGS["decode"] if m <= 16 else BLOCK_CONFIGS["medium"] if m <= 128 else BLOCK_CONFIGS["large"]


def _fp8_block_linear_kernel(
    a_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_scale_ptr,
    M, N, K, KB, UP_SCALE_ROW,
    stride_am, stride_ak, stride_wn, stride_wk, stride_om, stride_on, stride_rm, stride_rn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
    EXP_BIAS: tl.constexpr,
):
    """out[M, N] = epilogue(Σ_kb (A[:, kb] · W[:, kb]ᵀ) · sx[m, kb] · sw[n // SCALE_N, kb]). Scales are
    contiguous fp32: sx [M, KB], sw [rows, KB]. GATED: W is [gate; up] (2N × K), both tiles in one CTA."""
    rm, rn, mask_m, mask_n = core.output_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, acc_up = core.main_loop(a_ptr, w_ptr, x_scale_ptr, w_scale_ptr, rm, rn, mask_m, mask_n, N, K, UP_SCALE_ROW,
                                 stride_am, stride_ak, stride_wn, stride_wk, KB, KB,
                                 BLOCK_M, BLOCK_N, BLOCK_K, GATED, SCALE_N, SCALE_K, PROMOTE)
    core.linear_epilogue(acc, acc_up, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_ptr, out_scale_ptr,
                         rm, rn, mask_m, mask_n, N,
                         KB, KB, stride_rm, stride_rn, stride_om, stride_on,
                         SCALE_K, ACTIVATION, GATED, HAS_BIAS, HAS_RESIDUAL, OUT_KIND,
                         FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


# M (1 when decoding), KB (1 for K ≤ 128) and UP_SCALE_ROW (1 for N ≤ 128) would each double the variants
BLOCK_LINEAR_KERNEL = Kernel(_fp8_block_linear_kernel, ("M", "KB", "UP_SCALE_ROW"))


def _tile_for_block(cfg: core.GemmConfig, bk: int, explicit: bool) -> core.GemmConfig:
    """``cfg`` with a BLOCK_K dividing the scale block's K: a config given by the caller must already have
    one; a picked one is narrowed to gcd(BLOCK_K, bk) (a variant outside AOT_CONFIGS)."""
    if bk % cfg.BLOCK_K == 0:
        return cfg
    step = math.gcd(cfg.BLOCK_K, bk)
    if explicit or step < MIN_BLOCK_K:
        raise ValueError(f"fp8_block_linear: the tile's BLOCK_K must divide the scale block's K ({bk}) and be at "
                         f"least {MIN_BLOCK_K}; got BLOCK_K={cfg.BLOCK_K}. Use a block K that is a multiple of "
                         f"{MIN_BLOCK_K} (128 in the checkpoints in use) or pass a matching config")
    return dataclasses.replace(cfg, name=f"{cfg.name}-k{step}", BLOCK_K=step)


def fp8_block_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    block: tuple[int, int] = DEFAULT_BLOCK,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    out_scale: torch.Tensor | None = None,
    out_fmt: FP8Format | str = FP8Format.E4M3,
    config: core.GemmConfig | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Block-scaled ``act(x·Wᵀ + bias) + residual`` in one kernel (see reference.block.fp8_block_linear
    for the layouts). ``out_scale`` (0-d) gives FP8 out. ``config`` overrides the tile config picked by M.
    ``kernel``: "tma", "classic" or None (automatic), as for gemm.fp8_linear."""
    gated = core.check_linear("fp8_block_linear", x_q, w_q, activation, x_scale, w_scale, bias, residual, out_scale)
    bn, bk = check_block(block)
    k, n, rows = check_block_linear_operands(x_q, x_scale, w_q, w_scale, (bn, bk), gated)
    lead = x_q.shape[:-1]
    a, w_q, m = core.linear_rows(x_q, w_q, k, residual)
    kb = math.ceil(k / bk)
    xs = core.fp32(x_scale).reshape(m, kb).contiguous()
    ws = core.fp32(w_scale).contiguous()
    b = None if bias is None else core.fp32_vector(bias, w_q.shape[0])  # the kernel indexes it by column
    ep = core.epilogue_operands(lead, m, n, residual, out_dtype, out_scale, out_fmt, a.device)
    if tma_gemm.use_tma("fp8_block_linear", kernel, a, w_q, m, config is not None, block_k=bk):
        tma_gemm.launch_linear(a, w_q, ep, xs, ws, b, n, activation, stride_xs=kb, stride_ws=kb, block=(bn, bk),
                               up_scale_row=rows, config=config)
        return ep.out.reshape(*lead, n)
    cfg = config or pick_block_config(m)
    if gated and config is None:
        cfg = cfg.gated()
    cfg = _tile_for_block(cfg, bk, explicit=config is not None)
    grid = (cdiv(m, cfg.BLOCK_M) * cdiv(n, cfg.BLOCK_N),)
    if m and n:
        BLOCK_LINEAR_KERNEL[grid](
            a, w_q, ep.out_view, xs, ws, *ep.pointers(b, xs),
            m, n, k, kb, rows,
            a.stride(0), a.stride(1), w_q.stride(0), w_q.stride(1), *ep.strides(),
            **cfg.constexprs(), SCALE_N=bn, SCALE_K=bk, **ep.constexprs(activation, b is not None),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return ep.out.reshape(*lead, n)


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compilation table: the variants the wrapper launches for 128×128 blocks

AOT_BLOCKS = ((128, 128),)


def _entry(cfg: core.GemmConfig, block: tuple[int, int], fmt_a: FP8Format, fmt_w: FP8Format, activation: str | None,
           has_bias: bool, res_dtype: str | None, out: str | FP8Format) -> AotEntry:
    return gemm_aot.linear_aot_entry("_fp8_block_linear_kernel", BLOCK_LINEAR_KERNEL, cfg, fmt_a, fmt_w, activation,
                                 has_bias, res_dtype, out, scales={"SCALE_N": block[0], "SCALE_K": block[1]},
                                 scales_desc=f"block={block[0]}x{block[1]} ")


AOT_CONFIGS: list[AotEntry] = [_entry(cfg, block, *variant) for cfg in BLOCK_CONFIGS.values() for block in AOT_BLOCKS
                               for variant in gemm_aot.linear_variants()]


def aot_options(entry: AotEntry) -> dict[str, int]:
    """``num_warps``/``num_stages`` of an AOT_CONFIGS entry (launch options, not constexprs)."""
    return gemm_aot.config_options(BLOCK_CONFIGS, entry)


def aot_attrs(entry: AotEntry) -> dict:
    """Divisibility by 16 of pointers, N, K and leading strides, as the JIT finds for aligned shapes
    (vectorized, cp.async-pipelined loads); KB and UP_SCALE_ROW are small and unaligned."""
    return gemm_aot.aligned_attrs(entry, ("N", "K", "stride_am", "stride_wn", "stride_om", "stride_rm"))
