"""Triton weight-only FP8 linear (W8A16): FP8 weights decoded to bf16/fp16 inside the K loop, bf16/fp16 MMA.

For GPUs without FP8 tensor cores (Ampere sm_80/86: vLLM serves these checkpoints through Marlin,
``CompressedTensorsW8A16Fp8``) and the memory-bound decode: the weight streams as one byte per element, the
activations stay as they are. Semantics: :mod:`dbr_quant.kernels.reference.weight_only`.

* The weight is read through a uint8 view and decoded by bit moves (:func:`decode_e4m3`): exact (every E4M3 value
  is a bf16 and an fp16 value), independent of Triton's FP8 types, which sm_80 lacks in hardware (and the same code
  in the interpreter). E4M3's NaN code reads as ±480, as the CPU backend's upcasts do.
* x is bf16 or fp16 (the MMA dtype); an fp32 x is rounded to bf16 by torch before the launch (round to nearest
  even: the interpreter's fp32→bf16 cast does not round so). Triton 3.7's interpreter multiplies bf16 tiles in
  ``tl.dot`` as if their bits were integers, so there (only) bf16 tiles are widened to fp32 for the dot
  (``DOT_FP32``): the same products, exactly, and the same fp32 accumulation.
* ``tl.dot`` of the bf16/fp16 tiles with an fp32 accumulator (``mma.sync … bf16`` on sm_80), the per-channel (or
  per-tensor) weight scale on the accumulator after the loop, then :func:`gemm_core.linear_epilogue` (bias,
  activation incl. gated [gate; up], residual, fp32/bf16/fp16 or FP8 out). Against the reference: the order of the
  fp32 additions (bf16/fp16 x), plus x's rounding to bf16 (fp32 x).

Prefill (M > :data:`DECODE_ONCE_ABOVE_M` rows, see there for where the threshold comes from): the decode in the K
loop runs once per 128-row tile and competes with the MMA, so the wrapper instead decodes W once per call to x's MMA
dtype with its scale (:func:`weight_decode.decode_weight`, one Triton launch: ``(w_q·w_scale).to(dtype)``, an N×K
transient of 2 bytes per element), multiplies with ``torch.matmul`` (cuBLAS, fp32 accumulation) and runs the
reference's epilogue in fp32 torch ops (none for a plain linear whose output dtype is x's). What differs from the
fused kernel, which scales the fp32 accumulator: each decoded weight ``w_q·w_scale`` is rounded to bf16 (relative
2⁻⁹) or fp16 (2⁻¹¹; below fp16's 2⁻¹⁴ an absolute 2⁻²⁵), and cuBLAS rounds the sum to x's dtype once more (the same
unit; fp16 overflows past 65504 as the unquantized fp16 linear would). So against the reference, before the epilogue,
``|y - y_ref| ≤ (2u + K·2⁻²³)·Σₖ|xₖ|·|w_q·w_scale|ₙₖ`` (+ 2⁻²⁴·(Σₖ|xₖ| + 1) for fp16) with u = 2⁻⁹ (bf16) or 2⁻¹¹
(fp16), where the fused kernel's is ``K·2⁻²⁴·Σₖ|xₖ|·|w_q·w_scale|ₙₖ``; activation, residual and the output dtype
follow as in the reference. The bound assumes cuBLAS accumulates in fp32; torch lets it reduce split-K partial sums
in bf16/fp16 unless ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` (``…fp16…``) is False.
"""

from __future__ import annotations

import itertools
from typing import Literal

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.dense import ACTIVATIONS, GATED, linear_epilogue
from dbr_quant.kernels.reference.weight_only import check_weight_only
from dbr_quant.kernels.triton import gemm_aot
from dbr_quant.kernels.triton import gemm_core as core
from dbr_quant.kernels.triton.common import AotEntry, Kernel, cdiv, device_function, on_interpreter
from dbr_quant.kernels.triton.weight_decode import decode_e4m3, decode_weight

__all__ = ["AOT_CONFIGS", "CONFIGS", "DECODE_ONCE_ABOVE_M", "aot_attrs", "aot_options", "decode_e4m3",
           "decode_main_loop", "fp8_weight_only_linear", "pick_path"]

# Tiles for Ampere's mma.sync (BLOCK_M ≥ 16). decode: one 16-row tile, narrow N → many CTAs streaming W, long K
# steps; smem per stage (16·128·2 + 128·64·1) = 12 KB. medium/large: bf16 A tiles take 2 bytes per element, so
# BLOCK_K 64 keeps 3-4 stages under sm_86's 99 KB.
CONFIGS: dict[str, core.GemmConfig] = {
    "decode": core.GemmConfig("decode", 16, 64, 128, GROUP_M=8, num_warps=4, num_stages=4),
    "medium": core.GemmConfig("medium", 64, 128, 64, GROUP_M=8, num_warps=4, num_stages=3),
    "large": core.GemmConfig("large", 128, 128, 64, GROUP_M=8, num_warps=8, num_stages=3),
}
MMA_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
Path = Literal["fused", "decode_once"]

# Above this many rows the weight is decoded once per call (weight_decode, 3 bytes of HBM traffic per element) and
# multiplied by cuBLAS, instead of decoded in the K loop once per 128-row tile. Derived from the roofline estimate
# (benchmarks/roofline.py, table 5; an estimate, not a measurement) on an A100 SXM: the fused kernel's decode costs
# DECODE_OPS = 6 integer ops per weight element per tile on CUDA cores (19.5 TOP/s), the decode-once pass 1 + 2 bytes
# per element at 2.04 TB/s, so decoding once wins from ⌈M/128⌉·6/19.5e12 > 3/2.039e12, i.e. ⌈M/128⌉ ≥ 5 (M > 512);
# with 3 µs per launch the Llama-3 shapes cross at M = 513 … 641 (4096×4096 last): the largest, 641, is where the
# estimate says decoding once is faster for every one of them (roofline.weight_only_crossover_m, which
# tests/test_roofline.py checks against this constant).
DECODE_ONCE_ABOVE_M = 640


def pick_path(m: int) -> Path:
    """"decode_once" (decode W once, cuBLAS) above :data:`DECODE_ONCE_ABOVE_M` rows, else "fused"."""
    return "decode_once" if m > DECODE_ONCE_ABOVE_M else "fused"


def pick_config(m: int) -> core.GemmConfig:
    """The tile config for an output of ``m`` rows (no autotuning: must also run in the interpreter)."""
    return CONFIGS["decode"] if m <= 16 else CONFIGS["medium"] if m <= 128 else CONFIGS["large"]


@device_function
def decode_main_loop(a_ptr, w_ptr, a_rows, cols, mask_m, mask_n, N, K, stride_am, stride_ak, stride_wn, stride_wk,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                     DOT_FP32: tl.constexpr):
    """fp32 ``A[a_rows] · decode(W[cols])ᵀ`` over K (and the up half's, rows ``cols + N``, when GATED): A
    bf16/fp16, W E4M3 bytes decoded in each K step into A's dtype (exact), ``tl.dot`` with fp32 accumulation.
    The dense kernel's rows are its output rows; the grouped kernel's the tokens its sorted rows gather."""
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + rk[None, :] * stride_ak
    w_ptrs = w_ptr + rk[:, None] * stride_wk + cols[None, :] * stride_wn  # a K × N tile of Wᵀ
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = acc
    up_ptrs = w_ptrs
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_left), other=0.0)
        w_mask = (rk[:, None] < k_left) & mask_n[None, :]
        w = decode_e4m3(tl.load(w_ptrs, mask=w_mask, other=0)).to(a.dtype)  # exact: E4M3 ⊂ bf16, fp16
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc)
        if GATED:
            up = decode_e4m3(tl.load(up_ptrs, mask=w_mask, other=0)).to(a.dtype)
            acc_up = tl.dot(a, up, acc_up)
            up_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return acc, acc_up


def _fp8_weight_only_linear_kernel(
    a_ptr, w_ptr, out_ptr, w_scale_ptr, one_ptr, bias_ptr, res_ptr, out_scale_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_om, stride_on, stride_rm, stride_rn, stride_ws,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE: tl.constexpr,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
    EXP_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """out[M, N] = epilogue((A · decode(W)ᵀ) · sw[n]): A [M, K] bf16/fp16, W [N, K] E4M3 bytes (GATED: [gate; up],
    2N rows), sw per channel (stride_ws 1) or per tensor (0); ``one_ptr`` holds 1.0, the activation scale the
    shared epilogue multiplies by."""
    rm, rn, mask_m, mask_n = core.output_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, acc_up = decode_main_loop(a_ptr, w_ptr, rm, rn, mask_m, mask_n, N, K, stride_am, stride_ak, stride_wn,
                                   stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, GATED, DOT_FP32)
    core.linear_epilogue(acc, acc_up, one_ptr, w_scale_ptr, bias_ptr, res_ptr, out_ptr, out_scale_ptr,
                         rm, rn, mask_m, mask_n, N,
                         0, stride_ws, stride_rm, stride_rn, stride_om, stride_on,
                         0, ACTIVATION, GATED, HAS_BIAS, HAS_RESIDUAL, OUT_KIND,
                         FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


# M (1 when decoding) and the scale stride (0 per tensor, 1 per channel) would each double the variants
WEIGHT_ONLY_KERNEL = Kernel(_fp8_weight_only_linear_kernel, ("M", "stride_ws"))


def fp8_weight_only_linear(
    x: torch.Tensor,
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
    """``act(x·(w_q·w_scale)ᵀ + bias) + residual`` (see reference.weight_only): one fused kernel, or above
    :data:`DECODE_ONCE_ABOVE_M` rows the weight decoded once and cuBLAS (``path`` forces one; see the module
    docstring for how their numbers differ). ``config`` overrides the fused kernel's tile config picked by M (tests
    use small tiles to get many ragged edges)."""
    check_weight_only(x, w_q, w_scale)
    if w_q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_weight_only_linear: w_q must be float8_e4m3fn (vLLM's W8A16 layout), got {w_q.dtype}")
    core.check_device(x, w_q, w_scale, bias, residual, out_scale)
    if activation is not None and activation not in ACTIVATIONS + GATED:
        raise ValueError(f"fp8_weight_only_linear: unknown activation {activation!r}; use one of {ACTIVATIONS + GATED}")
    gated = activation in GATED
    shape = x.shape
    lead, k, n_w = shape[:-1], shape[-1], w_q.shape[0]
    if gated and n_w % 2:
        raise ValueError(f"fp8_weight_only_linear: gated activation {activation!r} needs W stacked as [gate; up], "
                         f"got {n_w} rows")
    n = n_w // 2 if gated else n_w
    x_mma = x if x.dtype in MMA_DTYPES else x.to(torch.bfloat16)  # torch's cast rounds to nearest even
    a, m, stride_am, stride_ak = core.row_operand(x_mma, k)
    w_bytes = core.unit_stride(w_q, 1).view(torch.uint8)
    core.check_size(a, w_bytes, residual)
    if (path or pick_path(m)) == "decode_once":
        return _decode_once_linear(a.reshape(m, k), w_q, core.fp32(w_scale).reshape(-1), lead, n, bias, activation,
                                   residual, out_dtype, out_scale, FP8Format.parse(out_fmt))
    ws, stride_ws = core.scale_values(w_scale)
    one = _one(a.device)
    b = None if bias is None else core.fp32_vector(bias, n_w)
    ep = core.epilogue_operands(lead, m, n, residual, out_dtype, out_scale, out_fmt, a.device)
    cfg = config or pick_config(m)
    if gated and config is None:
        cfg = core.gated_config(cfg)
    if m and n:
        WEIGHT_ONLY_KERNEL[(cdiv(m, cfg.BLOCK_M) * cdiv(n, cfg.BLOCK_N),)](
            a, w_bytes, ep.out_view, ws, one, *ep.pointers(b, one),
            m, n, k,
            stride_am, stride_ak, *w_bytes.stride(), *ep.strides(), stride_ws,
            **ep.launch_options(cfg, activation, b is not None),
            DOT_FP32=on_interpreter() and a.dtype == torch.bfloat16,
        )
    return ep.out


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A 1.0 in fp32 on ``device`` (the activation scale the kernel's shared epilogue multiplies by), made once
    per device: the kernels only read it. One made while a CUDA graph is being captured is not kept (its
    memory belongs to the graph's pool and is not ours after the graph is freed)."""
    one = _ONES.get(device)
    if one is None:
        one = torch.ones(1, dtype=torch.float32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _ONES[device] = one
    return one


def _decode_once_linear(a: torch.Tensor, w_q: torch.Tensor, ws: torch.Tensor, lead: torch.Size, n: int,
                        bias: torch.Tensor | None, activation: str | None, residual: torch.Tensor | None,
                        out_dtype: torch.dtype, out_scale: torch.Tensor | None, out_fmt: FP8Format) -> torch.Tensor:
    """The prefill path: W decoded once to a's dtype with its scale (weight_decode), ``torch.matmul`` (cuBLAS on the
    GPU) in a's dtype, then the reference's epilogue in fp32 (torch ops) unless there is nothing to do."""
    y = torch.matmul(a, decode_weight(w_q, ws, a.dtype).t())
    if bias is None and activation is None and residual is None and out_scale is None and out_dtype == y.dtype:
        return y.reshape(*lead, n)
    pre = y.float() if bias is None else y.float() + bias.detach().float()
    res = None if residual is None else residual.reshape(-1, n)
    return linear_epilogue(pre, activation, res, out_dtype, out_scale, out_fmt).reshape(*lead, n)


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compilation table: the variants the wrapper launches, for Ampere (tagged sm_80: the dispatcher
# runs this kernel where FP8 tensor cores are missing; on sm_89+ the JIT compiles it when it is asked for)

ARCH_TAG = "sm_80"


def _entry(cfg: core.GemmConfig, mma: str, activation: str | None, has_bias: bool, res_dtype: str | None,
           out: str | FP8Format) -> AotEntry:
    epilogue = core.epilogue_constexprs(activation, has_bias, out)
    cfg = cfg.gated() if epilogue["GATED"] else cfg
    ptrs = {"a_ptr": f"*{mma}", "w_ptr": "*u8", "out_ptr": gemm_aot.OUT_PTR[str(epilogue["OUT_KIND"])],
            "w_scale_ptr": "*fp32", "one_ptr": "*fp32", "bias_ptr": "*fp32", "res_ptr": "*" + (res_dtype or "fp32"),
            "out_scale_ptr": "*fp32"}
    units = ("stride_ak", "stride_wk", "stride_on") + (("stride_rn",) if res_dtype else ())
    sig, consts = gemm_aot.signature(WEIGHT_ONLY_KERNEL, ptrs, units)
    consts.update(cfg.constexprs(), **epilogue, HAS_RESIDUAL=res_dtype is not None, DOT_FP32=False)
    desc = (f"{gemm_aot.describe(cfg)} | {ARCH_TAG} x={mma} act={activation} bias={int(has_bias)} residual={res_dtype} "
            f"out={gemm_aot.out_name(out)}")
    return ("_fp8_weight_only_linear_kernel", desc, WEIGHT_ONLY_KERNEL, sig, consts)


def _aot_configs() -> list[AotEntry]:
    rows = itertools.product(CONFIGS.values(), ("bf16", "fp16"), (None,) + ACTIVATIONS + GATED, (False, True),
                             gemm_aot.RESIDUAL_DTYPES, gemm_aot.LINEAR_OUTS)
    return [_entry(*args) for args in rows]


AOT_CONFIGS: list[AotEntry] = _aot_configs()


def aot_options(entry: AotEntry) -> dict[str, int]:
    """``num_warps``/``num_stages`` of an AOT_CONFIGS entry (launch options, not constexprs)."""
    return gemm_aot.config_options(CONFIGS, entry)


def aot_attrs(entry: AotEntry) -> dict:
    """Divisibility by 16 of pointers, N, K and leading strides, as the JIT finds for aligned shapes."""
    return gemm_aot.aligned_attrs(entry, ("N", "K", "stride_am", "stride_wn", "stride_om", "stride_rm"))
