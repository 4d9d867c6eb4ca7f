"""Triton grouped FP8 GEMM for mixture-of-experts blocks: every expert's rows in one launch.

Matches :mod:`reference.grouped` (``exact=True``): per expert, the dense kernel's math (FP8 operands
into ``tl.dot``, fp32 accumulator, ``acc·(sx·sw[e]) + b[e]``, activation or gated ``act(gate)·up``, then
fp32/bf16/fp16, FP8 with the next projection's input scale, or the routing-weighted scatter-add).

Tile schedule (ragged rows per expert, no padding). :func:`kernels.routing.moe_route` sorts rows by expert
and gives ``expert_offsets``; expert ``e`` needs ``ceil(rows_e / BLOCK_M)`` row tiles. Each program
derives the schedule from the offsets itself (:func:`tile_of`: a prefix sum of tiles per expert over
chunks of 64 experts, then "how many experts end at or before my tile"), so a launch needs no host-side
schedule, no host sync and no extra kernels; experts without rows own no tiles. The grid is an upper
bound known from shapes alone, ``cdiv(rows, BLOCK_M) + min(E, rows)`` row tiles, and programs past the
real tile count return at once. (vLLM's ``fused_moe`` instead pads each expert's rows to BLOCK_M with a
separate ``moe_align_block_size`` kernel; deriving the schedule in-kernel saves that launch, which
matters at decode where each launch is a few µs of a ~100 µs block.) Program ids map to (row tile, column
tile) through the dense GEMM's GROUP_M ordering, so neighbouring programs share weight columns in L2.

Rows either read their token's activations through ``slots`` (GATHER: the gate_up GEMM reads the token-
order quantized input, nothing is permuted in memory) or read sorted rows directly (the down GEMM reads
the gate_up output, or :func:`moe_quantize`'s per-expert quantized rows).

Weighted scatter-add (the down GEMM): ``OUT_KIND="scatter_add"`` multiplies each row by its routing
weight and adds it into its token's fp32 output row with ``tl.atomic_add`` (relaxed). Atomics keep the
block at three launches (quantize, gate_up, down) and need no [T, top_k, N] buffer. Order: a token's
``top_k`` contributions land in whatever order the programs run. For ``top_k ≤ 2`` that is still
deterministic, since the output starts at zero and one IEEE addition is commutative (0 + a + b = a + b =
b + a, bit for bit); for ``top_k ≥ 3`` the last bit can vary run to run. ``deterministic=True`` selects
``"scatter_store"`` instead: rows weighted and stored at their slot of a [T·top_k, N] buffer, then summed
over the slots in a fixed order by torch (a fourth launch, and top_k× the output bytes).
"""

from __future__ import annotations

import itertools

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.dense import ACTIVATIONS, GATED
from dbr_quant.kernels.reference.grouped import check_grouped_args
from dbr_quant.kernels.routing import MoeRouting, expert_out_scale, expert_weight_scale, input_scale_kind
from dbr_quant.kernels.triton import gemm_aot
from dbr_quant.kernels.triton import gemm_core as core
from dbr_quant.kernels.triton.common import (
    AotEntry,
    Kernel,
    cdiv,
    check_device,
    device_function,
    fp8_constants,
    reciprocal_rn,
)
from dbr_quant.kernels.triton.gemm import CONFIGS, pick_config
from dbr_quant.kernels.triton.quantize import LOADED_DTYPES, block_max, block_sum, quantize_bits

__all__ = ["AOT_CONFIGS", "aot_attrs", "aot_options", "expert_bias", "finish_output", "fp8_grouped_linear",
           "expert_tile", "grouped_output", "moe_quantize", "slot_weights", "store_rows", "tile_of"]

EXPERT_CHUNK = 64  # experts examined per step of the tile schedule (a 64-lane prefix sum)
QUANT_BLOCK = 1024  # columns per step of the gather-quantize kernel


@device_function
def tile_of(tile, expert_offsets_ptr, num_experts, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Row tile ``tile`` of the ragged schedule → (expert, its first row in the tile, the expert's end row,
    total tiles). Expert e owns tiles [T_e, T_e + ceil(rows_e / BLOCK_M)) with T_e the prefix sum; since
    those ends are non-decreasing, the owner is the number of experts whose tiles end at or before
    ``tile``, and its first tile is the largest such end. BLOCK_M = 1 maps a row to its expert."""
    lanes = tl.arange(0, CHUNK)
    done = tile * 0  # tiles of the experts before this chunk (scalars typed like ``tile``)
    expert = tile * 0
    first_tile = tile * 0
    for chunk in range(0, num_experts, CHUNK):
        idx = chunk + lanes
        live = idx < num_experts
        start = tl.load(expert_offsets_ptr + idx, mask=live, other=0)
        end = tl.load(expert_offsets_ptr + idx + 1, mask=live, other=0)
        tiles_end = tl.associative_scan((end - start + BLOCK_M - 1) // BLOCK_M, 0, tl.standard._sum_combine) + done
        before = live & (tiles_end <= tile)
        expert += block_sum(before.to(tl.int32))
        first_tile = tl.maximum(first_tile, block_max(tl.where(before, tiles_end, 0)))
        done = block_max(tl.where(live, tiles_end, done))
    valid = tile < done
    e = tl.where(valid, expert, 0)  # past the last tile: a safe index (the program returns)
    row = tl.load(expert_offsets_ptr + e) + (tile - first_tile) * BLOCK_M
    return e, row, tl.load(expert_offsets_ptr + e + 1), valid


@device_function
def expert_tile(expert_offsets_ptr, slots_ptr, num_experts, top_k, max_tiles, N, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, CHUNK: tl.constexpr, GATHER: tl.constexpr):
    """This program's tile of a grouped GEMM: (expert, valid, its sorted rows, output columns, their masks, each
    row's slot = token · top_k + choice, the input row each reads: its token's when GATHER, else itself)."""
    pid_m, pid_n = core.grouped_tile(tl.program_id(0), max_tiles * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    e, row0, row_end, valid = tile_of(pid_m, expert_offsets_ptr, num_experts, BLOCK_M, CHUNK)
    rm = row0 + tl.arange(0, BLOCK_M)  # sorted rows of expert e
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < row_end
    mask_n = rn < N
    slot = tl.load(slots_ptr + rm, mask=mask_m, other=0)
    a_row = slot // top_k if GATHER else rm
    return e, valid, rm, rn, mask_m, mask_n, slot, a_row


def _fp8_grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_scale_ptr, slots_ptr, route_w_ptr,
    expert_offsets_ptr,
    N, K, num_experts, top_k, max_tiles,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_xe, stride_xr, stride_se, stride_sn, stride_be, stride_ie,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE: tl.constexpr,
    CHUNK: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr, OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr,
):
    """out = epilogue(A_rows · W[e]ᵀ) for one (row tile, column tile) of expert e. GATED: W[e] is [gate; up]
    (2N × K) and the CTA holds both accumulators, as the dense kernel (act(gate)·up formed in registers).
    Scales are indexed through strides that are 0 where they do not vary: x by expert (stride_xe) or by
    input row (stride_xr), W by expert (stride_se) and channel (stride_sn), the FP8 output by expert."""
    e, valid, rm, rn, mask_m, mask_n, slot, a_row = expert_tile(expert_offsets_ptr, slots_ptr, num_experts, top_k,
                                                               max_tiles, N, BLOCK_M, BLOCK_N, GROUP_M, CHUNK, GATHER)
    if not valid:
        return
    # 64-bit expert offset: E·N·K exceeds 2**31 for large MoEs (the offsets within one expert do not);
    # SCALE_N, SCALE_K = 1, 0: scales per tensor/expert/row/channel, applied after the loop
    acc, acc_up = core.main_loop(a_ptr, w_ptr + e.to(tl.int64) * stride_we, x_scale_ptr, w_scale_ptr, a_row, rn,
                                 mask_m, mask_n, N, K, N,
                                 stride_am, stride_ak, stride_wn, stride_wk, stride_xr, stride_sn,
                                 BLOCK_M, BLOCK_N, BLOCK_K, GATED, 1, 0, PROMOTE)
    y = core.scale_bias_activation(acc, acc_up, x_scale_ptr + e * stride_xe, w_scale_ptr + e * stride_se,
                                   bias_ptr + e * stride_be, a_row, rn, mask_m, mask_n, N, stride_xr, stride_sn,
                                   ACTIVATION, GATED, HAS_BIAS, 0)
    # an FP8 output takes the next projection's input scale, per expert or shared
    store_rows(y, out_ptr, out_scale_ptr + e * stride_ie, route_w_ptr, slot, rm, rn, mask_m, mask_n, top_k,
               stride_om, stride_on, OUT_KIND, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


@device_function
def store_rows(y, out_ptr, out_scale_ptr, route_w_ptr, slot, rows, cols, mask_m, mask_n, top_k,
               stride_om, stride_on, OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
               MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    """A grouped GEMM's fp32 tile of sorted ``rows``: weighted by each row's routing weight and atomically added
    into its token's row ("scatter_add") or stored at its slot ("scatter_store"), else stored at the sorted row
    as OUT_KIND (:func:`gemm_core.store_tile`)."""
    mask = mask_m[:, None] & mask_n[None, :]
    if OUT_KIND == "scatter_add" or OUT_KIND == "scatter_store":
        y = y * tl.load(route_w_ptr + slot, mask=mask_m, other=0.0)[:, None]
        dest = slot // top_k if OUT_KIND == "scatter_add" else slot
        out_ptrs = out_ptr + dest[:, None] * stride_om + cols[None, :] * stride_on
        if OUT_KIND == "scatter_add":
            tl.atomic_add(out_ptrs, y, mask=mask, sem="relaxed")
        else:
            tl.store(out_ptrs, y, mask=mask)
    else:
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        core.store_tile(y, out_ptrs, out_scale_ptr, mask, OUT_KIND, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


def _moe_quantize_kernel(x_ptr, slots_ptr, expert_offsets_ptr, scale_ptr, q_ptr, K, num_experts, top_k,
                         stride_xm, BLOCK: tl.constexpr, CHUNK: tl.constexpr, FP8_MAX: tl.constexpr,
                         MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    """Sorted row r = its token's activations quantized with its expert's scale (one program per row)."""
    r = tl.program_id(0)
    e, _, _, _ = tile_of(r, expert_offsets_ptr, num_experts, 1, CHUNK)
    inv = reciprocal_rn(tl.load(scale_ptr + e))
    x_row = x_ptr + (tl.load(slots_ptr + r) // top_k).to(tl.int64) * stride_xm
    q_row = q_ptr + r.to(tl.int64) * K
    cols = tl.arange(0, BLOCK)
    for start in range(0, K, BLOCK):
        mask = start + cols < K
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_row + start + cols, quantize_bits(x, inv, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS),
                 mask=mask)


GROUPED_KERNEL = Kernel(_fp8_grouped_gemm_kernel, (
    "num_experts", "top_k", "max_tiles", "stride_xe", "stride_xr", "stride_se", "stride_sn", "stride_be", "stride_ie"))
MOE_QUANTIZE_KERNEL = Kernel(_moe_quantize_kernel, ("num_experts", "top_k"))


def pick_grouped_config(rows: int, num_experts: int) -> core.GemmConfig:
    """The dense GEMM's config for the average rows per expert (no autotuning: must run interpreted)."""
    return pick_config(cdiv(rows, num_experts))


def fp8_grouped_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    routing: MoeRouting,
    *,
    x_sorted: bool = False,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.float32,
    out_scale: torch.Tensor | None = None,
    out_fmt: FP8Format | str = FP8Format.E4M3,
    topk_weights: torch.Tensor | None = None,
    deterministic: bool = False,
    config: core.GemmConfig | None = None,
) -> torch.Tensor:
    """:func:`reference.grouped.fp8_grouped_linear` in one launch (two with ``deterministic`` scatter).

    ``config`` overrides the block config (tests use small tiles to get many ragged tiles per expert).
    """
    op = "fp8_grouped_linear"
    core.check_linear(op, x_q, w_q, None, x_scale, w_scale, bias, out_scale, topk_weights, routing.slots)
    check_grouped_args(x_q, w_q, routing, x_sorted, activation, out_scale, topk_weights, op)
    num_e, n_w, k = w_q.shape
    gated = activation in GATED
    n = n_w // 2 if gated else n_w
    rows, dev = routing.num_rows, x_q.device
    a = core.unit_stride(x_q, 1)
    w_q = core.unit_stride(w_q, 2)
    core.check_size(a, w_q[0])  # offsets within one expert's weight and within A are 32-bit
    if max(rows, routing.num_tokens) * n >= 2**31:
        raise ValueError(f"{op}: output too large for 32-bit offsets ({rows} rows × {n})")

    xs = core.fp32(x_scale)
    kind = input_scale_kind(xs, num_e, a.shape[0], op)
    xs = xs.reshape(-1)
    stride_xe, stride_xr = {"tensor": (0, 0), "expert": (1, 0), "row": (0, 1)}[kind]
    ws = expert_weight_scale(w_scale, num_e, n_w, op).contiguous()
    stride_se, stride_sn = (0, 0) if ws.dim() == 0 else (ws.stride(0), 0 if ws.shape[1] == 1 else 1)
    b = expert_bias(bias, num_e, n_w, op)
    route_w = slot_weights(routing, topk_weights, op)
    o_scale, stride_ie, fmt_o = xs, 0, FP8Format.E4M3  # xs: a stand-in, not read without an FP8 output
    if out_scale is not None and topk_weights is None:
        fmt_o, kind_o = FP8Format.parse(out_fmt), "fp8"
        o_scale = expert_out_scale(out_scale, num_e, op).reshape(-1)  # the kernel takes its reciprocal
        stride_ie = 0 if o_scale.numel() == 1 else 1
        out = torch.empty((rows, n), dtype=fmt_o.dtype, device=dev)
        out_view = out.view(torch.uint8)
    else:
        out, out_view, kind_o = grouped_output(routing, n, out_dtype, topk_weights is not None, deterministic, dev,
                                               op)

    cfg = config or pick_grouped_config(rows, num_e)
    if gated and config is None:
        cfg = cfg.gated()
    max_tiles = cdiv(rows, cfg.BLOCK_M) + min(num_e, rows)
    if rows and n:
        GROUPED_KERNEL[(max_tiles * cdiv(n, cfg.BLOCK_N),)](
            a, w_q, out_view, xs, ws, xs if b is None else b, o_scale, routing.slots,
            xs if route_w is None else route_w, routing.expert_offsets,
            n, k, num_e, routing.top_k, max_tiles,
            a.stride(0), a.stride(1), w_q.stride(0), w_q.stride(1), w_q.stride(2), out.stride(0), out.stride(1),
            stride_xe, stride_xr, stride_se, stride_sn, 0 if b is None else b.stride(0), stride_ie,
            **cfg.constexprs(), CHUNK=EXPERT_CHUNK, GATHER=not x_sorted,
            **core.epilogue_constexprs(activation, b is not None, fmt_o if kind_o == "fp8" else kind_o),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return finish_output(out, routing, kind_o, out_dtype)


def expert_bias(bias: torch.Tensor | None, num_e: int, n_w: int, op: str) -> torch.Tensor | None:
    """The per-expert bias [E, N] as the kernels read it (fp32, contiguous), or None."""
    if bias is None:
        return None
    if tuple(bias.shape) != (num_e, n_w):
        raise ValueError(f"{op}: bias must be [E, N] = [{num_e}, {n_w}], got {tuple(bias.shape)}")
    return core.fp32(bias).contiguous()


def slot_weights(routing: MoeRouting, topk_weights: torch.Tensor | None, op: str) -> torch.Tensor | None:
    """Routing weights in slot order (token · top_k + choice): the kernels index them by slot."""
    if topk_weights is None:
        return None
    if tuple(topk_weights.shape) != (routing.num_tokens, routing.top_k):
        raise ValueError(f"{op}: topk_weights must be [{routing.num_tokens}, {routing.top_k}] like the "
                         f"routing's topk_ids, got {tuple(topk_weights.shape)}")
    return core.fp32(topk_weights).contiguous().reshape(-1)


def grouped_output(routing: MoeRouting, n: int, out_dtype: torch.dtype, combine: bool, deterministic: bool,
                   device: torch.device, op: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(out, the view the kernel stores through, OUT_KIND) of a high-precision grouped output: with ``combine``
    fp32 token rows for the atomic scatter-add, or (``deterministic``, top_k > 1) a [T·top_k, N] slot buffer that
    :func:`finish_output` sums in a fixed order; else sorted rows in ``out_dtype``."""
    if combine:
        kind = "scatter_store" if deterministic and routing.top_k > 1 else "scatter_add"
        shape = (routing.num_rows, n) if kind == "scatter_store" else (routing.num_tokens, n)
        out = (torch.empty if kind == "scatter_store" else torch.zeros)(shape, dtype=torch.float32, device=device)
        return out, out, kind
    if out_dtype not in core.OUT_KINDS:
        raise TypeError(f"{op}: out_dtype must be one of {list(core.OUT_KINDS)} (or pass out_scale for FP8)")
    kind = core.OUT_KINDS[out_dtype]
    out = torch.empty((routing.num_rows, n), dtype=out_dtype, device=device)
    return out, out.view(torch.uint16) if kind == "bf16" else out, kind


def finish_output(out: torch.Tensor, routing: MoeRouting, kind: str, out_dtype: torch.dtype) -> torch.Tensor:
    """After the launch: the fixed-order combine over each token's top_k slots ("scatter_store"), and a combined
    output's cast to ``out_dtype``."""
    if kind == "scatter_store":
        out = out.view(routing.num_tokens, routing.top_k, out.shape[1]).sum(1)
    if kind.startswith("scatter") and out_dtype != torch.float32:
        out = out.to(out_dtype)
    return out


def moe_quantize(x: torch.Tensor, x_scale: torch.Tensor, routing: MoeRouting, fmt: FP8Format) -> torch.Tensor:
    """:func:`reference.grouped.moe_quantize` (per-expert scales, sorted rows out) in one launch."""
    check_device(x, x_scale, routing.slots)
    if x_scale.dim() != 1 or x_scale.numel() != routing.num_experts:
        raise ValueError(f"moe_quantize: x_scale must hold one scale per expert ([{routing.num_experts}]), "
                         f"got shape {tuple(x_scale.shape)}")
    if x.dim() != 2 or x.shape[0] != routing.num_tokens:
        raise ValueError(f"moe_quantize: x must be [{routing.num_tokens}, K] (tokens of the routing), "
                         f"got {tuple(x.shape)}")
    x_c = core.unit_stride(x if x.dtype in LOADED_DTYPES else x.float(), 1)
    q = torch.empty((routing.num_rows, x.shape[1]), dtype=fmt.dtype, device=x.device)
    if q.numel():
        MOE_QUANTIZE_KERNEL[(routing.num_rows,)](
            x_c, routing.slots, routing.expert_offsets, core.fp32(x_scale).contiguous(), q.view(torch.uint8),
            x.shape[1], routing.num_experts, routing.top_k, x_c.stride(0),
            BLOCK=QUANT_BLOCK, CHUNK=EXPERT_CHUNK, **fp8_constants(fmt))
    return q


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compilation table: every variant the wrappers can launch (what the JIT would compile)

_GROUPED_OUTS = ("fp32", "bf16", "fp16", *FP8Format, "scatter_add", "scatter_store")


def _grouped_entry(cfg: core.GemmConfig, fmt_a: FP8Format, fmt_w: FP8Format, activation: str | None, has_bias: bool,
                   gather: bool, out: str | FP8Format) -> AotEntry:
    """One AOT_CONFIGS row for fp8_grouped_linear; ``out`` is an OUT_KIND name or an FP8Format."""
    epilogue = core.epilogue_constexprs(activation, has_bias, out)
    cfg = cfg.gated() if epilogue["GATED"] else cfg
    kind = str(epilogue["OUT_KIND"])
    out_ptr = "*fp32" if kind.startswith("scatter") else gemm_aot.OUT_PTR[kind]
    ptrs = {"a_ptr": gemm_aot.PTR[fmt_a], "w_ptr": gemm_aot.PTR[fmt_w], "out_ptr": out_ptr,
            "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*fp32", "out_scale_ptr": "*fp32",
            "slots_ptr": "*i32", "route_w_ptr": "*fp32", "expert_offsets_ptr": "*i32"}
    sig, consts = gemm_aot.signature(GROUPED_KERNEL, ptrs, ("stride_ak", "stride_wk", "stride_on"))
    consts.update(cfg.constexprs(), CHUNK=EXPERT_CHUNK, GATHER=gather, **epilogue)
    desc = (f"{gemm_aot.describe(cfg)} | {fmt_a.value}x{fmt_w.value} act={activation} bias={int(has_bias)}"
            f" rows={'gathered' if gather else 'sorted'} out={gemm_aot.out_name(out)}")
    return ("_fp8_grouped_gemm_kernel", desc, GROUPED_KERNEL, sig, consts)


def _moe_quantize_entry(x_dtype: str, fmt: FP8Format) -> AotEntry:
    ptrs = {"x_ptr": f"*{x_dtype}", "slots_ptr": "*i32", "expert_offsets_ptr": "*i32", "scale_ptr": "*fp32",
            "q_ptr": "*u8"}
    sig, consts = gemm_aot.signature(MOE_QUANTIZE_KERNEL, ptrs, ())
    consts.update(BLOCK=QUANT_BLOCK, CHUNK=EXPERT_CHUNK, **fp8_constants(fmt))
    return ("_moe_quantize_kernel", f"moe_quantize x={x_dtype} {fmt.value} BLOCK={QUANT_BLOCK} warps=4",
            MOE_QUANTIZE_KERNEL, sig, consts)


def _aot_configs() -> list[AotEntry]:
    fmts = list(FP8Format)
    grouped = itertools.product(CONFIGS.values(), fmts, fmts, (None,) + ACTIVATIONS + GATED, (False, True),
                                (True, False), _GROUPED_OUTS)
    quant = itertools.product(("fp32", "bf16", "fp16"), fmts)
    return [_grouped_entry(*args) for args in grouped] + [_moe_quantize_entry(*args) for args in quant]


AOT_CONFIGS: list[AotEntry] = _aot_configs()


def aot_attrs(entry: AotEntry) -> dict:
    """ASTSource ``attrs`` for the common aligned case (pointers, K, N and leading strides multiples of 16),
    as the JIT would specialize them: without them loads are neither vectorized nor cp.async-pipelined."""
    return gemm_aot.aligned_attrs(entry, ("N", "K", "stride_am", "stride_we", "stride_wn", "stride_om", "stride_xm"))


def aot_options(entry: AotEntry) -> dict[str, int]:
    """``num_warps``/``num_stages`` an AOT_CONFIGS entry is launched with (triton.compile options)."""
    if entry[0] == "_moe_quantize_kernel":
        return {"num_warps": 4, "num_stages": 3}  # Triton's launch defaults, which moe_quantize uses
    return gemm_aot.config_options(CONFIGS, entry)
