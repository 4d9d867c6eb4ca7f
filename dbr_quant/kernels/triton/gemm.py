"""Triton FP8 GEMMs with fused epilogues: ``fp8_linear`` (x·Wᵀ) and batched ``fp8_matmul`` (a @ b).

Both match :mod:`dbr_quant.kernels.reference.dense` (``exact=True``): FP8 operands go straight into
``tl.dot`` (wgmma on sm_90, mma.sync on sm_89) with an fp32 accumulator, and every scale is applied once,
after the K loop, in the same order as the reference (``acc · (sx·sw)``, then bias, activation, residual).
Only the order of the fp32 additions inside the dot differs, so results agree to a few ulp of the
accumulator's magnitude. The main loop and the epilogue are :mod:`gemm_core`'s, shared with the
block-scaled and the grouped kernels.

Layout follows the Triton matmul tutorial: pointers, sizes, strides, then UPPER_CASE constexprs.
Every load and store is masked on M, N and K, so any shape works (M = 1 decode, odd K, ragged N);
scales are indexed through a stride that is 0 for a per-tensor scale, so per-tensor, per-row and
per-channel scales share one compiled kernel. Epilogue variants that change the code (activation,
gating, bias, residual, output kind) are constexprs; :data:`AOT_CONFIGS` lists every combination the
wrappers can launch, for ahead-of-time compilation and register/spill checks.
"""

from __future__ import annotations

import itertools

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.dense import ACTIVATIONS, GATED
from dbr_quant.kernels.triton import gemm_aot, tma_gemm
from dbr_quant.kernels.triton import gemm_core as core
from dbr_quant.kernels.triton.common import AotEntry, Kernel, cdiv
from dbr_quant.kernels.triton.gemm_core import GemmConfig

__all__ = [
    "AOT_CONFIGS", "CONFIGS", "GemmConfig", "aot_attrs", "aot_options", "fp8_linear", "fp8_matmul", "pick_config",
]

# Chosen by M (rows of the output, i.e. tokens). wgmma needs BLOCK_M ≥ 64 per warpgroup, so even decode
# keeps 64 rows (M = 1 wastes MMA work, but a GEMV is bound by streaming W, not by tensor-core time).
# * decode (M ≤ 16): narrow N tiles → many CTAs over N to saturate bandwidth; long K steps (128) so each
#   CTA keeps several W loads in flight. smem (4 stages) = 4·(64·128 + 128·64) B = 64 KB.
# * medium (M ≤ 128): 64×128 tiles, 3 stages = 72 KB, 8 warps (32 accumulator registers per thread). With
#   4 warps, fp8_matmul with a row-major b (P·V) on sm_89 needed 255 registers and spilled 40 B under
#   triton 3.9 (3.7: 255, no spill); with 8 warps it needs 220 (3.9) / 124 (3.7) and still does not spill
#   when capped at 192.
# * large: 128×128 tiles with 8 warps (64 fp32 accumulator registers per thread), BLOCK_K 64 so that
#   4 stages = 64 KB fit Ada's 99 KB shared-memory limit as well as Hopper's 227 KB.
# Registers (python -m dbr_quant.kernels.triton.aot; tests/kernels/test_aot.py checks the pinned triton and the
# newest release): the tight case is Ada's mma.sync with a row-major FP8 b (fp8_matmul's P·V), where
# large uses 253 of 255 registers under triton 3.9 (178 under 3.7) without spilling.
CONFIGS: dict[str, GemmConfig] = {
    "decode": GemmConfig("decode", 64, 64, 128, GROUP_M=8, num_warps=4, num_stages=4),
    "medium": GemmConfig("medium", 64, 128, 128, GROUP_M=8, num_warps=8, num_stages=3),
    "large": GemmConfig("large", 128, 128, 64, GROUP_M=8, num_warps=8, num_stages=4),
}


def pick_config(m: int) -> GemmConfig:
    """The block config for an output with ``m`` rows (no autotuning: must also run in the interpreter)."""
    return CONFIGS["decode"] if m <= 16 else CONFIGS["medium"] if m <= 128 else CONFIGS["large"]


def _fp8_linear_kernel(
    a_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_scale_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_om, stride_on, stride_rm, stride_rn, stride_xs, stride_ws,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE: tl.constexpr,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
    EXP_BIAS: tl.constexpr,
):
    """out[M, N] = epilogue(A[M, K] · W[N, K]ᵀ · (sx·sw)). GATED: W is [gate; up] (2N × K); the same CTA
    computes the gate and up tiles of its output columns (two accumulators sharing each A tile) so
    act(gate)·up is formed in registers and the 2N-wide intermediate never reaches memory."""
    rm, rn, mask_m, mask_n = core.output_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # SCALE_N, SCALE_K = 1, 0: per-tensor/row/channel scales, applied once in the epilogue
    acc, acc_up = core.main_loop(a_ptr, w_ptr, x_scale_ptr, w_scale_ptr, rm, rn, mask_m, mask_n, N, K, N,
                                 stride_am, stride_ak, stride_wn, stride_wk, stride_xs, stride_ws,
                                 BLOCK_M, BLOCK_N, BLOCK_K, GATED, 1, 0, PROMOTE)
    core.linear_epilogue(acc, acc_up, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_ptr, out_scale_ptr,
                         rm, rn, mask_m, mask_n, N,
                         stride_xs, stride_ws, stride_rm, stride_rn, stride_om, stride_on,
                         0, ACTIVATION, GATED, HAS_BIAS, HAS_RESIDUAL, OUT_KIND,
                         FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


def _fp8_matmul_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr,
    M, N, K, B1,
    stride_a0, stride_a1, stride_am, stride_ak, stride_b0, stride_b1, stride_bk, stride_bn,
    stride_c0, stride_c1, stride_cm, stride_cn, stride_sa0, stride_sa1, stride_sam, stride_sb0, stride_sb1,
    stride_sbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE: tl.constexpr,
):
    """c[z] = (a[z] · b[z]) · (sa[z] · sb[z]) for batch z = (z0, z1) on grid axis 2. Broadcast batch dims
    have stride 0, so a K/V shared by several heads is read in place, never copied; scales likewise
    (stride 0 = per-tensor, sam = per-row of a, sbn = per-column of b)."""
    pid_z = tl.program_id(2)
    z0 = (pid_z // B1).to(tl.int64)  # batch offsets in 64 bits: B·H·L·D can exceed 2**31
    z1 = (pid_z % B1).to(tl.int64)
    a_ptr += z0 * stride_a0 + z1 * stride_a1
    b_ptr += z0 * stride_b0 + z1 * stride_b1
    c_ptr += z0 * stride_c0 + z1 * stride_c1
    rm, rn, mask_m, mask_n = core.output_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, _ = core.main_loop(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, mask_m, mask_n, N, K, N,
                            stride_am, stride_ak, stride_bn, stride_bk, stride_sam, stride_sbn,
                            BLOCK_M, BLOCK_N, BLOCK_K, False, 1, 0, PROMOTE)
    sa_z = sa_ptr + z0 * stride_sa0 + z1 * stride_sa1
    sb_z = sb_ptr + z0 * stride_sb0 + z1 * stride_sb1
    # the scales only: no bias (sa_z stands in for the pointer), no activation
    c = core.scale_bias_activation(acc, acc, sa_z, sb_z, sa_z, rm, rn, mask_m, mask_n, N, stride_sam, stride_sbn,
                                   "none", False, False, 0)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c, mask=mask_m[:, None] & mask_n[None, :])


LINEAR_KERNEL = Kernel(_fp8_linear_kernel, ("M", "stride_xs", "stride_ws"))
MATMUL_KERNEL = Kernel(_fp8_matmul_kernel, ("M", "B1", "stride_sa0", "stride_sa1", "stride_sam", "stride_sb0",
                                           "stride_sb1", "stride_sbn"))

_MAX_GRID_Z = 65535


def fp8_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    out_scale: torch.Tensor | None = None,
    out_fmt: FP8Format | str = FP8Format.E4M3,
    config: GemmConfig | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """``act(x·Wᵀ·sx·sw + bias) + residual`` in one kernel (see reference.fp8_linear).

    With ``out_scale`` (0-d: the next op's input scale) the result is stored as FP8 in ``out_fmt``,
    quantized exactly like ``reference.quantize`` (× the reciprocal torch.reciprocal gives, RNE, saturating), so
    fc1 → act → fc2 chains pass FP8 without a high-precision round trip; ``out_dtype`` is then ignored.
    ``config`` overrides the block config picked by M (tests use small tiles to get many ragged edges).
    ``kernel``: "tma" (:mod:`tma_gemm`, sm_90), "classic" (this module's) or None: TMA on sm_90 for large
    M (:func:`tma_gemm.use_tma`, which :func:`tma_gemm.forced_kernel` can override).
    """
    gated = core.check_linear("fp8_linear", x_q, w_q, activation, x_scale, w_scale, bias, residual, out_scale)
    shape = x_q.shape
    lead, k = shape[:-1], shape[-1]
    n_w = w_q.shape[0]
    if w_q.dim() != 2 or w_q.shape[1] != k:
        raise ValueError(f"w_q must be N×K with K = {k}, got {tuple(w_q.shape)}")
    if gated and n_w % 2:
        raise ValueError(f"gated activation {activation!r} needs W stacked as [gate; up], got {n_w} rows")
    n = n_w // 2 if gated else n_w
    a, m, stride_am, stride_ak = core.row_operand(x_q, k)
    w_q = core.unit_stride(w_q, 1)
    core.check_size(a, w_q, residual)
    xs, stride_xs = row_scale(x_scale, lead, m)
    ws, stride_ws = core.scale_values(w_scale)
    if ws.numel() not in (1, n_w):
        raise ValueError(f"w_scale must be a scalar or have {n_w} values, got {tuple(w_scale.shape)}")
    b = None if bias is None else core.fp32_vector(bias, n_w)
    ep = core.epilogue_operands(lead, m, n, residual, out_dtype, out_scale, out_fmt, a.device)
    if tma_gemm.may_use_tma(kernel):
        a = a.reshape(m, k)
        if tma_gemm.use_tma("fp8_linear", kernel, a, w_q, m, config is not None):
            tma_gemm.launch_linear(a, w_q, ep, xs, ws, b, n, activation, stride_xs=stride_xs, stride_ws=stride_ws,
                                   config=config)
            return ep.out
    cfg = config or pick_config(m)
    if gated and config is None:
        cfg = core.gated_config(cfg)
    if m and n:
        LINEAR_KERNEL[(cdiv(m, cfg.BLOCK_M) * cdiv(n, cfg.BLOCK_N),)](
            a, w_q, ep.out_view, xs, ws, *ep.pointers(b, xs),
            m, n, k,
            stride_am, stride_ak, *w_q.stride(), *ep.strides(), stride_xs, stride_ws,
            **ep.launch_options(cfg, activation, b is not None),
        )
    return ep.out


def row_scale(x_scale: torch.Tensor, lead: torch.Size, m: int) -> tuple[torch.Tensor, int]:
    """x's scale as the kernels read it (fp32, one value or one per row of the m = prod(lead) rows) and its
    stride: 0 for one value; a contiguous (*lead, 1) scale is read in place, others are broadcast to it."""
    xs = core.fp32(x_scale)
    if xs.numel() == 1:
        return xs, 0
    if xs.is_contiguous() and xs.shape == (*lead, 1):
        return xs, 1
    xs = torch.broadcast_to(xs, (*lead, 1)).reshape(m)
    return xs, xs.stride(0)


def fp8_matmul(
    a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor, *,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Batched ``(a_q @ b_q) · a_scale · b_scale`` (see reference.fp8_matmul), fp32 result.

    Batch dims broadcast like torch.matmul (through strides, no copies of the operands). Scales may be
    per-tensor (0-d), per row of a (…×M×1) or per column of b (…×1×N, as fp8_attention's per-token K).
    """
    core.check_linear("fp8_matmul", a_q, b_q, None, a_scale, b_scale)
    if a_q.dim() < 2 or b_q.dim() < 2 or a_q.shape[-1] != b_q.shape[-2]:
        raise ValueError(f"fp8_matmul needs …×M×K @ …×K×N operands, got {tuple(a_q.shape)} @ {tuple(b_q.shape)}")
    m, k, n = a_q.shape[-2], a_q.shape[-1], b_q.shape[-1]
    batch = torch.broadcast_shapes(a_q.shape[:-2], b_q.shape[:-2])
    out = torch.empty((*batch, m, n), dtype=torch.float32, device=a_q.device)

    def as_4d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """Broadcast to batch×rows×cols and fold the batch dims into exactly two (views when possible)."""
        t = torch.broadcast_to(t, (*batch, rows, cols))
        if len(batch) < 2:
            return t.reshape((1,) * (2 - len(batch)) + tuple(t.shape))
        return t.reshape(-1, batch[-1], rows, cols)

    # unit stride along K for a, along K or N for b (Q·Kᵀ passes a transposed view: no copy needed)
    a_q = core.unit_stride(a_q, -1)
    b_q = b_q if b_q.stride(-2) == 1 else core.unit_stride(b_q, -1)
    a, b, c = as_4d(a_q, m, k), as_4d(b_q, k, n), as_4d(out, m, n)
    sa, sb = as_4d(core.fp32(a_scale), m, 1), as_4d(core.fp32(b_scale), 1, n)
    core.check_size(a[0, 0], b[0, 0], c[0, 0])
    b0, b1 = c.shape[0], c.shape[1]
    if b1 > _MAX_GRID_Z:
        raise ValueError(f"the innermost batch dim ({b1}) exceeds the CUDA grid limit {_MAX_GRID_Z}")
    cfg = config or pick_config(m)
    tiles = cdiv(m, cfg.BLOCK_M) * cdiv(n, cfg.BLOCK_N)
    step = _MAX_GRID_Z // b1  # grid axis 2 holds at most 65535 batches: launch in chunks of z0
    for z in range(0, b0 if m and n else 0, step):
        a_z, b_z, c_z, sa_z, sb_z = (t[z:z + step] for t in (a, b, c, sa, sb))
        MATMUL_KERNEL[(tiles, 1, c_z.shape[0] * b1)](
            a_z, b_z, c_z, sa_z, sb_z, m, n, k, b1,
            *a_z.stride(), *b_z.stride(), *c_z.stride(), sa_z.stride(0), sa_z.stride(1), sa_z.stride(2),
            sb_z.stride(0), sb_z.stride(1), sb_z.stride(3),
            **cfg.constexprs(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compilation table: every variant the wrappers can launch (what the JIT would compile)


def _linear_entry(cfg: GemmConfig, fmt_a: FP8Format, fmt_w: FP8Format, activation: str | None, has_bias: bool,
                  res_dtype: str | None, out: str | FP8Format) -> AotEntry:
    return gemm_aot.linear_aot_entry("_fp8_linear_kernel", LINEAR_KERNEL, cfg, fmt_a, fmt_w, activation, has_bias,
                                 res_dtype, out, scales={})


def _matmul_entry(cfg: GemmConfig, fmt_a: FP8Format, fmt_b: FP8Format, b_layout: str) -> AotEntry:
    """``b_layout`` "kn": b row-major (P·V); "nk": b is a transposed row-major tensor (Q·Kᵀ)."""
    ptrs = {"a_ptr": gemm_aot.PTR[fmt_a], "b_ptr": gemm_aot.PTR[fmt_b], "c_ptr": "*fp32", "sa_ptr": "*fp32",
            "sb_ptr": "*fp32"}
    units = ("stride_ak", "stride_bn" if b_layout == "kn" else "stride_bk", "stride_cn")
    sig, consts = gemm_aot.signature(MATMUL_KERNEL, ptrs, units)
    consts.update(cfg.constexprs())
    desc = f"{gemm_aot.describe(cfg)} | {fmt_a.value}x{fmt_b.value} b={b_layout}"
    return ("_fp8_matmul_kernel", desc, MATMUL_KERNEL, sig, consts)


def _aot_configs() -> list[AotEntry]:
    fmts = list(FP8Format)
    linear = itertools.product(CONFIGS.values(), fmts, fmts, (None,) + ACTIVATIONS + GATED, (False, True),
                               gemm_aot.RESIDUAL_DTYPES, gemm_aot.LINEAR_OUTS)
    matmul = itertools.product(CONFIGS.values(), fmts, fmts, ("kn", "nk"))
    return [_linear_entry(*args) for args in linear] + [_matmul_entry(*args) for args in matmul]


AOT_CONFIGS: list[AotEntry] = _aot_configs()


def aot_options(entry: AotEntry) -> dict[str, int]:
    """``num_warps``/``num_stages`` of an AOT_CONFIGS entry (launch options: pass as triton.compile options)."""
    return gemm_aot.config_options(CONFIGS, entry)


def aot_attrs(entry: AotEntry) -> dict:
    """ASTSource ``attrs`` for the common aligned case (the JIT adds them when pointers, K, N and the
    leading strides are multiples of 16): without them loads are not vectorized nor cp.async-pipelined."""
    return gemm_aot.aligned_attrs(entry, ("N", "K", "stride_am", "stride_wn", "stride_om", "stride_rm", "stride_bk",
                                 "stride_bn", "stride_cm", "stride_a0", "stride_a1", "stride_b0", "stride_b1",
                                 "stride_c0", "stride_c1"))
