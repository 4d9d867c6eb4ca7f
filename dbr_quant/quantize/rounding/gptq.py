"""GPTQ rounding onto the FP8 grid: round one input column at a time and push its error, weighted by
the inverse Hessian, onto the columns not yet rounded (Frantar et al., "GPTQ", 2022, Algorithm 1), with
lazy block updates. The feedback weights come from one Cholesky factorisation of H itself (the LDLQ form,
see ``feedback_factor``) rather than from the Cholesky factor of H⁻¹: the same rounding (the tests compare
against textbook inverse-Hessian GPTQ bit for bit) at about half the cost, since no inverse is formed.

Everything here works on plain tensors: ``w`` is a linear's ``[out_features, in_features]`` weight and
``hessian`` the ``[in_features, in_features]`` matrix from ``HessianAccumulator.hessian``. Each rounded
column is ``reference.quantize`` of the (error-updated) column — the same saturating cast as nearest
rounding, so the result is an FP8 tensor on the grid of ``scale``; only which grid point each weight
lands on changes.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference import dense as reference
from dbr_quant.observers import ObserverConfig, RunningMax

WeightGranularity = Literal["channel", "tensor"]


class HessianNotPositiveDefiniteError(ValueError):
    """The damped Hessian (or its inverse) has no Cholesky factor: raise the damping."""


def weight_scale(w: Tensor, fmt: FP8Format | str, granularity: WeightGranularity = "channel",
                 observer: ObserverConfig | None = None) -> Tensor:
    """Dequantization scale of a weight the way convert computes it: the weight observer (default
    running max = amax; ``observers.MSE()`` searches the clip per channel) over the whole weight.
    Per channel: shape ``[out_features]``; per tensor: 0-d."""
    fmt = FP8Format.parse(fmt)
    _check_granularity(granularity)
    obs = (observer or RunningMax()).create(fmt, 0 if granularity == "channel" else None)
    obs(w.detach())
    return obs.scale()


def round_to_nearest(w: Tensor, fmt: FP8Format | str, granularity: WeightGranularity = "channel",
                     scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Today's rounding: (``reference.quantize(w, scale)``, scale)."""
    fmt = FP8Format.parse(fmt)
    w32 = _check_weight(w)
    scale = _resolve_scale(w32, fmt, granularity, scale)
    return reference.quantize(w32, _broadcastable(scale, granularity), fmt), scale


def gptq_round(w: Tensor, hessian: Tensor, fmt: FP8Format | str, granularity: WeightGranularity = "channel",
               scale: Tensor | None = None, damping: float = 1.0, block_size: int = 128,
               act_order: bool = False) -> tuple[Tensor, Tensor]:
    """Round ``w`` onto the FP8 grid of ``scale`` with GPTQ error feedback; returns (fp8 weight, scale).

    damping: added to the Hessian's diagonal as a multiple of the mean diagonal of its live (non-zero)
        input channels; ``math.inf`` means no error feedback, i.e. round to nearest. Larger is more
        conservative: the calibration tokens are trusted less (see ``choose_damping``).
    block_size: columns rounded between two lazy updates of the remaining weight (speed only; any value
        >= 1, need not divide in_features).
    act_order: round input channels in order of decreasing Hessian diagonal (largest inputs first).
    Input channels with a zero Hessian diagonal (never non-zero in calibration) are rounded to nearest
    and neither give nor take error feedback.
    """
    fmt = FP8Format.parse(fmt)
    w32 = _check_weight(w)
    scale = _resolve_scale(w32, fmt, granularity, scale)
    h = _check_hessian(hessian, w32.shape[1]).to(w32.device)
    if not (isinstance(damping, (int, float)) and not isinstance(damping, bool) and damping >= 0
            and not math.isnan(damping)):
        raise ValueError(f"gptq_round: damping must be a number >= 0 (math.inf = round to nearest), got {damping!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"gptq_round: block_size must be an int >= 1, got {block_size!r}")
    return _gptq_round_checked(w32, h, fmt, granularity, scale, damping, block_size, act_order)


def _gptq_round_checked(w32: Tensor, h: Tensor, fmt: FP8Format, granularity: str, scale: Tensor, damping: float,
                        block_size: int, act_order: bool) -> tuple[Tensor, Tensor]:
    """gptq_round on validated arguments (fp32 weight, fp64 Hessian, resolved scale)."""
    col_scale = _broadcastable(scale, granularity).reshape(-1)  # [out_features] or [1]: one column's scale
    if math.isinf(damping):
        return reference.quantize(w32, _broadcastable(scale, granularity), fmt), scale
    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else None
    if perm is not None:
        w32, h = w32[:, perm], h[perm][:, perm]
    factor = feedback_factor(h, damping).to(w32.dtype)
    q = _gptq_columns(w32, factor, col_scale, fmt, block_size)
    if perm is not None:
        q = q[:, torch.argsort(perm)]
    return q, scale


def feedback_factor(hessian: Tensor, damping: float) -> Tensor:
    """Unit upper-triangular F with H + damping·mean(live diag)·I = F D Fᵀ (D diagonal), fp64.

    Then tr(E H Eᵀ) = Σ_k D_k ‖E F[:, k]‖², and the k-th term is zero when column k is rounded from
    w_k + Σ_{j<k} e_j F[j, k] (e_j = w_j − ŵ_j the error already made): F[j, k] is how much of column j's
    error column k takes up. This is GPTQ's update written with H instead of H⁻¹ (LDLQ, Chee et al. 2023,
    show the two are the same algorithm): one Cholesky factorisation, no inverse. With J the
    order-reversing permutation and J H J = M Mᵀ (M lower), H = R Rᵀ with R = J M J upper, and F is R
    with each column divided by its diagonal entry.

    Dead channels (zero diagonal) are decoupled first: their row and column are zeroed and their diagonal
    set to the live mean, so F is the identity there.
    """
    h = hessian.double().clone()
    diag = h.diagonal()
    dead = ~(diag > 0)
    live_mean = float(diag[~dead].mean()) if bool((~dead).any()) else 1.0
    if bool(dead.any()):
        h[dead, :] = 0.0
        h[:, dead] = 0.0
        idx = dead.nonzero().squeeze(1)
        h[idx, idx] = live_mean
    h.diagonal().add_(damping * live_mean)
    chol, info = torch.linalg.cholesky_ex(h.flip(0, 1))
    if int(info) != 0:
        raise HessianNotPositiveDefiniteError(
            f"gptq_round: the Hessian with damping {damping:g} is not positive definite (Cholesky failed "
            f"{int(info)} columns from the end): use a larger damping, or more calibration data")
    upper = chol.flip(0, 1)
    return upper / upper.diagonal()[None, :]


def _gptq_columns(w: Tensor, factor: Tensor, col_scale: Tensor, fmt: FP8Format, block_size: int) -> Tensor:
    """The GPTQ loop with lazy batch updates; ``w`` is not modified. Returns the FP8 weight.

    Works on Wᵀ (contiguous), so each input column of W is a contiguous row and the rank-1 updates
    stream through memory. ``target`` holds w_k + Σ_{j<k} e_j F[j, k] for the columns not yet rounded:
    inside a block the errors are pushed column by column, to the rest of the weight once per block
    (one GEMM).
    """
    wt = w.t().contiguous()  # [in_features, out_features]
    target = wt.clone()
    cols, rows = wt.shape
    qt = torch.empty((cols, rows), dtype=fmt.dtype, device=w.device)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        block = target[i1:i2]  # a view: the in-block updates write straight into target
        f = factor[i1:i2, i1:i2]
        errors = torch.empty((i2 - i1, rows), dtype=w.dtype, device=w.device)
        for i in range(i2 - i1):
            rounded = reference.quantize(block[i], col_scale, fmt)
            qt[i1 + i] = rounded
            err = torch.sub(wt[i1 + i], rounded.float() * col_scale, out=errors[i])
            block[i + 1:].add_(f[i, i + 1:, None] * err[None, :])
        if i2 < cols:
            target[i2:].add_(factor[i1:i2, i2:].t() @ errors)
    return qt.t().contiguous()


def output_error(w: Tensor, q: Tensor, scale: Tensor, hessian: Tensor, granularity: WeightGranularity = "channel"
                 ) -> float:
    """tr((W - deq(Q)) H (W - deq(Q))ᵀ) in fp64: the layer's squared output error per token (× 2)."""
    _check_granularity(granularity)
    deq = q.double() * _broadcastable(scale, granularity).double()
    err = w.double() - deq
    return float(((err @ hessian.double()) * err).sum())


# ------------------------------------------------------------------------------------------ checks
def _check_granularity(granularity: str) -> None:
    if granularity not in ("channel", "tensor"):
        raise ValueError(f"weight granularity must be 'channel' or 'tensor', got {granularity!r}")


def _check_weight(w: Tensor) -> Tensor:
    if not isinstance(w, Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"gptq: expected a 2-d floating-point weight [out_features, in_features], got "
                         f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}")
    w32 = w.detach().float()
    if not bool(torch.isfinite(w32).all()):
        raise ValueError("gptq: the weight has NaN/inf values: fix the weights or skip this module")
    return w32


def _check_hessian(hessian: Tensor, in_features: int) -> Tensor:
    if not isinstance(hessian, Tensor) or tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(f"gptq_round: the Hessian must be [{in_features}, {in_features}] (in_features of the "
                         f"weight), got {tuple(hessian.shape) if isinstance(hessian, Tensor) else hessian!r}")
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("gptq_round: the Hessian has NaN/inf values (calibration inputs overflowed?)")
    return hessian.double()


def _resolve_scale(w32: Tensor, fmt: FP8Format, granularity: WeightGranularity, scale: Tensor | None) -> Tensor:
    _check_granularity(granularity)
    if scale is None:
        return weight_scale(w32, fmt, granularity)
    scale = scale.detach().float().to(w32.device)
    want = (w32.shape[0],) if granularity == "channel" else ()
    if scale.numel() != math.prod(want):
        raise ValueError(f"gptq: a per-{granularity} scale must have {math.prod(want)} element(s), "
                         f"got shape {tuple(scale.shape)}")
    if not bool(torch.isfinite(scale).all() & (scale > 0).all()):
        raise ValueError("gptq: weight scales must be finite and > 0 (see formats.safe_scale)")
    return scale.reshape(want)


def _broadcastable(scale: Tensor, granularity: str) -> Tensor:
    """The scale shaped to broadcast against the [out_features, in_features] weight."""
    return scale.reshape(-1, 1) if granularity == "channel" else scale.reshape(1, 1)


def _gptq_columns_batched(w: Tensor, factors: Tensor, col_scale: Tensor, fmt: FP8Format, block_size: int) -> Tensor:
    """``_gptq_columns`` for several feedback factors (one per damping) of the same weight at once: [C, out, in].

    Candidate c's result is bit-identical to ``_gptq_columns(w, factors[c], ...)``: the per-column steps are the
    same elementwise operations with a leading candidate dimension, and the block update is the same GEMM per
    candidate. What it saves is Python overhead: one column loop instead of C (choose_damping's cost).
    """
    wt = w.t().contiguous()
    count = factors.shape[0]
    cols, rows = wt.shape
    target = wt.expand(count, cols, rows).clone()
    qt = torch.empty((count, cols, rows), dtype=fmt.dtype, device=w.device)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        block = target[:, i1:i2]
        f = factors[:, i1:i2, i1:i2]
        errors = torch.empty((count, i2 - i1, rows), dtype=w.dtype, device=w.device)
        for i in range(i2 - i1):
            rounded = reference.quantize(block[:, i], col_scale, fmt)
            qt[:, i1 + i] = rounded
            err = torch.sub(wt[i1 + i], rounded.float() * col_scale, out=errors[:, i])
            block[:, i + 1:].add_(f[:, i, i + 1:, None] * err[:, None, :])
        if i2 < cols:
            for c in range(count):
                target[c, i2:].add_(factors[c, i1:i2, i2:].t() @ errors[c])
    return qt.transpose(1, 2).contiguous()
