"""Statistics of one tensor (high precision) and of its FP8 quantization, as python floats.

Definitions (all over every element of the tensor):
* ``underflow_pct``: % of elements that are non-zero in high precision and zero after quantization;
* ``saturated_pct``: % of elements whose magnitude exceeds the format's range (``|x / scale| > fmt.max``,
  with a relative slack of 1e-6 for the rounding of the scale), i.e. that the saturating cast clips;
* ``mse``: mean of ``(dequantize(q) - x)²``;
* ``sqnr_db``: ``10·log10(Σx² / Σ(dequantize(q) - x)²)`` (``inf`` when the error is zero).
"""

from __future__ import annotations

import math

import torch

from dbr_quant.formats import FP8Format

TENSOR_STATS = ("amax", "min", "max", "mean", "std")
FP8_STATS = ("underflow_pct", "saturated_pct", "mse", "sqnr_db", "scale")


def tensor_stats(x: torch.Tensor, names: tuple[str, ...] = TENSOR_STATS) -> dict[str, float]:
    xf = x.detach().float()
    funcs = {
        "amax": lambda: xf.abs().amax(),
        "min": lambda: xf.amin(),
        "max": lambda: xf.amax(),
        "mean": lambda: xf.mean(),
        "std": lambda: xf.std() if xf.numel() > 1 else torch.zeros(()),
    }
    values = torch.stack([funcs[n]() for n in names]).tolist()
    return dict(zip(names, values))


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``approx`` against ``reference`` in dB (fp64 sums)."""
    ref = reference.detach().double()
    err = (approx.detach().double() - ref).pow(2).sum().item()
    sig = ref.pow(2).sum().item()
    if err == 0.0:
        return math.inf
    if sig == 0.0:
        return -math.inf
    return 10.0 * math.log10(sig / err)


def fp8_stats(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, names: tuple[str, ...] = FP8_STATS
) -> dict[str, float]:
    """Stats of the quantization ``x ≈ q·scale`` (``scale`` broadcasts against ``x``)."""
    xf = x.detach().float()
    s = scale.detach().float()
    deq = q.float() * s
    n = max(xf.numel(), 1)
    out: dict[str, float] = {}
    for name in names:
        if name == "underflow_pct":
            out[name] = 100.0 * ((xf != 0) & (q.float() == 0)).sum().item() / n
        elif name == "saturated_pct":
            # 1e-6 of slack: x = amax lands on fmt.max only up to the rounding of its scale
            out[name] = 100.0 * ((xf * torch.reciprocal(s)).abs() > fmt.max * (1 + 1e-6)).sum().item() / n
        elif name == "mse":
            out[name] = (deq - xf).double().pow(2).mean().item()
        elif name == "sqnr_db":
            out[name] = sqnr_db(xf, deq)
        elif name == "scale":
            if s.numel() == 1:
                out["scale"] = s.item()
            else:
                out["scale_min"], out["scale_max"] = s.amin().item(), s.amax().item()
    return out
