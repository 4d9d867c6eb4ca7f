"""FP8 flash attention (forward) in Triton: the fused counterpart of :func:`reference.fp8_attention`.

One program computes a BLOCK_M × HEAD_DIM tile of the output for one (batch, query head) and streams
K/V in BLOCK_N-key tiles, keeping an fp32 online softmax (running max ``m``, running sum ``l``) so the
Lq × Lk score matrix never exists in memory. Both GEMMs are FP8 ``tl.dot`` with fp32 accumulation
(``wgmma … e4m3`` on sm_90, ``mma.sync … e4m3`` on sm_89).

Numerics versus the reference (which quantizes the *normalised* P = softmax(S)):
* here P is the *unnormalised* ``exp(s - m_running) ∈ [0, 1]``; it is rounded to FP8 with ``p_scale``
  (default 1/fmt.max, so the row maximum lands exactly on fmt.max), multiplied into V, and the sum
  ``l`` of the unrounded P divides the accumulator at the end. Rounding different numbers means the
  result cannot match the reference bit for bit. Both differ from exact attention by at most
  ``2^-(M+1) · max|v|·sv · (1 + Lk·p_scale·MIN_NORMAL)`` per element (M mantissa bits: each rounded P
  has relative error ≤ 2^-(M+1), plus half a subnormal step; the weights sum to 1 and l ≥ 1), so they
  differ from each other by at most twice that. The tests check these bounds.
* scores are kept in log2 units (log2(e) folded into the scale) so the softmax uses ``exp2``.
* a float mask is clamped below at -2^127 (``-inf`` stays ``-inf``): ``finfo.min · log2(e)`` would
  overflow to -inf and turn a row masked with finfo.min (uniform weights in torch) into zeros.
* a row whose keys are all masked (l = 0) outputs 0, as in the reference and SDPA.

Scales: per tensor, per head (q and p over query heads, k and v over kv heads: a head's v and p scales are
constant along the reduction of P·V, so they multiply that head's output) or per token for q and k (v's would
scale the reduction dim of P·V: not supported).

Tiles (:func:`gpu_tile`): on sm_90 without a mask, 128 keys per step and 128 query rows (64 for short queries), so both
GEMMs issue ``wgmma m64n128k32``, and P goes to FP8 with the hardware's single-rounding ``cvt.rn.satfinite``. The tile
the H100 measured (64 × 32 keys, 8 warps) issued ``m64n16k32`` for Q·Kᵀ: two warpgroups split 32 keys. With a mask
(its BLOCK_M × BLOCK_N tile is loaded too) ptxas spills at 128 keys, so masked launches keep 32-key tiles.
The register counts behind these choices: ``python -m dbr_quant.kernels.triton.aot --arch 90 --all --only attn``.

Limits: forward only; element offsets inside one (batch, head) slice are int32; every tile is masked (no mask-free fast
path for interior tiles, which costs a few ALU ops per score).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton.language as tl

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.dense import head_view
from dbr_quant.kernels.triton.common import (
    AotEntry,
    Kernel,
    cdiv,
    check_device,
    fp8_constants,
    on_interpreter,
    round_to_fp8,
)

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr global, so kernels may read it
HEAD_DIMS = (16, 32, 64, 128)
MASK_KINDS = {"none": 0, "bool": 1, "float": 2}
ARCHS = (90, 89)
SHORT_QUERIES = 64  # up to this many query rows (decode, short prompts) a 64-row tile wastes less


@dataclasses.dataclass(frozen=True)
class AttnTile:
    """One launch configuration: query rows and keys per step, warps, pipeline stages, and how P becomes FP8
    (``native_cast``: the hardware's single-rounding cvt, sm_90; else :func:`round_to_fp8` in fp32)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    native_cast: bool


def gpu_tile(lq: int, head_dim: int, arch: int, masked: bool) -> AttnTile:
    """The tile :func:`fp8_attention` launches on a GPU of compute capability ``arch`` (see the module docstring;
    every returned tile compiles without spills, checked by the AOT table)."""
    if arch < 90:  # Ada (mma.sync): ptxas spilled for D = 64 with 128 rows and for D = 16 with 8 warps
        return AttnTile(64, 32, 4 if head_dim == 16 else 8, 3, False)
    short = lq <= SHORT_QUERIES
    if not masked:
        return AttnTile(64, 128, 4, 2, True) if short else AttnTile(128, 128, 8, 2, True)
    return AttnTile(64 if short or head_dim > 64 else 128, 32, 8, 3, True)


def measured_tile(lq: int, head_dim: int) -> AttnTile:
    """The sm_90 tile of the H100 run (README "Measured on a GPU"), for benchmarks/gpu.py to time beside
    :func:`gpu_tile`'s."""
    return AttnTile(64 if lq <= SHORT_QUERIES or head_dim > 64 else 128, 32, 8, 3, False)


# The interpreter runs with small tiles so that short test sequences still cross several K/V tiles
# and exercise the online-softmax rescaling; the kernel code is identical (block sizes are constexprs).
INTERPRETER_TILE = AttnTile(16, 16, 4, 1, False)


def _attn_fwd(
    Q, K, V, Out, QScale, KScale, Scalars, Mask,
    H, Lq, Lk, GROUP, softmax_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_qsb, stride_qsh, stride_qsm,
    stride_ksb, stride_ksh, stride_ksn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, NATIVE_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, EXP_BIAS: tl.constexpr,
):
    """Grid (cdiv(Lq, BLOCK_M), B·H). Query head h reads kv head h // GROUP (GQA, as repeat_interleave).

    Scales come in as per-row vectors (per-tensor and per-head scales arrive with stride 0 along the dims
    they do not vary on), so one code path serves all: q's scale multiplies rows of S, k's columns.
    ``Scalars`` [2, H] = [1/p_scale; p_scale·v_scale] per query head is read from memory, so no host sync is
    needed. BLOCK_D pads HEAD_DIM 16 to 32, the smallest K of an FP8 MMA.
    tl.max / tl.sum / tl.zeros are @jit helpers that the interpreter (run without $TRITON_INTERPRET, see
    common.Kernel) refuses to call, so the kernel uses tl.reduce with Triton's own combine
    functions (the interpreter maps those to numpy) and tl.full; compiled, the code is the same.
    """
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    kvh = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    qs = tl.load(QScale + b * stride_qsb + h * stride_qsh + offs_m * stride_qsm, mask=m_ok, other=0.0)
    row_scale = qs * (softmax_scale * LOG2E)  # log2 units: exp(x) = exp2(x · log2 e)
    p_inv = tl.load(Scalars + h)
    out_scale = tl.load(Scalars + H + h)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    ks_base = KScale + b * stride_ksb + kvh * stride_ksh
    mask_base = Mask + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mm

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    hi = Lk
    if IS_CAUSAL:  # top-left aligned: key j is visible to query i iff j <= i; later tiles are all masked
        hi = tl.minimum(Lk, (start_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < Lk
        k = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        ks = tl.load(ks_base + offs_n * stride_ksn, mask=n_ok, other=0.0)
        s = tl.dot(q, k) * row_scale[:, None] * ks[None, :]
        keep = n_ok[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        if MASK_KIND == 1:  # bool mask (as uint8): keep where non-zero
            mk = tl.load(mask_base + offs_n[None, :] * stride_mn, mask=m_ok[:, None] & n_ok[None, :], other=0)
            keep = keep & (mk != 0)
        if MASK_KIND == 2:  # additive float mask; -2^127 · log2 e is still finite (see module docstring)
            add = tl.load(mask_base + offs_n[None, :] * stride_mn, mask=m_ok[:, None] & n_ok[None, :], other=0.0)
            add = tl.where(add == float("-inf"), add, tl.maximum(add, -1.7014118346046923e38))
            s = s + add * LOG2E
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        # while every key so far is masked m_new is -inf; subtract 0 instead so exp2 gives 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if NATIVE_CAST:  # sm_90: one cvt.rn.satfinite (RNE, saturating), round_to_fp8's bits for finite P
            p_q = (p * p_inv).to(V.dtype.element_ty)
        else:  # round in fp32 first: Triton's own cast drops carries (interpreter), double-rounds (sm_89)
            p_q = round_to_fp8(p * p_inv, FP8_MAX, MANTISSA_BITS, MIN_NORMAL).to(V.dtype.element_ty)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        # promoted to fp32 after each tile (see gemm_core.main_loop): else sm_90 sums all of Lk in the tensor core
        acc = tl.dot(p_q, v, acc * alpha[:, None], max_num_imprecise_acc=BLOCK_N)
        m_i = m_new

    # fully masked rows have l = 0 and acc = 0: divide by 1 to output exact zeros instead of NaN
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * tl.math.div_rn(tl.full([BLOCK_M], 0.0, tl.float32) + out_scale, l_safe)[:, None]
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out, mask=m_ok[:, None] & d_ok[None, :])



# launch ints the JIT is not to specialize (== 1 → constexpr): sizes and scale/mask strides that are 1 only sometimes
# (decode, one head, per-token scales, GQA), so one compiled variant serves them; head-dim strides are always 1
ATTN_FWD = Kernel(_attn_fwd, do_not_specialize=("H", "Lq", "Lk", "GROUP", "stride_qsb", "stride_qsh", "stride_qsm",
                                                "stride_ksb", "stride_ksh", "stride_ksn", "stride_mb", "stride_mh",
                                                "stride_mm"))
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_mn")
# ints the JIT marks divisible by 16 for contiguous (B, H, L, D) tensors with D a multiple of 16
ALIGNED = tuple(f"stride_{t}{d}" for t in "qkvo" for d in ("b", "h", "m" if t in "qo" else "n"))


def _block_d(head_dim: int) -> int:
    return max(head_dim, 32)


def launch_tile(lq: int, head_dim: int, masked: bool, device: torch.device) -> AttnTile:
    """The tile of a launch: small ones in the interpreter, :func:`gpu_tile` for the device's architecture."""
    if on_interpreter():
        return INTERPRETER_TILE
    major, minor = torch.cuda.get_device_capability(device)
    return gpu_tile(lq, head_dim, 10 * major + minor, masked)


def _scale_rows(scale: torch.Tensor, shape: tuple[int, int, int], name: str) -> torch.Tensor:
    """A q/k scale (0-d, per head [H] or per token shaped (B, H, L, 1)) as a (B, H, L) fp32 view; broadcast
    dims get stride 0, so per-tensor and per-head scales are not materialised."""
    s = head_view(scale.to(torch.float32))
    try:
        return torch.broadcast_to(s, (*shape, 1))[..., 0]
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(scale.shape)} must be 0-d, per head [{shape[1]}] or per token "
                         f"{(*shape, 1)}") from None


def _scalars(p_scale: torch.Tensor, v_scale: torch.Tensor, hq: int, hkv: int) -> torch.Tensor:
    """[2, Hq] fp32: 1/p_scale and p_scale·v_scale per query head (query head h reads kv head h // (Hq/Hkv))."""
    def per_head(s: torch.Tensor, heads: int, name: str) -> torch.Tensor:
        if not (s.numel() == 1 or (s.dim() == 1 and s.numel() == heads)):
            raise ValueError(f"{name} must be per tensor (one element) or per head ([{heads}]), got shape "
                             f"{tuple(s.shape)}")
        return s.to(torch.float32).reshape(-1).expand(heads)
    p = per_head(p_scale, hq, "p_scale")
    v = per_head(v_scale, hkv, "v_scale").repeat_interleave(hq // hkv)
    return torch.stack([torch.reciprocal(p), p * v]).contiguous()


def fp8_attention(
    q_q: torch.Tensor,
    q_scale: torch.Tensor,
    k_q: torch.Tensor,
    k_scale: torch.Tensor,
    v_q: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    softmax_scale: float | None = None,
    p_scale: torch.Tensor | None = None,
    fmt: FP8Format = FP8Format.E4M3,
    tile: AttnTile | None = None,
) -> torch.Tensor:
    """Fused FP8 attention with :func:`reference.fp8_attention`'s semantics; fp32 (B, Hq, Lq, D) output.

    q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D) in ``fmt``; Hq a multiple of Hkv (GQA); D in 16/32/64/128.
    q_scale / k_scale: one element, per head ([Hq] / [Hkv]) or per token ((B, H, L, 1), k's on kv heads);
    v_scale: one element or [Hkv]; p_scale: one element or [Hq].
    ``attn_mask``: bool (keep True) or float (added), broadcastable to (B, Hq, Lq, Lk); broadcast dims
    are read with stride 0, never expanded in memory. ``tile`` overrides :func:`launch_tile` (benchmarks, tests).
    """
    fmt = FP8Format.parse(fmt)
    for name, t in (("q_q", q_q), ("k_q", k_q), ("v_q", v_q)):
        if t.dim() != 4 or t.dtype != fmt.dtype:
            raise ValueError(f"{name} must be a 4-d (B, H, L, D) {fmt.dtype} tensor, got {t.dtype} {tuple(t.shape)}")
    check_device(q_q, k_q, v_q, attn_mask)
    # head dims contiguous: the kernel is compiled for unit strides there (vector loads, cp.async; see AOT_CONFIGS)
    q_q, k_q, v_q = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_q, k_q, v_q))
    B, Hq, Lq, D = q_q.shape
    Hkv, Lk = k_q.shape[1], k_q.shape[2]
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim {D} is not supported by the Triton kernel; use one of {HEAD_DIMS}")
    if k_q.shape != v_q.shape or k_q.shape[0] != B or k_q.shape[3] != D or Hq % Hkv:
        raise ValueError(f"k {tuple(k_q.shape)} / v {tuple(v_q.shape)} do not fit q {tuple(q_q.shape)} "
                         "(same B and D; q heads a multiple of kv heads)")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    if p_scale is None:
        p_scale = torch.tensor(1.0 / fmt.max, device=q_q.device)
    scalars = _scalars(p_scale, v_scale, Hq, Hkv)
    qs = _scale_rows(q_scale, (B, Hq, Lq), "q_scale")
    ks = _scale_rows(k_scale, (B, Hkv, Lk), "k_scale")

    out = torch.empty((B, Hq, Lq, D), dtype=torch.float32, device=q_q.device)
    if out.numel() == 0:
        return out
    mask_strides: tuple[int, ...]
    if attn_mask is None:  # not read; stride_mn 1 as a mask's, so both launch the same compiled variant
        kind, mask, mask_strides = 0, scalars, (0, 0, 0, 1)
    else:
        # convert before broadcasting: the fp32 / uint8 copy is the size of the mask as given
        m = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask.to(torch.float32)
        kind = 1 if attn_mask.dtype == torch.bool else 2
        if m.shape[-1] != 1 and m.stride(-1) != 1:
            m = m.contiguous()
        mask = torch.broadcast_to(m, (B, Hq, Lq, Lk))
        mask_strides = mask.stride()

    tile = tile or launch_tile(Lq, D, kind != 0, q_q.device)
    if tile.native_cast and on_interpreter():
        raise ValueError("native_cast needs a compiled sm_90 kernel: the interpreter's float→fp8 cast drops carries")
    grid = (cdiv(Lq, tile.block_m), B * Hq)
    extra = {} if on_interpreter() else {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    ATTN_FWD[grid](
        q_q, k_q, v_q, out, qs, ks, scalars, mask,
        Hq, Lq, Lk, Hq // Hkv, float(softmax_scale),
        *q_q.stride(), *k_q.stride(), *v_q.stride(), *out.stride(),
        *qs.stride(), *ks.stride(), *mask_strides,
        HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, IS_CAUSAL=bool(is_causal),
        MASK_KIND=kind, NATIVE_CAST=tile.native_cast, **fp8_constants(fmt), **extra,
    )
    return out


def _aot_configs() -> list[AotEntry]:
    """Every configuration :func:`fp8_attention` launches on a GPU, specialized as the JIT specializes an aligned
    launch (unit head-dim strides as constexpr 1, :func:`aot_attrs`), for ahead-of-time PTX checks."""
    names = ["Q", "K", "V", "Out", "QScale", "KScale", "Scalars", "Mask", "H", "Lq", "Lk", "GROUP", "softmax_scale"]
    ints = [f"stride_{t}{d}" for t in "qkvo" for d in ("b", "h", "m" if t in "qo" else "n", "d")]
    ints += ["stride_qsb", "stride_qsh", "stride_qsm", "stride_ksb", "stride_ksh", "stride_ksn"]
    ints += ["stride_mb", "stride_mh", "stride_mm", "stride_mn"]
    configs: list[AotEntry] = []
    for fmt in FP8Format:
        fp8 = "fp8e4nv" if fmt is FP8Format.E4M3 else "fp8e5"
        for head_dim in HEAD_DIMS:
            for causal in (False, True):
                for mask_name, kind in MASK_KINDS.items():
                    tiles = {(arch, gpu_tile(lq, head_dim, arch, kind != 0)) for arch in ARCHS for lq in (1, 10**6)}
                    for arch, tile in sorted(tiles, key=lambda t: (t[0], dataclasses.astuple(t[1]))):
                        types = [f"*{fp8}"] * 3 + ["*fp32"] * 4 + ["*u8" if kind == 1 else "*fp32"]
                        sig = dict(zip(names, types + ["i32"] * 4 + ["fp32"]))
                        sig.update(dict.fromkeys(ints, "i32"))
                        consts: dict[str, object] = {
                            "HEAD_DIM": head_dim, "BLOCK_D": _block_d(head_dim), "BLOCK_M": tile.block_m,
                            "BLOCK_N": tile.block_n, "IS_CAUSAL": causal, "MASK_KIND": kind,
                            "NATIVE_CAST": tile.native_cast, **fp8_constants(fmt), **dict.fromkeys(UNIT_STRIDES, 1)}
                        sig.update(dict.fromkeys(consts, "constexpr"))
                        desc = (f"{fmt.value} D={head_dim} causal={causal} mask={mask_name} BLOCK_M={tile.block_m} "
                                f"BLOCK_N={tile.block_n} warps={tile.num_warps} stages={tile.num_stages} "
                                f"native={int(tile.native_cast)} sm_{arch}")
                        configs.append(("_attn_fwd", desc, ATTN_FWD, sig, consts))
    return configs


def aot_attrs(entry: AotEntry) -> dict:
    """ASTSource ``attrs``: pointers and the :data:`ALIGNED` strides divisible by 16, as the JIT finds them."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(entry[3].items())
            if ty.startswith("*") or (ty == "i32" and name in ALIGNED)}


AOT_CONFIGS: list[AotEntry] = _aot_configs()
