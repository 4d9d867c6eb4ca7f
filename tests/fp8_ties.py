"""Inputs built to sit where two ways of computing ``x / s`` round to different FP8 codes: ``x · (1/s)`` (the
reciprocal rounded to fp32 once, then one rounded multiply: dbr_quant, and vLLM's static per-tensor quantize)
and the correctly rounded ``x / s`` (compressed-tensors, hence transformers' loader). They differ only where
``x / s`` lies within an fp32 rounding of a midpoint between two neighbouring E4M3 values: random data almost
never lands there, so tests of that difference build their inputs."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


def codes_by_division(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' arithmetic: ``x / s``, saturated, torch's cast."""
    return (x.float() / scale.float()).clamp(-448.0, 448.0).to(E4M3)


def codes_by_reciprocal(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x · reciprocal(s)`` computed by torch, saturated, torch's cast: what dbr_quant states it computes."""
    return (x.float() * torch.reciprocal(scale.float())).clamp(-448.0, 448.0).to(E4M3)


def tie_inputs(scale: float, reach: int = 4) -> torch.Tensor:
    """fp32 values x (both signs) for which ``codes_by_division`` and ``codes_by_reciprocal`` differ at ``scale``:
    for every midpoint m between neighbouring positive finite E4M3 values, the fp32 numbers within ``reach``
    ulps of m·s that land on different sides of m (or on m, rounding to different codes) one way or the other."""
    s = torch.tensor([scale], dtype=torch.float32)
    grid = torch.arange(1, 127, dtype=torch.uint8).view(E4M3).float()  # positive finite values, ascending
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    centre = mids * s
    candidates = [centre]
    up, down = centre.clone(), centre.clone()
    for _ in range(reach):
        up, down = up.nextafter(torch.tensor(float("inf"))), down.nextafter(torch.tensor(0.0))
        candidates += [up, down]
    x = torch.cat(candidates)
    x = torch.cat([x, -x])
    hit = codes_by_division(x, s).view(torch.uint8) != codes_by_reciprocal(x, s).view(torch.uint8)
    return x[hit]
