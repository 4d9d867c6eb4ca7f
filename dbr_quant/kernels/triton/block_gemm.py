"""Triton block-scaled FP8 linear: A-group and W-block scales applied inside the K loop.

The DeepGEMM / vLLM ``w8a8_block_fp8_matmul`` structure on the layouts of :mod:`reference_block`: x_q [M, K]
with per-token-group scales [M, ⌈K/bk⌉], w_q [N, K] with block scales [⌈N/bn⌉, ⌈K/bk⌉]. Each K step's FP8 dot
(wgmma on sm_90, mma.sync on sm_89) lands in a fresh fp32 tile, which is multiplied by
``x_scale[m, kb] · w_scale[n // bn, kb]`` and added to the fp32 accumulator. BLOCK_K divides bk, so a step
never straddles two scale blocks (with BLOCK_K = bk = 128, one scale pair per step). The result matches
``reference_block.fp8_block_linear(exact=True)`` up to the order of fp32 additions.

Then the epilogue shared with the per-tensor/channel kernel (:func:`triton_gemm.linear_epilogue`: bias,
activation incl. gated, residual, fp32/bf16/fp16 or FP8 with a static scale). Every load and store is
masked, so ragged M (decode M = 1), N and K (not multiples of the tile nor of the scale block) all work.
Gated activations take W as [gate; up] with each half blocked on its own: the up half's scale rows start
at ⌈N/bn⌉ (UP_SCALE_ROW).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import triton
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.block import DEFAULT_BLOCK, check_block, check_block_linear_operands
from dbr_quant.kernels.reference.dense import ACTIVATIONS, GATED
from dbr_quant.kernels.triton.common import Kernel, check_device, fp8_constants
from dbr_quant.kernels.triton.gemm import (
    _OUT_PTR,
    _PTR,
    GemmConfig,
    _activation_kind,
    _check_size,
    _describe,
    _fp8_format,
    _GemmKernel,
    _grouped_tile,
    _signature,
    _unit_stride,
    epilogue_operands,
    linear_epilogue,
)

__all__ = ["AOT_CONFIGS", "BLOCK_CONFIGS", "aot_attrs", "aot_options", "fp8_block_linear", "pick_block_config"]

# As triton_gemm.CONFIGS, with BLOCK_K = 128 for decode and medium: one scale pair per K step for 128-wide
# blocks (a 64-wide step doubles the CUDA-core scaling work; large takes it to fit its registers). Each
# step's dot needs a second fp32 tile next to the accumulator, so medium uses 8 warps (with 4: 255
# registers and a 16-byte spill on sm_89).
# smem per stage = (BLOCK_M + BLOCK_N)·128 B: decode 4 × 16 KB, medium 3 × 24 KB, large 4 × 16 KB = 64 KB
# (under Ada's 99 KB per block).
BLOCK_CONFIGS: dict[str, GemmConfig] = {
    "decode": GemmConfig("decode", 64, 64, 128, GROUP_M=8, num_warps=4, num_stages=4),
    "medium": GemmConfig("medium", 64, 128, 128, GROUP_M=8, num_warps=8, num_stages=3),
    # BLOCK_K 64 (two K steps per 128-wide scale block): at 128 the relu+bias+fp32-residual epilogue needed
    # 255 registers and spilled 4 B on sm_89 under triton 3.9
    "large": GemmConfig("large", 128, 128, 64, GROUP_M=8, num_warps=8, num_stages=4),
}
MIN_BLOCK_K = 32  # an FP8 MMA consumes K in steps of 32


def pick_block_config(m: int) -> GemmConfig:
    """The tile config for an output of ``m`` rows (no autotuning: must also run in the interpreter)."""
    return BLOCK_CONFIGS["decode"] if m <= 16 else BLOCK_CONFIGS["medium"] if m <= 128 else BLOCK_CONFIGS["large"]


def _fp8_block_linear_kernel(
    a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, inv_out_scale_ptr,
    M, N, K, KB, UP_SCALE_ROW,
    stride_am, stride_ak, stride_wn, stride_wk, stride_om, stride_on, stride_rm, stride_rn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
    EXP_BIAS: tl.constexpr,
):
    """out[M, N] = epilogue(Σ_kb (A[:, kb] · W[:, kb]ᵀ) · sa[m, kb] · sw[n // SCALE_N, kb]). Scales are
    contiguous fp32: sa [M, KB], sw [rows, KB]. GATED: W is [gate; up] (2N × K), both tiles in one CTA."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    w_ptrs = w_ptr + rk[:, None] * stride_wk + rn[None, :] * stride_wn  # a K × N tile of Wᵀ
    sa_ptrs = a_scale_ptr + rm * KB  # this tile's tokens; + kb per step
    sw_ptrs = w_scale_ptr + (rn // SCALE_N) * KB  # the scale row of each output column
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # dead code unless GATED
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        sw_up_ptrs = w_scale_ptr + (UP_SCALE_ROW + rn // SCALE_N) * KB
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k * BLOCK_K
        kb = (k * BLOCK_K) // SCALE_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_left), other=0.0)
        w_mask = (rk[:, None] < k_left) & mask_n[None, :]
        sa = tl.load(sa_ptrs + kb, mask=mask_m, other=0.0)
        sw = tl.load(sw_ptrs + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0)) * sa[:, None] * sw[None, :]
        if GATED:
            sw_up = tl.load(sw_up_ptrs + kb, mask=mask_n, other=0.0)
            acc_up += tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0)) * sa[:, None] * sw_up[None, :]
            up_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    linear_epilogue(acc, acc_up, rm, rn, mask_m, mask_n, N, bias_ptr, res_ptr, out_ptr, inv_out_scale_ptr,
                    stride_rm, stride_rn, stride_om, stride_on, ACTIVATION, GATED, HAS_BIAS, HAS_RESIDUAL, OUT_KIND,
                    FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


# M (1 when decoding), KB (1 for K ≤ 128) and UP_SCALE_ROW (1 for N ≤ 128) would each double the variants
BLOCK_LINEAR_KERNEL = _GemmKernel(_fp8_block_linear_kernel, ("M", "KB", "UP_SCALE_ROW"))


def _tile_for_block(cfg: GemmConfig, bk: int, explicit: bool) -> GemmConfig:
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
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Block-scaled ``act(x·Wᵀ + bias) + residual`` in one kernel (see reference_block.fp8_block_linear for
    the layouts). ``out_scale`` (0-d) gives FP8 out. ``config`` overrides the tile config picked by M."""
    check_device(x_q, x_scale, w_q, w_scale, bias, residual, out_scale)
    _fp8_format(x_q, "x_q")
    _fp8_format(w_q, "w_q")
    if activation is not None and activation not in ACTIVATIONS + GATED:
        raise ValueError(f"fp8_block_linear: unknown activation {activation!r}; use one of {ACTIVATIONS + GATED}")
    bn, bk = check_block(block)
    gated = activation in GATED
    k, n, rows = check_block_linear_operands(x_q, x_scale, w_q, w_scale, (bn, bk), gated)
    lead = x_q.shape[:-1]
    a = _unit_stride(x_q.reshape(-1, k), 1)
    w_q = _unit_stride(w_q, 1)
    m = a.shape[0]
    _check_size(a, w_q, residual)
    kb = math.ceil(k / bk)
    xs = x_scale.detach().float().reshape(m, kb).contiguous()
    ws = w_scale.detach().float().contiguous()
    b = None if bias is None else bias.detach().float().reshape(w_q.shape[0])
    res, out, out_view, kind, fmt_o, inv = epilogue_operands(lead, m, n, residual, out_dtype, out_scale, out_fmt,
                                                             a.device)
    inv = xs if inv is None else inv  # any fp32 pointer when the output is not FP8
    cfg = config or pick_block_config(m)
    if gated and config is None:
        cfg = cfg.gated()
    cfg = _tile_for_block(cfg, bk, explicit=config is not None)
    grid = (triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N),)
    if m and n:
        BLOCK_LINEAR_KERNEL[grid](
            a, w_q, out_view, xs, ws, xs if b is None else b, xs if res is None else res, inv,
            m, n, k, kb, rows,
            a.stride(0), a.stride(1), w_q.stride(0), w_q.stride(1), out.stride(0), out.stride(1),
            0 if res is None else res.stride(0), 0 if res is None else res.stride(1),
            **cfg.constexprs(), SCALE_N=bn, SCALE_K=bk, ACTIVATION=_activation_kind(activation),
            GATED=gated, HAS_BIAS=b is not None, HAS_RESIDUAL=res is not None, OUT_KIND=kind,
            **fp8_constants(fmt_o), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out.reshape(*lead, n)


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compilation table: the variants the wrapper launches for 128×128 blocks

AOT_BLOCKS = ((128, 128),)


def _entry(cfg, block, fmt_a, fmt_w, activation, has_bias, res_dtype, out):
    """One AOT_CONFIGS row; ``out`` is "fp32"/"bf16"/"fp16" or an FP8Format."""
    kind = "fp8" if isinstance(out, FP8Format) else out
    gated = activation in GATED
    cfg = cfg.gated() if gated else cfg
    ptrs = {"a_ptr": _PTR[fmt_a], "w_ptr": _PTR[fmt_w], "out_ptr": _OUT_PTR[kind], "a_scale_ptr": "*fp32",
            "w_scale_ptr": "*fp32", "bias_ptr": "*fp32", "res_ptr": "*" + (res_dtype or "fp32"),
            "inv_out_scale_ptr": "*fp32"}
    units = ("stride_ak", "stride_wk", "stride_on") + (("stride_rn",) if res_dtype else ())
    sig, consts = _signature(BLOCK_LINEAR_KERNEL, ptrs, units)
    consts.update(cfg.constexprs(), SCALE_N=block[0], SCALE_K=block[1], ACTIVATION=_activation_kind(activation),
                  GATED=gated, HAS_BIAS=has_bias, HAS_RESIDUAL=res_dtype is not None, OUT_KIND=kind,
                  **fp8_constants(out if kind == "fp8" else FP8Format.E4M3))
    out_name = f"fp8{out.value}" if kind == "fp8" else kind
    desc = (f"{_describe(cfg)} | block={block[0]}x{block[1]} {fmt_a.value}x{fmt_w.value} act={activation} "
            f"bias={int(has_bias)} residual={res_dtype} out={out_name}")
    return ("_fp8_block_linear_kernel", desc, BLOCK_LINEAR_KERNEL, sig, consts)


def _aot_configs() -> list[tuple[str, str, Kernel, dict, dict]]:
    fmts = list(FP8Format)
    rows = itertools.product(BLOCK_CONFIGS.values(), AOT_BLOCKS, fmts, fmts, (None,) + ACTIVATIONS + GATED,
                             (False, True), (None, "fp32", "bf16", "fp16"), ("fp32", "bf16", "fp16", *FP8Format))
    return [_entry(*args) for args in rows]


AOT_CONFIGS: list[tuple[str, str, Kernel, dict, dict]] = _aot_configs()


def aot_options(entry: tuple[str, str, Kernel, dict, dict]) -> dict[str, int]:
    """``num_warps``/``num_stages`` of an AOT_CONFIGS entry (launch options, not constexprs)."""
    cfg = BLOCK_CONFIGS[entry[1].split()[0].removesuffix("-gated")]
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def aot_attrs(entry: tuple[str, str, Kernel, dict, dict]) -> dict:
    """Divisibility by 16 of pointers, N, K and leading strides, as the JIT finds for aligned shapes
    (vectorized, cp.async-pipelined loads); KB and UP_SCALE_ROW are small and unaligned."""
    aligned = {"N", "K", "stride_am", "stride_wn", "stride_om", "stride_rm"}
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(entry[3].items())
            if ty.startswith("*") or (ty == "i32" and name in aligned)}
