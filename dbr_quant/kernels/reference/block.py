"""Block-scaled FP8 in plain torch (the DeepSeek-V3 / Qwen3-FP8 layout): the ground truth for the CPU backend's and
the Triton block kernels (exact in the sense of :mod:`dbr_quant.kernels.reference.dense`).

Layouts, identical to compressed-tensors ``FP8_BLOCK`` (``weight_scale``) and transformers FineGrainedFP8
(``weight_scale_inv``, a dequantization scale despite its name), so checkpoints load without conversion:

* weight ``W[N, K]`` → ``fp8[N, K]`` and ``scale[⌈N/bn⌉, ⌈K/bk⌉]`` with ``W ≈ fp8[n, k] · scale[n // bn, k // bk]``
  (block ``(bn, bk)``, default 128×128);
* activations ``x[..., K]`` → ``fp8[..., K]`` and ``scale[..., ⌈K/g⌉]``: dynamic, one scale per token per
  group of ``g`` channels (default 128).

Scales are ``formats.safe_scale(amax)`` = amax / fmt.max like the per-tensor/channel observers (all-zero
block → 1; non-finite values ignored, as in ``dense.amax``). Edge blocks of a dimension that is not a
multiple of the block use only their real elements. Quantization is ``dense.quantize`` (× the
reciprocal scale, round to nearest even, saturating) with the block's scale broadcast to every element.

GEMM semantics (the DeepGEMM / vLLM ``w8a8_block_fp8_matmul`` structure): for every K block ``kb`` the
partial product ``P_kb = x_q[:, kb] · w_q[:, kb]ᵀ`` of exact FP8 values accumulates in fp32, is multiplied by
``x_scale[m, kb] · w_scale[n // bn, kb]`` and added to an fp32 accumulator, in kb order. The activation group
must equal the weight block's K size, so one activation scale covers each K block. Then the epilogue of
``dense.fp8_linear`` (bias, activation, residual, output dtype or FP8 with a static scale). The CPU backend runs
the same loop on operands upcast for its GEMM path (:data:`Operands`): bit for bit on its fp32 path, each partial
rounded once to bf16 on its bf16 path.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dbr_quant.formats import FP8Format, safe_scale
from dbr_quant.kernels.reference.dense import GATED, Quantize, linear_epilogue, quantize

DEFAULT_BLOCK = (128, 128)
DEFAULT_GROUP = 128

# (x_q rows, w_q rows of one GEMM, the whole weight) → the two GEMM operands: here the exact FP8 values in fp32;
# the CPU backend upcasts to its GEMM path's dtype, decided on the whole weight (both halves of a gated one alike)
Operands = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def exact_operands(x_q: torch.Tensor, w_q: torch.Tensor, whole_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 values as fp32 GEMM operands (torch's casts)."""
    return x_q.float(), w_q.float()


def check_block(block: tuple[int, int], what: str = "block") -> tuple[int, int]:
    """``block`` as a pair of positive ints, else a ValueError naming it."""
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{what} must be two positive ints (rows, columns), e.g. (128, 128); got {block!r}")
    return int(block[0]), int(block[1])


def check_group(group: int) -> int:
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        raise ValueError(f"group size must be a positive int (e.g. 128), got {group!r}")
    return group


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.detach().float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad ``dim`` up to a multiple of ``size`` (zeros never raise an amax)."""
    extra = -t.shape[dim] % size
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return F.pad(t, pad)


def block_amax(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """Largest finite |w| of every (bn × bk) block of a 2-d ``w``: shape [⌈N/bn⌉, ⌈K/bk⌉], fp32."""
    bn, bk = check_block(block)
    if w.dim() != 2:
        raise ValueError(f"block scales are for 2-d weights [out, in], got shape {tuple(w.shape)}")
    a = _pad_to(_pad_to(_finite_abs(w), 0, bn), 1, bk)
    return a.reshape(a.shape[0] // bn, bn, a.shape[1] // bk, bk).amax(dim=(1, 3))


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """One scale per element of an [N, K] weight from its [⌈N/bn⌉, ⌈K/bk⌉] block scales."""
    bn, bk = check_block(block)
    n, k = shape
    want = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"block scale for a {n}×{k} weight with block {bn}×{bk} must have shape {want}, "
                         f"got {tuple(scale.shape)}")
    return scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def block_quantize_weight(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                          fmt: FP8Format = FP8Format.E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], scale [⌈N/bn⌉, ⌈K/bk⌉]) with scale = amax/fmt.max per block (see the module doc)."""
    fmt = FP8Format.parse(fmt)
    scale = safe_scale(block_amax(w, block), fmt)
    return quantize(w, expand_block_scale(scale, tuple(w.shape), block), fmt), scale


def block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8 · scale[n // bn, k // bk]``: what a compressed-tensors / FineGrainedFP8 loader computes."""
    return (q.float() * expand_block_scale(scale, tuple(q.shape), block)).to(dtype)


def group_amax(x: torch.Tensor, group: int = DEFAULT_GROUP) -> torch.Tensor:
    """Largest finite |x| per token per group of ``group`` channels: shape [..., ⌈K/group⌉], fp32."""
    group = check_group(group)
    if x.dim() == 0:
        raise ValueError("group scales need at least one dimension (the channels)")
    a = _pad_to(_finite_abs(x), -1, group)
    return a.reshape(*a.shape[:-1], a.shape[-1] // group, group).amax(dim=-1)


def expand_group_scale(scale: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """One scale per element of [..., K] from the [..., ⌈K/group⌉] group scales."""
    if scale.shape[-1] != math.ceil(k / group):
        raise ValueError(f"group scale for {k} channels in groups of {group} must have {math.ceil(k / group)} "
                         f"columns, got shape {tuple(scale.shape)}")
    return scale.float().repeat_interleave(group, -1)[..., :k]


def group_quantize(x: torch.Tensor, group: int = DEFAULT_GROUP,
                   fmt: FP8Format = FP8Format.E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group quantization: (fp8 like x, scale [..., ⌈K/group⌉]). Every element has its own
    scale here, which the CPU backend's one-pass C quantize does not index: it runs this function too."""
    fmt = FP8Format.parse(fmt)
    scale = safe_scale(group_amax(x, group), fmt)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=fmt.dtype, device=x.device), scale
    return quantize(x, expand_group_scale(scale, x.shape[-1], group), fmt), scale


def group_dequantize(q: torch.Tensor, scale: torch.Tensor, group: int = DEFAULT_GROUP,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * expand_group_scale(scale, q.shape[-1], group)).to(dtype)


def layer_norm_group_quantize(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                              group: int = DEFAULT_GROUP, fmt: FP8Format = FP8Format.E4M3, *,
                              rms: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm / RMSNorm in fp32 (as ``dense.layer_norm_quantize``), then per-token-group dynamic
    quantization of the fp32 result: (normalized in x's dtype, fp8, scale [..., ⌈K/group⌉])."""
    xf = x.float()
    w = None if weight is None else weight.float()
    if rms:
        y = F.rms_norm(xf, xf.shape[-1:], w, eps)
    else:
        y = F.layer_norm(xf, xf.shape[-1:], w, None if bias is None else bias.float(), eps)
    q, scale = group_quantize(y, group, fmt)
    return y.to(x.dtype), q, scale


def check_block_linear_operands(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                                block: tuple[int, int], gated: bool) -> tuple[int, int, int]:
    """Shapes of a block-scaled linear, or a ValueError naming the tensor and the shape expected.
    Returns (K, N out columns, rows of scale per weight half)."""
    bn, bk = check_block(block)
    k = x_q.shape[-1]
    if w_q.dim() != 2 or w_q.shape[1] != k:
        raise ValueError(f"fp8_block_linear: w_q must be N×K with K = {k}, got {tuple(w_q.shape)}")
    kb = math.ceil(k / bk)
    if tuple(x_scale.shape) != (*x_q.shape[:-1], kb):
        raise ValueError(f"fp8_block_linear: x_scale must have shape {(*x_q.shape[:-1], kb)} (one scale per token "
                         f"per group of {bk} channels), got {tuple(x_scale.shape)}")
    n_w = w_q.shape[0]
    if gated and n_w % 2:
        raise ValueError(f"fp8_block_linear: a gated activation needs w_q stacked as [gate; up], got {n_w} rows")
    n = n_w // 2 if gated else n_w
    rows = math.ceil(n / bn) if gated else math.ceil(n_w / bn)
    want = (2 * rows if gated else rows, kb)
    if tuple(w_scale.shape) != want:
        layout = " (gate and up each blocked on their own, scales stacked)" if gated else ""
        raise ValueError(f"fp8_block_linear: w_scale for a {n_w}×{k} weight with block {bn}×{bk} must have shape "
                         f"{want}{layout}, got {tuple(w_scale.shape)}")
    return k, n, rows


def block_gemm(x_c: torch.Tensor, x_scale: torch.Tensor, w_c: torch.Tensor, w_scale: torch.Tensor,
               block: tuple[int, int]) -> torch.Tensor:
    """fp32 ``Σ_kb (x_c[:, kb] · w_c[:, kb]ᵀ) · x_scale[:, kb] · w_scale[n // bn, kb]`` for the GEMM operands x_c
    [M, K] and w_c [N, K] (the FP8 values, in fp32 or bf16: see :data:`Operands`; fp32 accumulation inside either
    GEMM, a bf16 partial rounded once to bf16), x_scale [M, KB], w_scale [⌈N/bn⌉, KB]."""
    bn, bk = block
    k, n = x_c.shape[-1], w_c.shape[0]
    w_cols = w_scale.float().repeat_interleave(bn, 0)[:n]  # [N, KB]: the scale of each output column
    xs = x_scale.float()
    acc = torch.zeros(x_c.shape[0], n, dtype=torch.float32, device=x_c.device)
    for kb, start in enumerate(range(0, k, bk)):
        part = F.linear(x_c[:, start:start + bk], w_c[:, start:start + bk]).float()
        acc += part * xs[:, kb, None] * w_cols[None, :, kb]  # (P·sx)·sw, the Triton kernel's order
    return acc


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
    out_fmt: FP8Format = FP8Format.E4M3,
    operands: Operands = exact_operands,
    quantize: Quantize = quantize,
) -> torch.Tensor:
    """Block-scaled FP8 GEMM with the epilogue of dense.fp8_linear: ``act(Σ_kb P_kb·sx·sw + bias) + residual``.

    ``x_scale`` [..., ⌈K/bk⌉] (from :func:`group_quantize` with group = bk), ``w_scale`` [⌈N/bn⌉, ⌈K/bk⌉].
    Gated activations take W stacked as [gate; up] (2N × K) with each half block-quantized on its own (as
    gate_proj and up_proj are stored in checkpoints): w_scale = [gate scales; up scales], 2·⌈N/bn⌉ rows.
    With ``out_scale`` (a static per-tensor scale) the result is FP8 in ``out_fmt``. ``operands`` and
    ``quantize`` are swappable (the CPU backend passes its upcasts and its C quantize).
    """
    bn, bk = check_block(block)
    gated = activation in GATED
    k, n, rows = check_block_linear_operands(x_q, x_scale, w_q, w_scale, (bn, bk), gated)
    lead = x_q.shape[:-1]
    x2, xs2 = x_q.reshape(-1, k), x_scale.reshape(-1, x_scale.shape[-1])
    halves = ((w_q[:n], w_scale[:rows]), (w_q[n:], w_scale[rows:])) if gated else ((w_q, w_scale),)
    parts = []
    for w, s in halves:  # one half's operands at a time: a scratch buffer the CPU upcast reuses is read only here
        x_c, w_c = operands(x2, w, w_q)
        parts.append(block_gemm(x_c, xs2, w_c, s, (bn, bk)))
    acc = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    if bias is not None:
        acc += bias.float()
    y = acc.reshape(*lead, acc.shape[-1])
    return linear_epilogue(y, activation, residual, out_dtype, out_scale, FP8Format.parse(out_fmt), quantize)
