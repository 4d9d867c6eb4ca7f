"""Triton MXFP8 linear: E8M0 scales per 32 elements along K on both operands (:mod:`dbr_quant.kernels.reference.mx`).

Two paths, chosen by the device (``path=`` forces one):

* **sm_100 (Blackwell), "scaled"**: :func:`_fp8_mx_linear_kernel` feeds the FP8 tiles and their uint8 scale tiles
  to ``tl.dot_scaled`` (``tcgen05.mma … kind::mxf8f6f4.block_scale``: the tensor core applies the scales), fp32
  accumulation, then :func:`gemm_core.linear_epilogue` (bias, activation incl. gated, residual, any output).
  Triton 3.7's interpreter has no ``dot_scaled`` (its builder lacks ``create_dot_scaled``), so there the same
  kernel runs ``SCALED_MMA=False``: each tile dequantized in fp32 (FP8 value × 2^(code-127): exact) and an IEEE
  fp32 ``tl.dot`` — the products the scaled MMA forms, summed in fp32. Everything around the product
  (tile walk, masks, scale addressing, gated halves, epilogue) is the code the GPU runs; the ``dot_scaled`` call
  itself is checked by the sm_100 AOT rows (FP8 block-scaled MMA present, no spills) and on a B200.
* **sm_89 / sm_90, "block"**: no scaled MMA; the block-scaled GEMM (:mod:`.block_gemm`) with 1×32 weight blocks
  and 32-wide activation groups, the codes decoded to fp32 scales on the host: each 32-wide K step's FP8 dot
  (mma.sync / wgmma) lands in an fp32 tile that is multiplied by its two scales and accumulated in fp32.

Both match the reference up to the order of the fp32 additions.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Literal

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.block import check_block_linear_operands
from dbr_quant.kernels.reference.dense import ACTIVATIONS, GATED
from dbr_quant.kernels.reference.mx import MX_BLOCK, MX_WEIGHT_BLOCK, check_e8m0, e8m0_to_float
from dbr_quant.kernels.triton import block_gemm, gemm_aot
from dbr_quant.kernels.triton import gemm_core as core
from dbr_quant.kernels.triton.common import AotEntry, Kernel, cdiv, device_function, on_interpreter

__all__ = ["AOT_CONFIGS", "MX_CONFIGS", "aot_attrs", "aot_options", "fp8_mx_linear"]

# tcgen05 MMA tiles are 128 rows per CTA (M = 1 decode pads: a GEMV streams W, tensor-core time is not the
# limit); BLOCK_K 128 = four 32-wide scale blocks per step. smem per stage (BLOCK_M + BLOCK_N)·128 B + scales.
# The epilogue holds the whole fp32 tile in registers: a 128×128 tile needs 8 warps (with 4: 255 registers and a
# 116-byte spill on sm_100 under triton 3.7.1; 128×256 with 8 warps spilled 268 bytes).
MX_CONFIGS: dict[str, core.GemmConfig] = {
    "mx-decode": core.GemmConfig("mx-decode", 128, 64, 128, GROUP_M=8, num_warps=4, num_stages=4),
    "mx-medium": core.GemmConfig("mx-medium", 128, 128, 128, GROUP_M=8, num_warps=8, num_stages=3),
    "mx-large": core.GemmConfig("mx-large", 128, 128, 128, GROUP_M=8, num_warps=8, num_stages=4),
}
FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
Path = Literal["scaled", "block"]


def pick_mx_config(m: int) -> core.GemmConfig:
    return MX_CONFIGS["mx-decode"] if m <= 16 else MX_CONFIGS["mx-medium"] if m <= 128 else MX_CONFIGS["mx-large"]


@device_function
def e8m0_scales(code, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[ROWS, BLOCK_K/32] E8M0 codes → one fp32 scale per element of a [ROWS, BLOCK_K] tile (the emulation)."""
    c = code.to(tl.uint32)
    s = tl.where(c == 0, 5.877471754111438e-39, (c << 23).to(tl.float32, bitcast=True))  # 0 → 2⁻¹²⁷
    wide = tl.broadcast_to(tl.reshape(s, (ROWS, BLOCK_K // 32, 1)), (ROWS, BLOCK_K // 32, 32))
    return tl.reshape(wide, (ROWS, BLOCK_K))


@device_function
def mx_dot(a, sa, w, sw, acc, FMT_A: tl.constexpr, FMT_W: tl.constexpr, SCALED_MMA: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + Σ_k a[m, k]·2^(sa[m, k/32]-127) · w[n, k]·2^(sw[n, k/32]-127): the tensor core's scaled MMA, or its fp32
    emulation (exact products: FP8 × power of two)."""
    if SCALED_MMA:
        acc = tl.dot_scaled(a, sa, FMT_A, w.T, sw, FMT_W, acc)
    else:
        af = a.to(tl.float32) * e8m0_scales(sa, BLOCK_M, BLOCK_K)
        wf = w.to(tl.float32) * e8m0_scales(sw, BLOCK_N, BLOCK_K)
        acc = tl.dot(af, tl.trans(wf), acc, input_precision="ieee")
    return acc


def _fp8_mx_linear_kernel(
    a_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_scale_ptr,
    M, N, K, KB,
    stride_am, stride_ak, stride_wn, stride_wk, stride_om, stride_on, stride_rm, stride_rn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE: tl.constexpr,
    FMT_A: tl.constexpr, FMT_W: tl.constexpr, SCALED_MMA: tl.constexpr,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
    EXP_BIAS: tl.constexpr,
):
    """out[M, N] = epilogue(Σ_k A[m, k]·sa · W[n, k]·sw): A [M, K], W [N, K] FP8 (GATED: [gate; up], 2N rows), E8M0
    codes sa [M, KB], sw [N_w, KB] contiguous uint8 (KB = ⌈K/32⌉; the up half's rows from N on)."""
    rm, rn, mask_m, mask_n = core.output_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_K // 32)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :] * stride_wk  # an N × K tile of W (rows, as scaled)
    sa_ptrs = x_scale_ptr + rm[:, None] * KB + rs[None, :]
    sw_ptrs = w_scale_ptr + rn[:, None] * KB + rs[None, :]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = acc
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        su_ptrs = sw_ptrs + N * KB
        acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k * BLOCK_K
        kb_left = KB - k * (BLOCK_K // 32)
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_left), other=0.0)
        w_mask = mask_n[:, None] & (rk[None, :] < k_left)
        s_mask = rs[None, :] < kb_left
        sa = tl.load(sa_ptrs, mask=mask_m[:, None] & s_mask, other=127)  # E8M0 127 = scale 1 (the tile is 0 there)
        sw = tl.load(sw_ptrs, mask=mask_n[:, None] & s_mask, other=127)
        acc = mx_dot(a, sa, tl.load(w_ptrs, mask=w_mask, other=0.0), sw, acc, FMT_A, FMT_W, SCALED_MMA,
                     BLOCK_M, BLOCK_N, BLOCK_K)
        if GATED:
            su = tl.load(su_ptrs, mask=mask_n[:, None] & s_mask, other=127)
            acc_up = mx_dot(a, sa, tl.load(up_ptrs, mask=w_mask, other=0.0), su, acc_up, FMT_A, FMT_W, SCALED_MMA,
                            BLOCK_M, BLOCK_N, BLOCK_K)
            up_ptrs += BLOCK_K * stride_wk
            su_ptrs += BLOCK_K // 32
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
        sa_ptrs += BLOCK_K // 32
        sw_ptrs += BLOCK_K // 32
    # scales were applied inside the dot: the epilogue's SCALE_K > 0 skips its own (the scale pointers unread)
    core.linear_epilogue(acc, acc_up, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_ptr, out_scale_ptr,
                         rm, rn, mask_m, mask_n, N,
                         KB, KB, stride_rm, stride_rn, stride_om, stride_on,
                         32, ACTIVATION, GATED, HAS_BIAS, HAS_RESIDUAL, OUT_KIND,
                         FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


MX_LINEAR_KERNEL = Kernel(_fp8_mx_linear_kernel, ("M", "KB"))


def default_path(device: torch.device) -> Path:
    """"scaled" where the tensor core applies MX scales (sm_100+) and in the interpreter, else "block"."""
    if on_interpreter() or torch.cuda.get_device_capability(device) >= (10, 0):
        return "scaled"
    return "block"


def fp8_mx_linear(
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
    config: core.GemmConfig | None = None,
    path: Path | None = None,
) -> torch.Tensor:
    """MXFP8 ``act(x·Wᵀ + bias) + residual`` (see reference.mx.fp8_mx_linear): x_scale [..., ⌈K/32⌉] and w_scale
    [N, ⌈K/32⌉] E8M0 codes. ``path``: "scaled" (the MX kernel) or "block" (the block GEMM), default by device
    (:func:`default_path`); ``config`` overrides the tile config picked by M."""
    check_e8m0(x_scale, "fp8_mx_linear: x_scale")
    check_e8m0(w_scale, "fp8_mx_linear: w_scale")
    epilogue = dict(bias=bias, activation=activation, residual=residual, out_dtype=out_dtype, out_scale=out_scale,
                    out_fmt=out_fmt)
    if (path or default_path(x_q.device)) == "block":
        return block_gemm.fp8_block_linear(x_q, e8m0_to_float(x_scale), w_q, e8m0_to_float(w_scale),
                                           block=MX_WEIGHT_BLOCK, config=config, **epilogue)  # type: ignore[arg-type]
    gated = core.check_linear("fp8_mx_linear", x_q, w_q, activation, x_scale, w_scale, bias, residual, out_scale)
    k, n, _ = check_block_linear_operands(x_q, x_scale, w_q, w_scale, MX_WEIGHT_BLOCK, gated)
    lead = x_q.shape[:-1]
    a, w_q, m = core.linear_rows(x_q, w_q, k, residual)
    kb = math.ceil(k / MX_BLOCK)
    xs = x_scale.reshape(m, kb).contiguous()
    ws = w_scale.contiguous()
    b = None if bias is None else core.fp32_vector(bias, w_q.shape[0])  # the kernel indexes it by column
    ep = core.epilogue_operands(lead, m, n, residual, out_dtype, out_scale, out_fmt, a.device)
    unused = torch.empty(1, dtype=torch.float32, device=a.device)  # stands in for the pointers not read
    cfg = config or pick_mx_config(m)
    if gated and config is None:
        cfg = cfg.gated()
    if cfg.BLOCK_K % MX_BLOCK:
        raise ValueError(f"fp8_mx_linear: BLOCK_K must be a multiple of {MX_BLOCK}, got {cfg.BLOCK_K}")
    grid = (cdiv(m, cfg.BLOCK_M) * cdiv(n, cfg.BLOCK_N),)
    if m and n:
        MX_LINEAR_KERNEL[grid](
            a, w_q, ep.out_view, xs, ws, *ep.pointers(b, unused),
            m, n, k, kb,
            a.stride(0), a.stride(1), w_q.stride(0), w_q.stride(1), *ep.strides(),
            **cfg.constexprs(), FMT_A=FORMATS[a.dtype], FMT_W=FORMATS[w_q.dtype], SCALED_MMA=not on_interpreter(),
            **ep.constexprs(activation, b is not None), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return ep.out.reshape(*lead, n)


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compilation table: the MX kernel for sm_100 (tagged), and the block GEMM's variants the "block"
# path launches on sm_89/90 (1×32 blocks: BLOCK_K narrowed to 32, as block_gemm narrows a picked config)

SM100 = "sm_100"
BLOCK_PATH_CONFIGS = {f"{c.name}-k32": dataclasses.replace(c, name=f"{c.name}-k32", BLOCK_K=MX_BLOCK)
                      for c in block_gemm.BLOCK_CONFIGS.values()}


def _mx_entry(cfg: core.GemmConfig, fmt_a: FP8Format, fmt_w: FP8Format, activation: str | None, has_bias: bool,
              res_dtype: str | None, out: str | FP8Format) -> AotEntry:
    epilogue = core.epilogue_constexprs(activation, has_bias, out)
    cfg = cfg.gated() if epilogue["GATED"] else cfg
    out_ptr = gemm_aot.OUT_PTR[str(epilogue["OUT_KIND"])]
    ptrs = {"a_ptr": gemm_aot.PTR[fmt_a], "w_ptr": gemm_aot.PTR[fmt_w], "out_ptr": out_ptr,
            "x_scale_ptr": "*u8", "w_scale_ptr": "*u8", "bias_ptr": "*fp32", "res_ptr": "*" + (res_dtype or "fp32"),
            "out_scale_ptr": "*fp32"}
    units = ("stride_ak", "stride_wk", "stride_on") + (("stride_rn",) if res_dtype else ())
    sig, consts = gemm_aot.signature(MX_LINEAR_KERNEL, ptrs, units)
    consts.update(cfg.constexprs(), FMT_A=fmt_a.value, FMT_W=fmt_w.value, SCALED_MMA=True, **epilogue,
                  HAS_RESIDUAL=res_dtype is not None)
    desc = (f"{gemm_aot.describe(cfg)} | {SM100} {fmt_a.value}x{fmt_w.value} act={activation} bias={int(has_bias)} "
            f"residual={res_dtype} out={gemm_aot.out_name(out)}")
    return ("_fp8_mx_linear_kernel", desc, MX_LINEAR_KERNEL, sig, consts)


def _block_path_entry(cfg: core.GemmConfig, fmt_a: FP8Format, fmt_w: FP8Format, activation: str | None,
                      has_bias: bool, res_dtype: str | None, out: str | FP8Format) -> AotEntry:
    return gemm_aot.linear_aot_entry("_fp8_block_linear_kernel", block_gemm.BLOCK_LINEAR_KERNEL, cfg, fmt_a, fmt_w,
                                 activation, has_bias, res_dtype, out,
                                 scales={"SCALE_N": MX_WEIGHT_BLOCK[0], "SCALE_K": MX_WEIGHT_BLOCK[1]},
                                 scales_desc="mx=1x32 ")


def _aot_configs() -> list[AotEntry]:
    fmts = list(FP8Format)
    epilogues = list(itertools.product(fmts, fmts, (None,) + ACTIVATIONS + GATED, (False, True),
                                       gemm_aot.RESIDUAL_DTYPES, gemm_aot.LINEAR_OUTS))
    return ([_mx_entry(cfg, *e) for cfg in MX_CONFIGS.values() for e in epilogues]
            + [_block_path_entry(cfg, *e) for cfg in BLOCK_PATH_CONFIGS.values() for e in epilogues])


AOT_CONFIGS: list[AotEntry] = _aot_configs()


def aot_options(entry: AotEntry) -> dict[str, int]:
    """``num_warps``/``num_stages`` of an AOT_CONFIGS entry (launch options, not constexprs)."""
    return gemm_aot.config_options({**MX_CONFIGS, **BLOCK_PATH_CONFIGS}, entry)


def aot_attrs(entry: AotEntry) -> dict:
    """Divisibility by 16 of pointers, N, K and leading strides, as the JIT finds for aligned shapes; KB is small."""
    return gemm_aot.aligned_attrs(entry, ("N", "K", "stride_am", "stride_wn", "stride_om", "stride_rm"))

