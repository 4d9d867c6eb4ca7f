"""Triton per-token-group dynamic FP8 quantization, alone and fused behind LayerNorm / RMSNorm.

The activation side of block-scaled FP8 (see reference.block): one scale per token per group of ``group``
channels (128 in DeepSeek-V3 / Qwen3-FP8), computed from the data, scale layout [..., ⌈K/group⌉] row-major.

* :func:`group_quantize` equals ``reference.block.group_quantize`` bit for bit: the group amax ignores
  non-finite values (max is order-independent, so it is exact), the scale is ``div_rn(amax, fmt.max)`` with
  safe_scale's guards (:func:`quantize.scale_from_amax`), the reciprocal ``div_rn(1, scale)`` is
  IEEE like torch.reciprocal, and the bytes come from :func:`quantize.quantize_bits`.
  One program quantizes a tile of rows × one group, so a group is read once (amax and quantize from registers).
* :func:`layer_norm_group_quantize` is ``reference.block.layer_norm_group_quantize`` in one kernel: row
  statistics as in kernels.triton.norm (so equal to the reference up to fp32 rounding of the statistics), then each
  group is normalized, stored, reduced to its scale and quantized while still in registers. Its (fp8, scale)
  equal ``reference.block.group_quantize`` of its own fp32 ``normalized`` output bit for bit.

Any group size: the tile is padded to a power of two and masked; the ragged last group uses its real channels.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.block import DEFAULT_GROUP, check_group
from dbr_quant.kernels.triton.common import Kernel, cdiv, check_device, device_function, fp8_constants
from dbr_quant.kernels.triton.norm import NORM_BLOCKS, affine_params, normalize, row_stats
from dbr_quant.kernels.triton.quantize import (
    FORMATS,
    TRITON_DTYPES,
    aot_signature,
    block_max,
    finite_abs,
    loadable,
    pick_block,
    quantize_bits,
    scale_from_amax,
)

TILE_ELEMENTS = 2048  # elements per program of group_quantize: rows × padded group
MAX_GRID_Y = 65535
AOT_GROUPS = (128,)  # the group size of the checkpoints in use; other sizes compile on first use


@device_function
def _row_max(x):
    """Max along the last axis of a 2-d block (see quantize.block_max for why not tl.max)."""
    return tl.reduce(x, 1, tl.standard._elementwise_max)


def _group_quantize_kernel(x_ptr, q_ptr, scale_ptr, M, K, G, BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr,
                           GROUP_PAD: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                           MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    """Program (i, g): rows i·BLOCK_ROWS … of group g. x and q are contiguous [M, K], scale [M, G]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    g = tl.program_id(1)
    cols = tl.arange(0, GROUP_PAD)
    offs_k = g * GROUP + cols
    row_ok = rows < M
    mask = row_ok[:, None] & ((cols < GROUP) & (offs_k < K))[None, :]
    offs = rows[:, None] * K + offs_k[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = scale_from_amax(_row_max(finite_abs(x)), FP8_MAX)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    tl.store(scale_ptr + rows * G + g, scale, mask=row_ok)
    tl.store(q_ptr + offs, quantize_bits(x, inv[:, None], FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS), mask=mask)


def _layer_norm_group_quantize_kernel(x_ptr, w_ptr, b_ptr, y_ptr, q_ptr, scale_ptr, N, G, eps, BLOCK: tl.constexpr,
                                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                                      HAS_BIAS: tl.constexpr, RMS: tl.constexpr, FP8_MAX: tl.constexpr,
                                      MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    """One row per program: statistics (BLOCK chunks), then per group: normalize, store, amax, quantize."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N
    mean, rstd = row_stats(x_row, N, eps, BLOCK, RMS)
    cols = tl.arange(0, GROUP_PAD)
    for g in range(0, G):
        offs = g * GROUP + cols
        mask = (cols < GROUP) & (offs < N)
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        y = normalize(x, mean, rstd, w_ptr, b_ptr, offs, mask, HAS_WEIGHT, HAS_BIAS)
        tl.store(y_ptr + row * N + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        scale = scale_from_amax(block_max(finite_abs(tl.where(mask, y, 0.0))), FP8_MAX)
        inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        tl.store(scale_ptr + row * G + g, scale)
        tl.store(q_ptr + row * N + offs, quantize_bits(y, inv, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS),
                 mask=mask)


GROUP_QUANTIZE = Kernel(_group_quantize_kernel)
LAYER_NORM_GROUP_QUANTIZE = Kernel(_layer_norm_group_quantize_kernel)


def _tile(group: int) -> tuple[int, int]:
    """(rows per program, padded group) for group_quantize."""
    pad = triton.next_power_of_2(group)
    return max(1, TILE_ELEMENTS // pad), pad


def group_quantize(x: torch.Tensor, group: int = DEFAULT_GROUP,
                   fmt: FP8Format = FP8Format.E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.block.group_quantize`` on the device, one launch: (fp8 like x, fp32 scale [..., ⌈K/group⌉])."""
    check_device(x)
    group, fmt = check_group(group), FP8Format.parse(fmt)
    if x.dim() == 0:
        raise ValueError("group_quantize: x needs at least one dimension (the channels)")
    k = x.shape[-1]
    g = math.ceil(k / group)
    if g > MAX_GRID_Y:
        raise ValueError(f"group_quantize: {g} groups per row exceed the CUDA grid limit {MAX_GRID_Y}; "
                         "use larger groups")
    q = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    scale = torch.empty(*x.shape[:-1], g, dtype=torch.float32, device=x.device)
    m = x.numel() // k if k else 0
    if m == 0 or g == 0:
        scale.fill_(1.0)  # an empty group's amax is 0: scale 1, as safe_scale
        return q, scale
    rows, pad = _tile(group)
    GROUP_QUANTIZE[(cdiv(m, rows), g)](loadable(x), q.view(torch.uint8), scale, m, k, g, BLOCK_ROWS=rows,
                                              GROUP=group, GROUP_PAD=pad, **fp8_constants(fmt))
    return q, scale


def layer_norm_group_quantize(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group: int = DEFAULT_GROUP,
    fmt: FP8Format = FP8Format.E4M3,
    *,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm (or RMSNorm) then per-token-group FP8, one launch: (normalized in x's dtype — fp32 for
    other inputs —, fp8, scale [..., ⌈K/group⌉]). RMSNorm ignores bias, as the reference."""
    check_device(x, weight, bias)
    group, fmt = check_group(group), FP8Format.parse(fmt)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError("layer_norm_group_quantize needs a non-empty last dimension")
    if rms:
        bias = None
    x_c = loadable(x)
    weight, bias = affine_params(x_c, weight, bias)
    n = x.shape[-1]
    g = math.ceil(n / group)
    y = torch.empty(x.shape, dtype=x_c.dtype, device=x.device)
    q = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    scale = torch.empty(*x.shape[:-1], g, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, q, scale
    LAYER_NORM_GROUP_QUANTIZE[(x.numel() // n,)](
        x_c, x_c if weight is None else weight, x_c if bias is None else bias, y, q.view(torch.uint8), scale, n, g,
        float(eps), BLOCK=pick_block(n, NORM_BLOCKS), GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, RMS=rms, **fp8_constants(fmt))
    return y, q, scale


# ----------------------------------------------------------------------------------------------------
# ahead-of-time configurations: what the wrappers launch for the AOT_GROUPS group sizes


def _aot_configs() -> list[tuple[str, str, Kernel, dict, dict]]:
    configs = []
    for group in AOT_GROUPS:
        rows, pad = _tile(group)
        for x_ty in TRITON_DTYPES.values():
            sig = aot_signature(GROUP_QUANTIZE, {"x_ptr": f"*{x_ty}", "q_ptr": "*u8", "scale_ptr": "*fp32",
                                                 "M": "i32", "K": "i32", "G": "i32"})
            for fmt in FORMATS:
                configs.append(("group_quantize", f"x={x_ty} {fmt.value} group={group} rows={rows}", GROUP_QUANTIZE,
                                sig, {"BLOCK_ROWS": rows, "GROUP": group, "GROUP_PAD": pad, **fp8_constants(fmt)}))
            for rms in (False, True):
                for has_w in (False, True):
                    for has_b in (False, True) if not rms else (False,):
                        for p_ty in sorted({x_ty, "fp32"}) if (has_w or has_b) else (x_ty,):
                            sig = aot_signature(LAYER_NORM_GROUP_QUANTIZE, {
                                "x_ptr": f"*{x_ty}", "w_ptr": f"*{p_ty}" if has_w else f"*{x_ty}",
                                "b_ptr": f"*{p_ty}" if has_b else f"*{x_ty}", "y_ptr": f"*{x_ty}", "q_ptr": "*u8",
                                "scale_ptr": "*fp32", "N": "i32", "G": "i32", "eps": "fp32"})
                            for fmt in FORMATS:
                                for block in NORM_BLOCKS:
                                    desc = (f"x={x_ty} {'rms' if rms else 'layer'}norm weight={has_w} bias={has_b} "
                                            f"params={p_ty} {fmt.value} group={group} BLOCK={block}")
                                    configs.append(("layer_norm_group_quantize", desc, LAYER_NORM_GROUP_QUANTIZE, sig,
                                                    {"BLOCK": block, "GROUP": group, "GROUP_PAD": pad,
                                                     "HAS_WEIGHT": has_w, "HAS_BIAS": has_b, "RMS": rms,
                                                     **fp8_constants(fmt)}))
    return configs


AOT_CONFIGS: list[tuple[str, str, Kernel, dict, dict]] = _aot_configs()
