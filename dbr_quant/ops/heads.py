"""Per-head attention scales (``QConfig(quantize_attention=True, attention_scales="head")``).

An attention operand with heads is (…, H, L, D): SDPA's q, k, v (H query heads for q, H_kv key/value heads for k
and v under GQA) and the 4-D operands of eager attention's matmuls (q·kᵀ and p·v on (B, H, L, ·)). Its
observer is per channel along the head axis (-3), so its scale is one value per head, [H]; the kernels take
that 1-D scale as it is (``kernels.fp8_attention``) or through its (H, 1, 1) view, which broadcasts over the
operand (``quantize``, ``fp8_matmul``). Anything else keeps one scale per tensor.

The same projection can reach attention with H_kv heads or repeated to H (transformers' SDPA path repeats k/v
with ``repeat_kv`` when a mask is given and passes ``enable_gqa`` otherwise; eager attention always repeats), so
a scale calibrated on one head count meets operands with the other: a repeated head is a copy of its kv head
(query head h reads kv head h // (H / H_kv), as ``repeat_kv`` and ``repeat_interleave`` lay them out), so the
H scales repeat the H_kv ones, and H_kv scales are the largest of each group of H / H_kv (all equal when the
H were measured on repeated copies).
"""

from __future__ import annotations

import torch

from dbr_quant.kernels.reference.dense import head_view as head_view  # a per-head [H] scale as (H, 1, 1)
from dbr_quant.ops.mappings import MATMUL, SDPA

HEAD_AXIS = -3


def head_axis(kind: str, x: torch.Tensor) -> int | None:
    """The head axis of an attention operand (SDPA's q/k/v with ≥ 3 dims, a 4-D matmul operand), else None."""
    if (kind == SDPA and x.dim() >= 3) or (kind == MATMUL and x.dim() == 4):
        return HEAD_AXIS
    return None


def fit_heads(scale: torch.Tensor, heads: int, what: str) -> torch.Tensor:
    """A per-head scale [S] for an operand with ``heads`` heads: as it is (S = heads), repeated per group
    (heads = g·S: the operand's kv heads were repeated), or the largest of each group (S = g·heads)."""
    s = scale.numel()
    if s == heads:
        return scale
    if heads % s == 0:
        return scale.repeat_interleave(heads // s)
    if s % heads == 0:
        return scale.reshape(heads, s // heads).amax(dim=1)
    raise ValueError(f"dbr_quant: {what}: {s} per-head scales were calibrated, but the operand has {heads} heads "
                     "(neither a multiple of the other: not the same attention's query or kv heads); prepare with "
                     "example inputs that take this attention's path")


def operand_scale(scale: torch.Tensor, x: torch.Tensor, what: str) -> torch.Tensor:
    """A static scale for the operand ``x``: a per-head one (1-D) fitted to x's heads, others as they are."""
    return fit_heads(scale, x.shape[HEAD_AXIS], what) if scale.dim() == 1 and x.dim() >= 3 else scale


def observable(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x`` (…, H', L, D) as an observer sized for ``heads`` heads sees it: as it is, its kv-head groups folded
    into the sequence axis (H' = g·heads: each group holds copies of one kv head), or each head repeated
    (heads = g·H')."""
    have = x.shape[HEAD_AXIS]
    if have == heads:
        return x
    if have % heads == 0:
        return x.reshape(*x.shape[:-3], heads, -1, x.shape[-1])
    if heads % have == 0:
        return x.repeat_interleave(heads // have, dim=HEAD_AXIS)
    raise ValueError(f"dbr_quant: a per-head observer sized for {heads} heads cannot observe an operand with "
                     f"{have} heads (shape {tuple(x.shape)}); prepare with example inputs that take this path")
