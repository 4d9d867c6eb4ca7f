"""Triton FP8 GEMMs with fused epilogues: ``fp8_linear`` (x·Wᵀ) and batched ``fp8_matmul`` (a @ b).

Both match :mod:`reference` (``exact=True``): FP8 operands go straight into ``tl.dot`` (wgmma on sm_90,
mma.sync on sm_89) with an fp32 accumulator, and every scale is applied once, after the K loop, in the
same order as the reference (``acc · (sx·sw)``, then bias, activation, residual). Only the order of the
fp32 additions inside the dot differs, so results agree to a few ulp of the accumulator's magnitude.

Layout follows the Triton matmul tutorial: pointers, sizes, strides, then UPPER_CASE constexprs.
Every load and store is masked on M, N and K, so any shape works (M = 1 decode, odd K, ragged N);
scales are indexed through a stride that is 0 for a per-tensor scale, so per-tensor, per-row and
per-channel scales share one compiled kernel. Epilogue variants that change the code (activation,
gating, bias, residual, output kind) are constexprs; :data:`AOT_CONFIGS` lists every combination the
wrappers can launch, for ahead-of-time compilation and register/spill checks.

Outputs never go through Triton's float casts where those are inexact: FP8 is built with
:func:`round_to_fp8` + :func:`fp8_bits`, and bf16 by integer round-to-nearest-even, because the
interpreter's fp32→bf16 cast does not round to nearest-even (it disagrees with torch on ~half of all values).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import triton
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.dense import ACTIVATIONS, GATED, GATED_ACTIVATIONS
from dbr_quant.kernels.triton.common import Kernel, check_device, device_function, fp8_bits, fp8_constants, round_to_fp8

__all__ = [
    "AOT_CONFIGS", "CONFIGS", "GemmConfig", "aot_attrs", "aot_options", "fp8_linear", "fp8_matmul", "pick_config",
]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch options. ``num_warps``/``num_stages`` are launch options, not constexprs."""

    name: str
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def gated(self) -> GemmConfig:
        """Gated kernels hold two accumulators and load two W tiles: halve BLOCK_N to keep registers and
        shared memory (sm_89 allows 99 KB per block) the same as the plain config."""
        return dataclasses.replace(self, name=self.name + "-gated", BLOCK_N=max(16, self.BLOCK_N // 2))

    def constexprs(self) -> dict[str, int]:
        return {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N, "BLOCK_K": self.BLOCK_K, "GROUP_M": self.GROUP_M}


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


@device_function
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id → (tile row, tile column), walking GROUP_M tile rows column by column, so CTAs that run
    together share both their A rows and their W columns in L2 (tutorial "L2 cache optimizations")."""
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@device_function
def _activate(y, ACTIVATION: tl.constexpr):
    """The reference's activations in fp32. tanh is not available in the interpreter (libdevice), and
    gelu_tanh needs none: 0.5·(1 + tanh(u)) = sigmoid(2u), which also avoids tanh's cancellation."""
    if ACTIVATION == "relu":
        y = tl.maximum(y, 0.0)
    elif ACTIVATION == "gelu":
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = y / (1.0 + tl.exp(0.0 - 2.0 * u))
    elif ACTIVATION == "silu":
        y = y / (1.0 + tl.exp(0.0 - y))
    return y


@device_function
def _bf16_bits(y):
    """fp32 → bf16 bit pattern (uint16), round-to-nearest-even like torch; NaN stays NaN."""
    bits = y.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(y != y, (bits >> 16) | 0x40, rounded).to(tl.uint16)


def _fp8_linear_kernel(
    a_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, inv_out_scale_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_om, stride_on, stride_rm, stride_rn, stride_xs, stride_ws,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
    EXP_BIAS: tl.constexpr,
):
    """out[M, N] = epilogue(A[M, K] · W[N, K]ᵀ). GATED: W is [gate; up] (2N × K); the same CTA computes
    the gate and up tiles of its output columns (two accumulators sharing each A tile) so act(gate)·up
    is formed in registers and the 2N-wide intermediate never reaches memory."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    w_ptrs = w_ptr + rk[:, None] * stride_wk + rn[None, :] * stride_wn  # a K × N tile of Wᵀ
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_left), other=0.0)
        w_mask = (rk[:, None] < k_left) & mask_n[None, :]
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc)
        if GATED:
            acc_up = tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up)
            up_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    # epilogue, in the reference's order: acc·(sx·sw) + bias → activation → + residual → output
    xs = tl.load(x_scale_ptr + rm * stride_xs, mask=mask_m, other=0.0)
    y = acc * (xs[:, None] * tl.load(w_scale_ptr + rn * stride_ws, mask=mask_n, other=0.0)[None, :])
    up = y
    if GATED:
        up = acc_up * (xs[:, None] * tl.load(w_scale_ptr + (rn + N) * stride_ws, mask=mask_n, other=0.0)[None, :])
    linear_epilogue(y, up, rm, rn, mask_m, mask_n, N, bias_ptr, res_ptr, out_ptr, inv_out_scale_ptr,
                    stride_rm, stride_rn, stride_om, stride_on, ACTIVATION, GATED, HAS_BIAS, HAS_RESIDUAL, OUT_KIND,
                    FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


@device_function
def linear_epilogue(y, up, rm, rn, mask_m, mask_n, N, bias_ptr, res_ptr, out_ptr, inv_out_scale_ptr,
                    stride_rm, stride_rn, stride_om, stride_on,
                    ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr,
                    MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    """Everything after the scaled fp32 accumulator ``y`` (and ``up``, the up half's, when GATED; bias
    column n + N), in the reference's order: + bias → activation (act(gate)·up) → + residual → stored as
    OUT_KIND. Shared by every linear kernel (per-tensor/channel scales here, block scales in triton_block_gemm)."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=mask_n, other=0.0)[None, :]
    if GATED:
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + rn, mask=mask_n, other=0.0)[None, :]
        y = _activate(y, ACTIVATION) * up
    else:
        y = _activate(y, ACTIVATION)
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :] * stride_rn, mask=mask, other=0.0)
        y += res.to(tl.float32)
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
    if OUT_KIND == "fp8":  # quantize for the next op: × 1/scale (torch-computed), exact RNE, bytes
        q = round_to_fp8(y * tl.load(inv_out_scale_ptr), FP8_MAX, MANTISSA_BITS, MIN_NORMAL)
        tl.store(out_ptrs, fp8_bits(q, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS), mask=mask)
    elif OUT_KIND == "bf16":
        tl.store(out_ptrs, _bf16_bits(y), mask=mask)
    else:
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _fp8_matmul_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr,
    M, N, K, B1,
    stride_a0, stride_a1, stride_am, stride_ak, stride_b0, stride_b1, stride_bk, stride_bn,
    stride_c0, stride_c1, stride_cm, stride_cn, stride_sa0, stride_sa1, stride_sam, stride_sb0, stride_sb1,
    stride_sbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
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
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    sa = tl.load(sa_ptr + z0 * stride_sa0 + z1 * stride_sa1 + rm * stride_sam, mask=mask_m, other=0.0)
    sb = tl.load(sb_ptr + z0 * stride_sb0 + z1 * stride_sb1 + rn * stride_sbn, mask=mask_n, other=0.0)
    c = acc * (sa[:, None] * sb[None, :])
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c, mask=mask_m[:, None] & mask_n[None, :])


class _GemmKernel(Kernel):
    """A :class:`Kernel` whose JIT does not specialize the given int arguments.

    Triton compiles a separate variant for every int argument equal to 1 (it becomes a constexpr). For
    the unit strides along K (A, W) and N (out, residual) that is wanted (contiguous → vector loads and
    cp.async pipelining), and the wrappers guarantee it. For M (= 1 when decoding) and the scale strides
    (0 or 1: per-tensor or per-row) it would only multiply the variants, so those are not specialized
    and :data:`AOT_CONFIGS` lists exactly the variants the wrappers launch.
    """

    def __init__(self, fn, do_not_specialize: tuple[str, ...]) -> None:
        super().__init__(fn)
        self.jit = triton.jit(fn, do_not_specialize=do_not_specialize)


LINEAR_KERNEL = _GemmKernel(_fp8_linear_kernel, ("M", "stride_xs", "stride_ws"))
MATMUL_KERNEL = _GemmKernel(_fp8_matmul_kernel, ("M", "B1", "stride_sa0", "stride_sa1", "stride_sam", "stride_sb0",
                                                 "stride_sb1", "stride_sbn"))

_FP8_DTYPES = {torch.float8_e4m3fn: FP8Format.E4M3, torch.float8_e5m2: FP8Format.E5M2}
_OUT_KINDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_MAX_GRID_Z = 65535


def _activation_kind(activation: str | None) -> str:
    """The ACTIVATION constexpr: gated kinds name the activation applied to the gate half."""
    return {**GATED_ACTIVATIONS, None: "none"}.get(activation, activation)


def _fp8_format(t: torch.Tensor, what: str) -> FP8Format:
    if t.dtype not in _FP8_DTYPES:
        raise TypeError(f"{what} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
    return _FP8_DTYPES[t.dtype]


def _unit_stride(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with stride 1 along ``dim``, copied only if needed: the variants in AOT_CONFIGS (and the fast
    ones: vector loads, cp.async) have unit strides along K and N (see :class:`_GemmKernel`)."""
    return t if t.stride(dim) == 1 else torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def _check_size(*tensors: torch.Tensor) -> None:
    if any(t is not None and t.numel() >= 2**31 for t in tensors):  # offsets in the tile loops are 32-bit
        raise ValueError("tensor too large for 32-bit offsets")


def epilogue_operands(lead: torch.Size, m: int, n: int, residual: torch.Tensor | None, out_dtype: torch.dtype,
                      out_scale: torch.Tensor | None, out_fmt: FP8Format | str, device: torch.device):
    """What :func:`linear_epilogue` reads and writes, for an output of ``m`` rows (``lead`` flattened) × ``n``:
    (residual as m×n with unit stride along N or None, out, its view the kernel stores through, OUT_KIND,
    the FP8 format of an FP8 output, 1/out_scale as computed by reference.quantize or None)."""
    res = None
    if residual is not None:
        res = _unit_stride(torch.broadcast_to(residual, (*lead, n)).reshape(m, n), 1)
        if res.dtype not in _OUT_KINDS:
            res = res.float()
    if out_scale is not None:
        fmt_o = FP8Format.parse(out_fmt)
        if out_scale.numel() != 1:
            raise ValueError("out_scale must be a single (0-d) scale: the next op's per-tensor input scale")
        inv = torch.reciprocal(out_scale.detach().float()).reshape(1)  # same reciprocal as reference.quantize
        out = torch.empty((m, n), dtype=fmt_o.dtype, device=device)
        return res, out, out.view(torch.uint8), "fp8", fmt_o, inv
    if out_dtype not in _OUT_KINDS:
        raise TypeError(f"out_dtype must be one of {list(_OUT_KINDS)} (or pass out_scale for FP8)")
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    kind = _OUT_KINDS[out_dtype]
    return res, out, out.view(torch.uint16) if kind == "bf16" else out, kind, FP8Format.E4M3, None


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
) -> torch.Tensor:
    """``act(x·Wᵀ·sx·sw + bias) + residual`` in one kernel (see reference.fp8_linear).

    With ``out_scale`` (0-d: the next op's input scale) the result is stored as FP8 in ``out_fmt``,
    quantized exactly like ``reference.quantize`` (× a reciprocal computed by torch, RNE, saturating), so
    fc1 → act → fc2 chains pass FP8 without a high-precision round trip; ``out_dtype`` is then ignored.
    ``config`` overrides the block config picked by M (tests use small tiles to get many ragged edges).
    """
    check_device(x_q, x_scale, w_q, w_scale, bias, residual, out_scale)
    _fp8_format(x_q, "x_q")  # any pair of FP8 formats: tl.dot takes mixed E4M3/E5M2 operands
    _fp8_format(w_q, "w_q")
    if activation is not None and activation not in ACTIVATIONS + GATED:
        raise ValueError(f"unknown activation {activation!r}; use one of {ACTIVATIONS + GATED}")
    gated = activation in GATED
    lead, k = x_q.shape[:-1], x_q.shape[-1]
    n_w = w_q.shape[0]
    if w_q.dim() != 2 or w_q.shape[1] != k:
        raise ValueError(f"w_q must be N×K with K = {k}, got {tuple(w_q.shape)}")
    if gated and n_w % 2:
        raise ValueError(f"gated activation {activation!r} needs W stacked as [gate; up], got {n_w} rows")
    n = n_w // 2 if gated else n_w
    a = _unit_stride(x_q.reshape(-1, k), 1)
    w_q = _unit_stride(w_q, 1)
    m = a.shape[0]
    _check_size(a, w_q, residual)
    dev = a.device
    xs = x_scale.detach().float()
    xs = xs.reshape(1) if xs.numel() == 1 else torch.broadcast_to(xs, (*lead, 1)).reshape(m)
    ws = w_scale.detach().float().reshape(-1)
    if ws.numel() not in (1, n_w):
        raise ValueError(f"w_scale must be a scalar or have {n_w} values, got {tuple(w_scale.shape)}")
    b = None if bias is None else bias.detach().float().reshape(n_w)
    res, out, out_view, kind, fmt_o, inv = epilogue_operands(lead, m, n, residual, out_dtype, out_scale, out_fmt, dev)
    inv = xs if inv is None else inv  # any fp32 pointer when the output is not FP8
    cfg = config or pick_config(m)
    if gated and config is None:
        cfg = cfg.gated()
    grid = (triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N),)
    if m and n:
        LINEAR_KERNEL[grid](
            a, w_q, out_view, xs, ws, xs if b is None else b, xs if res is None else res, inv,
            m, n, k,
            a.stride(0), a.stride(1), w_q.stride(0), w_q.stride(1), out.stride(0), out.stride(1),
            0 if res is None else res.stride(0), 0 if res is None else res.stride(1),
            0 if xs.numel() == 1 else xs.stride(0), 0 if ws.numel() == 1 else ws.stride(0),
            **cfg.constexprs(), ACTIVATION=_activation_kind(activation),
            GATED=gated, HAS_BIAS=b is not None, HAS_RESIDUAL=res is not None, OUT_KIND=kind,
            **fp8_constants(fmt_o), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out.reshape(*lead, n)


def fp8_matmul(
    a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor, *,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Batched ``(a_q @ b_q) · a_scale · b_scale`` (see reference.fp8_matmul), fp32 result.

    Batch dims broadcast like torch.matmul (through strides, no copies of the operands). Scales may be
    per-tensor (0-d), per row of a (…×M×1) or per column of b (…×1×N, as fp8_attention's per-token K).
    """
    check_device(a_q, a_scale, b_q, b_scale)
    _fp8_format(a_q, "a_q")
    _fp8_format(b_q, "b_q")
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
    a_q = _unit_stride(a_q, -1)
    b_q = b_q if b_q.stride(-2) == 1 else _unit_stride(b_q, -1)
    a, b, c = as_4d(a_q, m, k), as_4d(b_q, k, n), as_4d(out, m, n)
    sa, sb = as_4d(a_scale.detach().float(), m, 1), as_4d(b_scale.detach().float(), 1, n)
    _check_size(a[0, 0], b[0, 0], c[0, 0])
    b0, b1 = c.shape[0], c.shape[1]
    if b1 > _MAX_GRID_Z:
        raise ValueError(f"the innermost batch dim ({b1}) exceeds the CUDA grid limit {_MAX_GRID_Z}")
    cfg = config or pick_config(m)
    tiles = triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N)
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

_PTR = {FP8Format.E4M3: "*fp8e4nv", FP8Format.E5M2: "*fp8e5"}
_OUT_PTR = {"fp32": "*fp32", "bf16": "*u16", "fp16": "*fp16", "fp8": "*u8"}


def _signature(kernel: _GemmKernel, ptrs: dict[str, str], units: tuple[str, ...]) -> tuple[dict, dict]:
    """Pointer types as given, unit strides as constexpr 1 (as the JIT specializes them), other ints i32."""
    sig = {p.name: ptrs.get(p.name, "constexpr" if p.is_constexpr or p.name in units else "i32")
           for p in kernel.jit.params}
    return sig, dict.fromkeys(units, 1)


def _describe(c: GemmConfig) -> str:
    return f"{c.name} {c.BLOCK_M}x{c.BLOCK_N}x{c.BLOCK_K} warps={c.num_warps} stages={c.num_stages}"


def _linear_entry(cfg, fmt_a, fmt_w, activation, has_bias, res_dtype, out):
    """One AOT_CONFIGS row for fp8_linear; ``out`` is "fp32"/"bf16"/"fp16" or an FP8Format."""
    kind = "fp8" if isinstance(out, FP8Format) else out
    gated = activation in GATED
    cfg = cfg.gated() if gated else cfg
    ptrs = {"a_ptr": _PTR[fmt_a], "w_ptr": _PTR[fmt_w], "out_ptr": _OUT_PTR[kind], "x_scale_ptr": "*fp32",
            "w_scale_ptr": "*fp32", "bias_ptr": "*fp32", "res_ptr": "*" + (res_dtype or "fp32"),
            "inv_out_scale_ptr": "*fp32"}
    units = ("stride_ak", "stride_wk", "stride_on") + (("stride_rn",) if res_dtype else ())
    sig, consts = _signature(LINEAR_KERNEL, ptrs, units)
    consts.update(cfg.constexprs(), ACTIVATION=_activation_kind(activation), GATED=gated, HAS_BIAS=has_bias,
                  HAS_RESIDUAL=res_dtype is not None, OUT_KIND=kind,
                  **fp8_constants(out if kind == "fp8" else FP8Format.E4M3))
    out_name = f"fp8{out.value}" if kind == "fp8" else kind
    desc = (f"{_describe(cfg)} | {fmt_a.value}x{fmt_w.value} act={activation} bias={int(has_bias)}"
            f" residual={res_dtype} out={out_name}")
    return ("_fp8_linear_kernel", desc, LINEAR_KERNEL, sig, consts)


def _matmul_entry(cfg, fmt_a, fmt_b, b_layout):
    """``b_layout`` "kn": b row-major (P·V); "nk": b is a transposed row-major tensor (Q·Kᵀ)."""
    ptrs = {"a_ptr": _PTR[fmt_a], "b_ptr": _PTR[fmt_b], "c_ptr": "*fp32", "sa_ptr": "*fp32", "sb_ptr": "*fp32"}
    units = ("stride_ak", "stride_bn" if b_layout == "kn" else "stride_bk", "stride_cn")
    sig, consts = _signature(MATMUL_KERNEL, ptrs, units)
    consts.update(cfg.constexprs())
    desc = f"{_describe(cfg)} | {fmt_a.value}x{fmt_b.value} b={b_layout}"
    return ("_fp8_matmul_kernel", desc, MATMUL_KERNEL, sig, consts)


def _aot_configs() -> list[tuple[str, str, Kernel, dict, dict]]:
    fmts = list(FP8Format)
    linear = itertools.product(CONFIGS.values(), fmts, fmts, (None,) + ACTIVATIONS + GATED, (False, True),
                               (None, "fp32", "bf16", "fp16"), ("fp32", "bf16", "fp16", *FP8Format))
    matmul = itertools.product(CONFIGS.values(), fmts, fmts, ("kn", "nk"))
    return [_linear_entry(*args) for args in linear] + [_matmul_entry(*args) for args in matmul]


AOT_CONFIGS: list[tuple[str, str, Kernel, dict, dict]] = _aot_configs()


def aot_options(entry: tuple[str, str, Kernel, dict, dict]) -> dict[str, int]:
    """``num_warps``/``num_stages`` of an AOT_CONFIGS entry (launch options: pass as triton.compile options)."""
    cfg = CONFIGS[entry[1].split()[0].removesuffix("-gated")]  # descriptions start with the config's name
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def aot_attrs(entry: tuple[str, str, Kernel, dict, dict]) -> dict:
    """ASTSource ``attrs`` for the common aligned case (the JIT adds them when pointers, K, N and the
    leading strides are multiples of 16): without them loads are not vectorized nor cp.async-pipelined."""
    sig = entry[3]
    aligned = {"N", "K", "stride_am", "stride_wn", "stride_om", "stride_rm", "stride_bk", "stride_bn",
               "stride_cm", "stride_a0", "stride_a1", "stride_b0", "stride_b1", "stride_c0", "stride_c1"}
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
            if ty.startswith("*") or (ty == "i32" and name in aligned)}
