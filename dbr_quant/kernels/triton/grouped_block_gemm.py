"""Triton grouped block-scaled FP8 GEMM for mixture-of-experts blocks, and MXFP8 experts on it.

Semantics: :func:`reference.grouped.fp8_grouped_block_linear` — per expert, the block-scaled linear of
:mod:`.block_gemm` (each K step's FP8 dot scaled by ``x_scale[row, kb] · w_scale[e, n // bn, kb]`` and added to the
fp32 accumulator, :func:`gemm_core.main_loop` with SCALE_K = bk) — over the FP8 grouped GEMM's schedule
(:mod:`.grouped_gemm`: ragged rows per expert, tile → expert derived in-kernel, token rows gathered through
``slots`` or sorted rows read directly, their per-row group scales indexed the same way) and with its outputs
(sorted rows in fp32/bf16/fp16, or the routing-weighted atomic scatter-add: for top_k ≤ 2 bit-identical to an
ordered sum, for top_k ≥ 3 the last bit may vary run to run). Against the reference: the order of the fp32
additions. Gated weights take [gate; up] blocked half by half (the up half's scale rows from UP_SCALE_ROW on).

MXFP8 experts (:func:`fp8_grouped_mx_linear`): the E8M0 codes decoded to fp32 powers of two (exact) and this kernel
with 1×32 weight blocks, as ``mx_gemm`` runs the dense MX linear on sm_89/90 (Blackwell's ``tl.dot_scaled`` has
no grouped kernel here yet).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.block import check_block, check_block_linear_operands
from dbr_quant.kernels.reference.dense import ACTIVATIONS, GATED
from dbr_quant.kernels.reference.grouped import check_grouped_args
from dbr_quant.kernels.reference.mx import MX_WEIGHT_BLOCK, check_e8m0, e8m0_to_float
from dbr_quant.kernels.routing import MoeRouting
from dbr_quant.kernels.triton import gemm_aot
from dbr_quant.kernels.triton import gemm_core as core
from dbr_quant.kernels.triton import grouped_gemm as grouped
from dbr_quant.kernels.triton.block_gemm import BLOCK_CONFIGS, MIN_BLOCK_K
from dbr_quant.kernels.triton.common import AotEntry, Kernel, cdiv

__all__ = ["AOT_CONFIGS", "aot_attrs", "aot_options", "fp8_grouped_block_linear", "fp8_grouped_mx_linear"]


def _fp8_grouped_block_gemm_kernel(
    a_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, slots_ptr, route_w_ptr, expert_offsets_ptr,
    N, K, KB, UP_SCALE_ROW, num_experts, top_k, max_tiles,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_se, stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE: tl.constexpr,
    CHUNK: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, ACTIVATION: tl.constexpr,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr, OUT_KIND: tl.constexpr,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr,
):
    """out = epilogue(Σ_kb (A_rows[:, kb] · W[e][:, kb]ᵀ) · sx[row, kb] · sw[e, n // SCALE_N, kb]) for one (row
    tile, column tile) of expert e. Scales are contiguous fp32: sx [input rows, KB], sw [E, scale rows, KB]."""
    e, valid, rm, rn, mask_m, mask_n, slot, a_row = grouped.expert_tile(
        expert_offsets_ptr, slots_ptr, num_experts, top_k, max_tiles, N, BLOCK_M, BLOCK_N, GROUP_M, CHUNK, GATHER)
    if not valid:
        return
    ws_ptr = w_scale_ptr + e * stride_se
    acc, acc_up = core.main_loop(a_ptr, w_ptr + e.to(tl.int64) * stride_we, x_scale_ptr, ws_ptr, a_row, rn,
                                 mask_m, mask_n, N, K, UP_SCALE_ROW, stride_am, stride_ak, stride_wn, stride_wk, KB, KB,
                                 BLOCK_M, BLOCK_N, BLOCK_K, GATED, SCALE_N, SCALE_K, PROMOTE)
    y = core.scale_bias_activation(acc, acc_up, x_scale_ptr, ws_ptr, bias_ptr + e * stride_be, a_row, rn, mask_m,
                                   mask_n, N, KB, KB, ACTIVATION, GATED, HAS_BIAS, SCALE_K)
    grouped.store_rows(y, out_ptr, x_scale_ptr, route_w_ptr, slot, rm, rn, mask_m, mask_n, top_k, stride_om,
                       stride_on, OUT_KIND, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


# KB (1 for K ≤ bk) and UP_SCALE_ROW would double the variants, as in the dense block kernel
GROUPED_BLOCK_KERNEL = Kernel(_fp8_grouped_block_gemm_kernel, (
    "KB", "UP_SCALE_ROW", "num_experts", "top_k", "max_tiles", "stride_se", "stride_be"))


# 32-wide K blocks (MX): one MMA step per scale pair, so every step scales two fp32 tiles (four when gated) on
# the CUDA cores; the dense block kernel's medium / large tiles narrowed to K 32 then need 255 registers gated and
# spill on sm_89 (20 and 8 bytes). Narrower N tiles, and 4 warps for large (with 8, ptxas held sm_89 to 128
# registers and spilled 8 bytes): at most 252 registers on sm_89 / 237 on sm_90, no spills
# (python -m dbr_quant.kernels.triton.aot --arch 89 --only grouped_block).
# Decode takes the medium tile (the FP8 MMA's 64 rows at least).
MX_CONFIGS: dict[str, core.GemmConfig] = {
    "medium": core.GemmConfig("medium", 64, 64, 32, GROUP_M=8, num_warps=4, num_stages=3),
    "large": core.GemmConfig("large", 128, 64, 32, GROUP_M=8, num_warps=4, num_stages=3),
}


def _configs(bk: int) -> dict[str, core.GemmConfig]:
    return BLOCK_CONFIGS if bk % 64 == 0 else MX_CONFIGS


def _config(rows_per_expert: int, gated: bool, bk: int) -> core.GemmConfig:
    """The tile for the average rows per expert: the dense block kernel's (for 32-wide K blocks
    :data:`MX_CONFIGS`), BLOCK_K narrowed to divide bk."""
    configs = _configs(bk)
    name = "decode" if rows_per_expert <= 16 and "decode" in configs else "medium" if rows_per_expert <= 128 \
        else "large"
    return _narrowed(configs[name], gated, bk)


def _narrowed(cfg: core.GemmConfig, gated: bool, bk: int) -> core.GemmConfig:
    """``cfg`` (gated: half as wide) with BLOCK_K dividing the block's K ``bk``."""
    cfg = cfg.gated() if gated else cfg
    step = math.gcd(cfg.BLOCK_K, bk)
    if step < MIN_BLOCK_K:
        raise ValueError(f"fp8_grouped_block_linear: the weight block's K ({bk}) must be a multiple of {MIN_BLOCK_K} "
                         "(an FP8 MMA step); 128 in the checkpoints in use, 32 for MX")
    return cfg if step == cfg.BLOCK_K else core.GemmConfig(f"{cfg.name}-k{step}", cfg.BLOCK_M, cfg.BLOCK_N, step,
                                                           cfg.GROUP_M, cfg.num_warps, cfg.num_stages)


def fp8_grouped_block_linear(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, routing: MoeRouting, *,
    block: tuple[int, int], x_sorted: bool = False, bias: torch.Tensor | None = None, activation: str | None = None,
    out_dtype: torch.dtype = torch.float32, topk_weights: torch.Tensor | None = None,
    config: core.GemmConfig | None = None,
) -> torch.Tensor:
    """:func:`reference.grouped.fp8_grouped_block_linear` in one launch. ``config`` overrides the tile (tests
    use small tiles to get many ragged tiles per expert; its BLOCK_K must divide the block's K)."""
    op = "fp8_grouped_block_linear"
    core.check_linear(op, x_q, w_q[0], activation, x_scale, w_scale, bias, None, topk_weights, routing.slots)
    check_grouped_args(x_q, w_q, routing, x_sorted, activation, None, topk_weights, op)
    bn, bk = check_block(block)
    if w_scale.dim() != 3 or w_scale.shape[0] != w_q.shape[0]:
        raise ValueError(f"{op}: w_scale must be [E={w_q.shape[0]}, row blocks, K blocks] (one block grid per "
                         f"expert), got {tuple(w_scale.shape)}")
    gated = activation in GATED
    k, n, up_row = check_block_linear_operands(x_q, x_scale, w_q[0], w_scale[0], (bn, bk), gated)
    num_e, n_w = w_q.shape[0], w_q.shape[1]
    if config is not None and bk % config.BLOCK_K:
        raise ValueError(f"{op}: config BLOCK_K {config.BLOCK_K} must divide the block's K ({bk})")
    a, w = core.unit_stride(x_q, 1), core.unit_stride(w_q, 2)
    core.check_size(a, w[0])
    rows, dev = routing.num_rows, x_q.device
    kb = math.ceil(k / bk)
    xs = core.fp32(x_scale).contiguous()
    ws = core.fp32(w_scale).contiguous()
    b = grouped.expert_bias(bias, num_e, n_w, op)
    route_w = grouped.slot_weights(routing, topk_weights, op)
    out, out_view, kind_o = grouped.grouped_output(routing, n, out_dtype, topk_weights is not None, False, dev, op)
    cfg = config or _config(cdiv(rows, num_e), gated, bk)
    max_tiles = cdiv(rows, cfg.BLOCK_M) + min(num_e, rows)
    if rows and n:
        GROUPED_BLOCK_KERNEL[(max_tiles * cdiv(n, cfg.BLOCK_N),)](
            a, w, out_view, xs, ws, xs if b is None else b, routing.slots, xs if route_w is None else route_w,
            routing.expert_offsets,
            n, k, kb, up_row, num_e, routing.top_k, max_tiles,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
            ws.stride(0), 0 if b is None else b.stride(0),
            **cfg.constexprs(), CHUNK=grouped.EXPERT_CHUNK, SCALE_N=bn, SCALE_K=bk, GATHER=not x_sorted,
            **core.epilogue_constexprs(activation, b is not None, kind_o),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return grouped.finish_output(out, routing, kind_o, out_dtype)


def fp8_grouped_mx_linear(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, routing: MoeRouting, *,
    x_sorted: bool = False, bias: torch.Tensor | None = None, activation: str | None = None,
    out_dtype: torch.dtype = torch.float32, topk_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`reference.grouped.fp8_grouped_mx_linear`: the E8M0 codes decoded (exact powers of two), then
    :func:`fp8_grouped_block_linear` with 1×32 weight blocks."""
    check_e8m0(x_scale, "fp8_grouped_mx_linear: x_scale")
    check_e8m0(w_scale, "fp8_grouped_mx_linear: w_scale")
    return fp8_grouped_block_linear(x_q, e8m0_to_float(x_scale), w_q, e8m0_to_float(w_scale), routing,
                                    block=MX_WEIGHT_BLOCK, x_sorted=x_sorted, bias=bias, activation=activation,
                                    out_dtype=out_dtype, topk_weights=topk_weights)


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compilation table: 128×128 blocks (DeepSeek-V3 / Qwen3-FP8) and MX 1×32, for sm_89 / sm_90

AOT_BLOCKS = ((128, 128), MX_WEIGHT_BLOCK)
_OUTS = ("fp32", "bf16", "fp16", "scatter_add")


def _entry(block: tuple[int, int], cfg: core.GemmConfig, fmt_a: FP8Format, fmt_w: FP8Format, activation: str | None,
           has_bias: bool, gather: bool, out: str) -> AotEntry:
    epilogue = core.epilogue_constexprs(activation, has_bias, out)
    cfg = _narrowed(cfg, bool(epilogue["GATED"]), block[1])
    ptrs = {"a_ptr": gemm_aot.PTR[fmt_a], "w_ptr": gemm_aot.PTR[fmt_w],
            "out_ptr": "*fp32" if out.startswith("scatter") else gemm_aot.OUT_PTR[out], "x_scale_ptr": "*fp32",
            "w_scale_ptr": "*fp32", "bias_ptr": "*fp32", "slots_ptr": "*i32", "route_w_ptr": "*fp32",
            "expert_offsets_ptr": "*i32"}
    sig, consts = gemm_aot.signature(GROUPED_BLOCK_KERNEL, ptrs, ("stride_ak", "stride_wk", "stride_on"))
    consts.update(cfg.constexprs(), CHUNK=grouped.EXPERT_CHUNK, SCALE_N=block[0], SCALE_K=block[1], GATHER=gather,
                  **epilogue)
    desc = (f"{gemm_aot.describe(cfg)} | block={block[0]}x{block[1]} {fmt_a.value}x{fmt_w.value} act={activation} "
            f"bias={int(has_bias)} rows={'gathered' if gather else 'sorted'} out={out}")
    return ("_fp8_grouped_block_gemm_kernel", desc, GROUPED_BLOCK_KERNEL, sig, consts)


AOT_CONFIGS: list[AotEntry] = [
    _entry(block, *args) for block in AOT_BLOCKS for args in itertools.product(
        _configs(block[1]).values(), list(FP8Format), list(FP8Format), (None,) + ACTIVATIONS + GATED, (False, True),
        (True, False), _OUTS)]
# divisibility by 16 of pointers, N, K and leading strides, as the JIT finds for aligned shapes
aot_attrs = functools.partial(gemm_aot.aligned_attrs,
                              aligned=("N", "K", "stride_am", "stride_we", "stride_wn", "stride_om"))


def aot_options(entry: AotEntry) -> dict[str, int]:
    """``num_warps``/``num_stages`` of an entry: its tile config's (the description starts with the config's
    name, "-gated" / "-k32" appended, and names the block)."""
    block_k = int(entry[1].split(" block=")[1].split()[0].split("x")[1])
    cfg = _configs(block_k)[entry[1].split()[0].split("-")[0]]
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
