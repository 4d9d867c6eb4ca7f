"""What the Triton FP8 GEMMs share (dense :mod:`gemm`, block-scaled :mod:`block_gemm`, grouped :mod:`grouped_gemm`).

Device side, written once: the tile walk (:func:`output_tile`), the main loop over K (:func:`main_loop`:
pointer arithmetic, masks on M, N and K, fp32 accumulators, block scales applied per K step when the
scales are per block) and the epilogue (:func:`scale_bias_activation`, :func:`store_tile`,
:func:`linear_epilogue`: per-tensor/row/channel scales, bias, activation incl. gated, residual,
fp32/bf16/fp16 or FP8 output).
Host side: the operand checks every wrapper makes, the epilogue's operands, and the helpers the kernel
modules' ``AOT_CONFIGS`` tables are built with.

Outputs never go through Triton's float casts where those are inexact: FP8 is rounded onto the grid in
fp32 by :func:`round_to_fp8` and stored as the bytes of :func:`fp8_bits` (the interpreter's fp8 cast drops
carries, sm_89's rounds twice), and bf16 by integer round-to-nearest-even, because the interpreter's
fp32→bf16 cast does not round to nearest-even (it disagrees with torch on ~half of all values).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.dense import ACTIVATIONS, GATED, GATED_ACTIVATIONS
from dbr_quant.kernels.triton.common import (
    check_device,
    device_function,
    fp8_bits,
    fp8_constants,
    reciprocal_rn,
    round_to_fp8,
)


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
    # FP8 sums promoted to fp32 after every BLOCK_K step (see main_loop); False leaves the whole K sum in the
    # tensor core as Triton's sm_90 default and cuBLASLt's "fast accumulation" do: benchmarks/gpu.py times it
    promote: bool = True

    def gated(self) -> GemmConfig:
        """Gated kernels hold two accumulators and load two W tiles: halve BLOCK_N to keep registers and
        shared memory (sm_89 allows 99 KB per block) the same as the plain config."""
        return dataclasses.replace(self, name=self.name + "-gated", BLOCK_N=max(16, self.BLOCK_N // 2))

    def constexprs(self) -> dict[str, int]:
        return {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N, "BLOCK_K": self.BLOCK_K, "GROUP_M": self.GROUP_M,
                "PROMOTE": self.promote}


# ---------------------------------------------------------------------------------------------------
# device side: tile walk, main loop, epilogue


@device_function
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
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
def output_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The output rows and columns of program ``pid`` (:func:`grouped_tile` order) and their masks."""
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, rm < M, rn < N


@device_function
def main_loop(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, a_rows, cols, mask_m, mask_n,
              N, K, UP_SCALE_ROW,
              stride_am, stride_ak, stride_wn, stride_wk, stride_sa, stride_sw,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
              SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, PROMOTE: tl.constexpr):
    """The loop over K: the fp32 tiles ``acc = A[a_rows] · W[cols]ᵀ`` and, when GATED (W is [gate; up]),
    ``acc_up`` of W rows ``cols + N``, both from the same A loads (else ``acc_up`` is unused).

    FP8 operands go straight into ``tl.dot`` (wgmma on sm_90, mma.sync on sm_89) with fp32 accumulation;
    every load is masked on M, N and K. Precision on sm_90: FP8 wgmma adds its products at reduced precision
    (about 14 bits, DeepSeek-V3 report §3.3.2), and Triton's sm_90 default (max_num_imprecise_acc 2^30) keeps
    the whole K sum there: measured on an H200, 3.6e-4 of Σ|products| off the fp32 sum at K = 4096. Each
    step's dot therefore sums only its BLOCK_K products in the tensor core and is promoted to the fp32
    accumulator (DeepGEMM promotes every 128; cuBLASLt without fast accumulation likewise). The block-scaled
    path does that already: each step's dot starts from zero and is scaled before it is added. The scales,
    a constexpr choice:

    * ``SCALE_K == 0`` (per tensor, row or channel): not read here; :func:`scale_bias_activation` applies
      them once, after the loop, as the reference does.
    * ``SCALE_K > 0`` (per block): ``a_scale_ptr[a_rows · stride_sa + kb]`` per A row and K block kb, and
      ``w_scale_ptr[(cols // SCALE_N) · stride_sw + kb]`` per SCALE_N-wide block of W rows (the up half's
      from scale row ``UP_SCALE_ROW`` on), applied to each step's dot before it is added. BLOCK_K divides
      SCALE_K, so a step never straddles two scale blocks.
    """
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + rk[None, :] * stride_ak
    w_ptrs = w_ptr + rk[:, None] * stride_wk + cols[None, :] * stride_wn  # a K × N tile of Wᵀ
    if SCALE_K > 0:
        sa_ptrs = a_scale_ptr + a_rows * stride_sa  # this tile's rows; + kb per step
        sw_ptrs = w_scale_ptr + (cols // SCALE_N) * stride_sw  # the scale row of each output column
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        if SCALE_K > 0:
            sw_up_ptrs = w_scale_ptr + (cols // SCALE_N + UP_SCALE_ROW) * stride_sw
    else:
        acc_up = acc
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_left), other=0.0)
        w_mask = (rk[:, None] < k_left) & mask_n[None, :]
        if SCALE_K > 0:
            kb = (k * BLOCK_K) // SCALE_K
            sa = tl.load(sa_ptrs + kb, mask=mask_m, other=0.0)
            sw = tl.load(sw_ptrs + kb, mask=mask_n, other=0.0)
            acc += tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0)) * sa[:, None] * sw[None, :]
            if GATED:
                sw_up = tl.load(sw_up_ptrs + kb, mask=mask_n, other=0.0)
                acc_up += tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0)) * sa[:, None] * sw_up[None, :]
        else:
            # max_num_imprecise_acc=BLOCK_K: each step's dot sums into a fresh partial tile that is added to
            # acc in fp32 (see the docstring); without it sm_90 keeps the whole K sum in the tensor core
            if PROMOTE:
                acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, max_num_imprecise_acc=BLOCK_K)
                if GATED:
                    acc_up = tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc)
                if GATED:
                    acc_up = tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up)
        if GATED:
            up_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return acc, acc_up


@device_function
def activate(y, ACTIVATION: tl.constexpr):
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
def bf16_bits(y):
    """fp32 → bf16 bit pattern (uint16), round-to-nearest-even like torch; NaN stays NaN."""
    bits = y.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(y != y, (bits >> 16) | 0x40, rounded).to(tl.uint16)


@device_function
def scale_bias_activation(acc, acc_up, a_scale_ptr, w_scale_ptr, bias_ptr, a_rows, cols, mask_m, mask_n,
                          N,
                          stride_sa, stride_sw,
                          ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SCALE_K: tl.constexpr):
    """The epilogue's arithmetic on :func:`main_loop`'s tiles, in the reference's order: ``acc · (sa·sw)``
    (unless SCALE_K > 0: block scales, applied in the loop) with ``sa = a_scale_ptr[a_rows · stride_sa]``,
    ``sw = w_scale_ptr[cols · stride_sw]`` (stride 0: per-tensor), + bias → activation, or when GATED
    act(gate) · up, the up half's scales and bias at column ``cols + N``.

    Gate and up are each scaled and biased in turn: with the up half scaled before the gate's bias is
    added, the grouped kernel's large gated tile needs 164 registers instead of 128 on sm_90 (halving
    its occupancy), for the same values. (The dense kernel's gated tiles take a few registers more or
    less either way, within the same occupancy: python -m dbr_quant.kernels.triton.aot prints them.)
    """
    y = acc
    if SCALE_K == 0:
        sa = tl.load(a_scale_ptr + a_rows * stride_sa, mask=mask_m, other=0.0)
        sw_ptrs = w_scale_ptr + cols * stride_sw
        y = acc * (sa[:, None] * tl.load(sw_ptrs, mask=mask_n, other=0.0)[None, :])
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=mask_n, other=0.0)[None, :]
    if GATED:
        up = acc_up
        if SCALE_K == 0:
            up = acc_up * (sa[:, None] * tl.load(sw_ptrs + N * stride_sw, mask=mask_n, other=0.0)[None, :])
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + cols, mask=mask_n, other=0.0)[None, :]
        y = activate(y, ACTIVATION) * up
    else:
        y = activate(y, ACTIVATION)
    return y


@device_function
def store_tile(y, out_ptrs, out_scale_ptr, mask,
               OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
               MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    """Store the fp32 tile as OUT_KIND: "fp8" (× 1/out_scale as torch computes it, exact RNE onto the grid in fp32,
    stored as bytes through a uint8 view), "bf16" (integer RNE, through a uint16 view) or the pointer's dtype."""
    if OUT_KIND == "fp8":
        q = round_to_fp8(y * reciprocal_rn(tl.load(out_scale_ptr)), FP8_MAX, MANTISSA_BITS, MIN_NORMAL)
        tl.store(out_ptrs, fp8_bits(q, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS), mask=mask)
    elif OUT_KIND == "bf16":
        tl.store(out_ptrs, bf16_bits(y), mask=mask)
    else:
        tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask)


@device_function
def linear_epilogue(acc, acc_up, a_scale_ptr, w_scale_ptr, bias_ptr, res_ptr, out_ptr, out_scale_ptr,
                    rm, rn, mask_m, mask_n,
                    N,
                    stride_sa, stride_sw, stride_rm, stride_rn, stride_om, stride_on,
                    SCALE_K: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, OUT_KIND: tl.constexpr, FP8_MAX: tl.constexpr,
                    MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr):
    """Everything after :func:`main_loop` for the dense and the block-scaled linear, in the reference's
    order: scales, + bias → activation (act(gate)·up) → + residual → stored as OUT_KIND."""
    y = scale_bias_activation(acc, acc_up, a_scale_ptr, w_scale_ptr, bias_ptr, rm, rn, mask_m, mask_n, N,
                              stride_sa, stride_sw, ACTIVATION, GATED, HAS_BIAS, SCALE_K)
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :] * stride_rn, mask=mask, other=0.0)
        y += res.to(tl.float32)
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
    store_tile(y, out_ptrs, out_scale_ptr, mask, OUT_KIND, FP8_MAX, MANTISSA_BITS, MIN_NORMAL, EXP_BIAS)


# ---------------------------------------------------------------------------------------------------
# host side: operands of the wrappers


FP8_DTYPES = {torch.float8_e4m3fn: FP8Format.E4M3, torch.float8_e5m2: FP8Format.E5M2}
OUT_KINDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def activation_kind(activation: str | None) -> str:
    """The ACTIVATION constexpr: gated kinds name the activation applied to the gate half."""
    if activation is None:
        return "none"
    return GATED_ACTIVATIONS.get(activation, activation)


def fp8_format(t: torch.Tensor, what: str) -> FP8Format:
    if t.dtype not in FP8_DTYPES:
        raise TypeError(f"{what} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
    return FP8_DTYPES[t.dtype]


def unit_stride(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with stride 1 along ``dim``, copied only if needed: the variants in AOT_CONFIGS (and the fast
    ones: vector loads, cp.async) have unit strides along K and N (see :class:`common.Kernel`)."""
    return t if t.stride(dim) == 1 else torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def check_size(*tensors: torch.Tensor | None) -> None:
    if any(t is not None and t.numel() >= 2**31 for t in tensors):  # offsets in the tile loops are 32-bit
        raise ValueError("tensor too large for 32-bit offsets")


_ACTIVATION_NAMES = frozenset(ACTIVATIONS + GATED)


def check_linear(op: str, x_q: torch.Tensor, w_q: torch.Tensor, activation: str | None,
                 *others: torch.Tensor | None) -> bool:
    """The checks every GEMM wrapper starts with (device, FP8 operands, activation name); whether the
    activation is gated. Any pair of FP8 formats is fine: tl.dot takes mixed E4M3/E5M2 operands."""
    check_device(x_q, w_q, *others)
    fp8_format(x_q, "x_q")
    fp8_format(w_q, "w_q")
    if activation is None:
        return False
    if activation not in _ACTIVATION_NAMES:
        raise ValueError(f"{op}: unknown activation {activation!r}; use one of {ACTIVATIONS + GATED}")
    return activation in GATED


def linear_rows(x_q: torch.Tensor, w_q: torch.Tensor, k: int,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(A: x_q as rows × K, W, rows), both with unit stride along K, sizes checked for 32-bit offsets."""
    a = rows_2d(x_q, k)
    w_q = unit_stride(w_q, 1)
    check_size(a, w_q, residual)
    return a, w_q, a.shape[0]


def row_operand(x: torch.Tensor, k: int) -> tuple[torch.Tensor, int, int, int]:
    """x (…×K) as a linear's A operand: (tensor, rows, row stride, K stride), with unit stride along K. A contiguous
    x of any rank, or a 2-D one with unit stride along K, is read in place (a view per call is host time on a GPU);
    others through a 2-D view, copied when K is strided."""
    if k and x.is_contiguous():
        return x, x.numel() // k, k, 1
    a = rows_2d(x, k)
    return a, a.shape[0], a.stride(0), a.stride(1)


def rows_2d(x: torch.Tensor, k: int) -> torch.Tensor:
    """x (…×K) as rows × K with unit stride along K: a 2-D x itself (no view) when it has that stride."""
    return unit_stride(x if x.dim() == 2 and k else x.reshape(-1, k), 1)


def fp32(t: torch.Tensor) -> torch.Tensor:
    """``t.detach().float()`` without the two new tensors when ``t`` is already a plain fp32 tensor: the kernels read
    only its storage (per launch, on a GPU, each tensor op is host time)."""
    return t if t.dtype == torch.float32 and not t.requires_grad else t.detach().float()


def scale_values(scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A per-tensor or per-channel scale as a kernel reads it: fp32 values and the stride between them (0 for one
    value; a contiguous one is read in place whatever its shape, others through a flattened view)."""
    s = fp32(scale)
    if s.numel() == 1:
        return s, 0
    if s.is_contiguous():
        return s, 1
    s = s.reshape(-1)
    return s, s.stride(0)


def fp32_vector(t: torch.Tensor, n: int) -> torch.Tensor:
    """A bias of n values as the kernels read it (fp32, contiguous: they index ``bias_ptr + column``); ``t`` itself
    when it already is that vector."""
    t = fp32(t)
    return t if t.dim() == 1 and t.shape[0] == n and t.stride(0) == 1 else t.reshape(n).contiguous()


class EpilogueOperands(NamedTuple):
    """What :func:`linear_epilogue` reads and writes, as the host prepares them (a NamedTuple: built on every
    launch, and a frozen dataclass takes microseconds to construct)."""

    residual: torch.Tensor | None  # m × n rows (``out_strides`` [2:] apart) with unit stride along N
    out: torch.Tensor  # the result, shaped (*lead, n): m × n rows, contiguous
    out_view: torch.Tensor  # the view of ``out`` the kernel stores through (uint8 for FP8, uint16 for bf16)
    kind: str  # the OUT_KIND constexpr
    fmt: FP8Format  # the FP8 format of an FP8 output (E4M3 otherwise: its constants are then unused)
    out_scale: torch.Tensor | None  # an FP8 output's scale (fp32, one value); the kernel takes its reciprocal
    out_strides: tuple[int, int, int, int]  # what :meth:`strides` returns

    def pointers(self, bias: torch.Tensor | None, any_fp32: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The kernel's ``bias_ptr, res_ptr, out_scale_ptr``; ``any_fp32`` stands in for those not read."""
        res, inv = self.residual, self.out_scale
        return (any_fp32 if bias is None else bias, any_fp32 if res is None else res, any_fp32 if inv is None else inv)

    def strides(self) -> tuple[int, int, int, int]:
        """The kernel's ``stride_om, stride_on, stride_rm, stride_rn`` (``out`` as m × n rows)."""
        return self.out_strides

    def constexprs(self, activation: str | None, has_bias: bool) -> Mapping[str, object]:
        return _epilogue_launch_constexprs(activation, has_bias, self.fmt if self.kind == "fp8" else self.kind,
                                           self.residual is not None)

    def launch_options(self, cfg: GemmConfig, activation: str | None, has_bias: bool) -> Mapping[str, object]:
        """All keyword arguments of a linear launch: ``cfg``'s constexprs and launch options, the epilogue's
        constexprs (one mapping per variant, built on its first launch)."""
        return linear_launch_options(cfg, activation, has_bias, self.fmt if self.kind == "fp8" else self.kind,
                                     self.residual is not None)


@functools.cache
def _epilogue_launch_constexprs(activation: str | None, has_bias: bool, out: str | FP8Format,
                                has_residual: bool) -> Mapping[str, object]:
    return MappingProxyType({**epilogue_constexprs(activation, has_bias, out), "HAS_RESIDUAL": has_residual})


@functools.cache
def linear_launch_options(cfg: GemmConfig, activation: str | None, has_bias: bool, out: str | FP8Format,
                          has_residual: bool) -> Mapping[str, object]:
    """``cfg.constexprs()``, the epilogue's constexprs and ``num_warps``/``num_stages``: the keyword arguments of
    a linear kernel's launch, built once per variant (a read-only mapping: every launch of it shares it)."""
    return MappingProxyType({**cfg.constexprs(), **_epilogue_launch_constexprs(activation, has_bias, out, has_residual),
                             "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


@functools.cache
def gated_config(cfg: GemmConfig) -> GemmConfig:
    """``cfg.gated()``, built once per config."""
    return cfg.gated()


def epilogue_operands(lead: torch.Size, m: int, n: int, residual: torch.Tensor | None, out_dtype: torch.dtype,
                      out_scale: torch.Tensor | None, out_fmt: FP8Format | str,
                      device: torch.device) -> EpilogueOperands:
    """The epilogue's operands for an output of ``m`` rows (``lead`` flattened) × ``n``. The output is allocated
    in its final shape ``(*lead, n)`` (contiguous, so its rows are ``n`` apart): no reshape after the launch."""
    res = None
    res_strides = (0, 0)
    if residual is not None:
        if residual.is_contiguous() and residual.shape == (*lead, n):  # its rows in place, n apart
            res, res_strides = residual if residual.dtype in OUT_KINDS else residual.float(), (n, 1)
        else:
            res = unit_stride(torch.broadcast_to(residual, (*lead, n)).reshape(m, n), 1)
            if res.dtype not in OUT_KINDS:
                res = res.float()
            res_strides = (res.stride(0), res.stride(1))
    if out_scale is not None:
        fmt_o = FP8Format.parse(out_fmt)
        if out_scale.numel() != 1:
            raise ValueError("out_scale must be a single (0-d) scale: the next op's per-tensor input scale")
        out = torch.empty((*lead, n), dtype=fmt_o.dtype, device=device)
        return EpilogueOperands(res, out, out.view(torch.uint8), "fp8", fmt_o, fp32(out_scale), (n, 1, *res_strides))
    kind = OUT_KINDS.get(out_dtype)
    if kind is None:
        raise TypeError(f"out_dtype must be one of {list(OUT_KINDS)} (or pass out_scale for FP8)")
    out = torch.empty((*lead, n), dtype=out_dtype, device=device)
    return EpilogueOperands(res, out, out.view(torch.uint16) if kind == "bf16" else out, kind, FP8Format.E4M3, None,
                            (n, 1, *res_strides))

def epilogue_constexprs(activation: str | None, has_bias: bool, out: str | FP8Format) -> dict[str, object]:
    """The epilogue's constexprs for an output (an OUT_KIND name or the FP8 format of an FP8 output)."""
    kind = "fp8" if isinstance(out, FP8Format) else out
    return {"ACTIVATION": activation_kind(activation), "GATED": activation in GATED, "HAS_BIAS": has_bias,
            "OUT_KIND": kind, **fp8_constants(out if isinstance(out, FP8Format) else FP8Format.E4M3)}
