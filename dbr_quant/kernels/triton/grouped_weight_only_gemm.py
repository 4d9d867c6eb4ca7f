"""Triton grouped weight-only FP8 GEMM (W8A16) for mixture-of-experts blocks: every expert's rows in one launch.

Semantics: :func:`reference.grouped.fp8_grouped_weight_only_linear` — per expert, the dense weight-only linear
(:mod:`.weight_only_gemm`): x high precision, each expert's E4M3 weight read as bytes and decoded exactly into x's
dtype inside the K loop (:func:`weight_only_gemm.decode_main_loop`), bf16/fp16 ``tl.dot`` with fp32 accumulation,
the per-channel (or per-expert) scale on the accumulator, bias, activation incl. gated ``act(gate)·up``; fp32 x is
rounded to bf16 by torch first, as the dense kernel does. The schedule is the FP8 grouped GEMM's
(:mod:`.grouped_gemm`: ragged rows per expert, the tile→expert map derived in-kernel from ``expert_offsets``,
token rows gathered through ``slots`` or sorted rows read directly), and so is the output: sorted rows in
fp32/bf16/fp16, or the routing-weighted scatter-add into token rows (atomic, or with ``deterministic`` a slot
buffer summed in a fixed order). Against the reference: the order of the fp32 additions (and fp32 x's rounding).

For GPUs without FP8 tensor cores (Ampere: vLLM serves such MoE checkpoints through Marlin's W8A16 MoE) and
memory-bound decode, where each expert's weight streams once at one byte per element.
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton.language as tl

from dbr_quant.kernels.reference.dense import ACTIVATIONS, GATED
from dbr_quant.kernels.reference.grouped import check_grouped_args
from dbr_quant.kernels.routing import MoeRouting, expert_weight_scale
from dbr_quant.kernels.triton import gemm_aot
from dbr_quant.kernels.triton import gemm_core as core
from dbr_quant.kernels.triton.common import AotEntry, Kernel, cdiv, on_interpreter
from dbr_quant.kernels.triton.grouped_gemm import (
    EXPERT_CHUNK,
    expert_bias,
    expert_tile,
    finish_output,
    grouped_output,
    slot_weights,
    store_rows,
)
from dbr_quant.kernels.triton.weight_only_gemm import CONFIGS as DENSE_CONFIGS
from dbr_quant.kernels.triton.weight_only_gemm import MMA_DTYPES, decode_main_loop

__all__ = ["AOT_CONFIGS", "CONFIGS", "aot_attrs", "aot_options", "fp8_grouped_weight_only_linear", "pick_config"]

# The dense weight-only tiles, but K steps of 32 for the medium and large ones: with the row gather and the
# in-kernel schedule live across the K loop, the dense kernel's 64×128×64 and 128×128×64 tiles need more than 255
# registers here and spill on sm_80 (120 and 96 bytes; 344 gated); with BLOCK_K 32 they take 167 / 194 registers
# (gated 162 / 195) and no spills (python -m dbr_quant.kernels.triton.aot --arch 80 --only grouped_weight_only).
CONFIGS: dict[str, core.GemmConfig] = {
    "decode": DENSE_CONFIGS["decode"],
    "medium": core.GemmConfig("medium", 64, 128, 32, GROUP_M=8, num_warps=4, num_stages=3),
    "large": core.GemmConfig("large", 128, 128, 32, GROUP_M=8, num_warps=8, num_stages=3),
}


def pick_config(rows_per_expert: int) -> core.GemmConfig:
    """The tile config for the average rows per expert (no autotuning: must also run in the interpreter)."""
    return CONFIGS["decode"] if rows_per_expert <= 16 else CONFIGS["medium"] if rows_per_expert <= 128 \
        else CONFIGS["large"]


def _fp8_grouped_weight_only_gemm_kernel(
    a_ptr, w_ptr, out_ptr, w_scale_ptr, one_ptr, bias_ptr, slots_ptr, route_w_ptr, expert_offsets_ptr,
    N, K, num_experts, top_k, max_tiles,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_se, stride_sn, stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE: tl.constexpr,
    CHUNK: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr, OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """out = epilogue(A_rows · decode(W[e])ᵀ · sw[e]) for one (row tile, column tile) of expert e: A bf16/fp16
    (token rows gathered through ``slots`` when GATHER), W E4M3 bytes [E, N, K] (GATED: [gate; up]), sw per
    expert and channel (stride_sn 1) or per expert (0); ``one_ptr`` holds 1.0, the activation scale the shared
    epilogue multiplies by. FP8_MAX … EXP_BIAS: :func:`gemm_core.store_tile`'s constants (no FP8 output here)."""
    e, valid, rm, rn, mask_m, mask_n, slot, a_row = expert_tile(expert_offsets_ptr, slots_ptr, num_experts, top_k,
                                                               max_tiles, N, BLOCK_M, BLOCK_N, GROUP_M, CHUNK, GATHER)
    if not valid:
        return
    # 64-bit expert offset: E·N·K exceeds 2**31 for large MoEs (the offsets within one expert do not)
    acc, acc_up = decode_main_loop(a_ptr, w_ptr + e.to(tl.int64) * stride_we, a_row, rn, mask_m, mask_n, N, K,
                                   stride_am, stride_ak, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, GATED,
                                   DOT_FP32)
    y = core.scale_bias_activation(acc, acc_up, one_ptr, w_scale_ptr + e * stride_se, bias_ptr + e * stride_be,
                                   a_row, rn, mask_m, mask_n, N, 0, stride_sn, ACTIVATION, GATED, HAS_BIAS, 0)
    store_rows(y, out_ptr, one_ptr, route_w_ptr, slot, rm, rn, mask_m, mask_n, top_k, stride_om, stride_on,
               OUT_KIND, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


GROUPED_WEIGHT_ONLY_KERNEL = Kernel(_fp8_grouped_weight_only_gemm_kernel, (
    "num_experts", "top_k", "max_tiles", "stride_se", "stride_sn", "stride_be"))


def fp8_grouped_weight_only_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    routing: MoeRouting,
    *,
    x_sorted: bool = False, bias: torch.Tensor | None = None, activation: str | None = None,
    out_dtype: torch.dtype = torch.float32, topk_weights: torch.Tensor | None = None, deterministic: bool = False,
    config: core.GemmConfig | None = None,
) -> torch.Tensor:
    """:func:`reference.grouped.fp8_grouped_weight_only_linear` in one launch (two with ``deterministic``
    scatter). ``config`` overrides the tile config (tests use small tiles to get many ragged tiles per expert)."""
    op = "fp8_grouped_weight_only_linear"
    if x.dtype not in (torch.float32, *MMA_DTYPES):
        raise TypeError(f"{op}: x must be fp32, bf16 or fp16 (activations stay high precision), got {x.dtype}")
    if w_q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{op}: w_q must be float8_e4m3fn (vLLM's W8A16 layout), got {w_q.dtype}")
    core.check_device(x, w_q, w_scale, bias, topk_weights, routing.slots)
    check_grouped_args(x, w_q, routing, x_sorted, activation, None, topk_weights, op)
    num_e, n_w, k = w_q.shape
    n = n_w // 2 if activation in GATED else n_w
    x_mma = x if x.dtype in MMA_DTYPES else x.to(torch.bfloat16)  # torch's cast rounds to nearest even
    a = core.unit_stride(x_mma, 1)
    w_bytes = core.unit_stride(w_q, 2).view(torch.uint8)
    core.check_size(a, w_bytes[0])  # offsets within one expert's weight and within A are 32-bit
    rows, dev = routing.num_rows, x.device
    if max(rows, routing.num_tokens) * n >= 2**31:
        raise ValueError(f"{op}: output too large for 32-bit offsets ({rows} rows × {n})")
    ws = expert_weight_scale(w_scale, num_e, n_w, op).contiguous()
    stride_se, stride_sn = (0, 0) if ws.dim() == 0 else (ws.stride(0), 0 if ws.shape[1] == 1 else 1)
    b = expert_bias(bias, num_e, n_w, op)
    route_w = slot_weights(routing, topk_weights, op)
    out, out_view, kind_o = grouped_output(routing, n, out_dtype, topk_weights is not None, deterministic, dev, op)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    cfg = config or pick_config(cdiv(rows, num_e))  # the average rows per expert
    if activation in GATED and config is None:
        cfg = cfg.gated()
    max_tiles = cdiv(rows, cfg.BLOCK_M) + min(num_e, rows)
    if rows and n:
        GROUPED_WEIGHT_ONLY_KERNEL[(max_tiles * cdiv(n, cfg.BLOCK_N),)](
            a, w_bytes, out_view, ws.reshape(-1), one, one if b is None else b, routing.slots,
            one if route_w is None else route_w, routing.expert_offsets,
            n, k, num_e, routing.top_k, max_tiles,
            a.stride(0), a.stride(1), w_bytes.stride(0), w_bytes.stride(1), w_bytes.stride(2), out.stride(0),
            out.stride(1), stride_se, stride_sn, 0 if b is None else b.stride(0),
            **cfg.constexprs(), CHUNK=EXPERT_CHUNK, GATHER=not x_sorted,
            **core.epilogue_constexprs(activation, b is not None, kind_o),
            DOT_FP32=on_interpreter() and a.dtype == torch.bfloat16,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return finish_output(out, routing, kind_o, out_dtype)


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compilation table: every variant the wrapper launches, for Ampere (tagged sm_80, as the dense
# weight-only kernel: the dispatcher runs it where FP8 tensor cores are missing)

ARCH_TAG = "sm_80"
_OUTS = ("fp32", "bf16", "fp16", "scatter_add", "scatter_store")


def _entry(cfg: core.GemmConfig, mma: str, activation: str | None, has_bias: bool, gather: bool,
           out: str) -> AotEntry:
    epilogue = core.epilogue_constexprs(activation, has_bias, out)
    cfg = cfg.gated() if epilogue["GATED"] else cfg
    out_ptr = "*fp32" if out.startswith("scatter") else gemm_aot.OUT_PTR[out]
    ptrs = {"a_ptr": f"*{mma}", "w_ptr": "*u8", "out_ptr": out_ptr,
            "w_scale_ptr": "*fp32", "one_ptr": "*fp32", "bias_ptr": "*fp32", "slots_ptr": "*i32",
            "route_w_ptr": "*fp32", "expert_offsets_ptr": "*i32"}
    sig, consts = gemm_aot.signature(GROUPED_WEIGHT_ONLY_KERNEL, ptrs, ("stride_ak", "stride_wk", "stride_on"))
    consts.update(cfg.constexprs(), CHUNK=EXPERT_CHUNK, GATHER=gather, **epilogue, DOT_FP32=False)
    desc = (f"{gemm_aot.describe(cfg)} | {ARCH_TAG} x={mma} act={activation} bias={int(has_bias)}"
            f" rows={'gathered' if gather else 'sorted'} out={out}")
    return ("_fp8_grouped_weight_only_gemm_kernel", desc, GROUPED_WEIGHT_ONLY_KERNEL, sig, consts)


def _aot_configs() -> list[AotEntry]:
    rows = itertools.product(CONFIGS.values(), ("bf16", "fp16"), (None,) + ACTIVATIONS + GATED, (False, True),
                             (True, False), _OUTS)
    return [_entry(*args) for args in rows]


AOT_CONFIGS: list[AotEntry] = _aot_configs()


# launch options of an entry; divisibility by 16 of pointers, N, K and leading strides, as the JIT finds for
# aligned shapes
aot_options = functools.partial(gemm_aot.config_options, CONFIGS)
aot_attrs = functools.partial(gemm_aot.aligned_attrs,
                              aligned=("N", "K", "stride_am", "stride_we", "stride_wn", "stride_om"))
