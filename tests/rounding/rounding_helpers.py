"""Shared helpers for the rounding tests: correlated calibration data and an independent GPTQ reference."""

from __future__ import annotations

import math

import torch

from dbr_quant.formats import FP8Format


def correlated_inputs(tokens: int, k: int, generator: torch.Generator, mixing: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Tokens whose features are strongly correlated (a random mixing of white noise), like hidden states."""
    if mixing is None:
        mixing = mixing_matrix(k, generator)
    return torch.randn(tokens, k, generator=generator) @ mixing


def mixing_matrix(k: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(k, k, generator=generator) / math.sqrt(k) + 0.2 * torch.eye(k)


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    """2/n Σ xᵀx in fp64 straight from the definition."""
    x = x.double().reshape(-1, x.shape[-1])
    return 2.0 * x.T @ x / x.shape[0]


def power_of_two_scale(w: torch.Tensor, fmt: FP8Format, granularity: str) -> torch.Tensor:
    """amax-based scales rounded up to powers of two: then w · (1/scale) == w / scale exactly, so the
    implementation's cast (multiply by the reciprocal) and ``(w / scale).to(fp8)`` must agree bit for bit."""
    amax = w.abs().amax(dim=1) if granularity == "channel" else w.abs().amax()
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / fmt.max)))


def to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """The definition of FP8 quantization: saturate x / scale to ±max, then torch's cast (fp32 → fp8)."""
    return (x.float() / scale.float()).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def naive_gptq(w: torch.Tensor, h: torch.Tensor, fmt: FP8Format, scale: torch.Tensor, damping: float,
               order: list[int]) -> torch.Tensor:
    """Textbook GPTQ/OBQ in fp64 with the explicit inverse Hessian: round column i, spread its error with
    row i of H⁻¹, then eliminate i from H⁻¹ (Gaussian elimination). No Cholesky, no blocks, no lazy updates.
    ``scale`` is [N, 1] or [1, 1]. Dead channels (zero diagonal) are decoupled as the implementation
    documents: their row/column zeroed, diagonal set to the mean live diagonal."""
    w = w.double().clone()
    h = h.double().clone()
    dead = ~(h.diagonal() > 0)
    live_mean = float(h.diagonal()[~dead].mean()) if bool((~dead).any()) else 1.0
    h[dead, :] = 0
    h[:, dead] = 0
    idx = dead.nonzero().squeeze(1)
    h[idx, idx] = live_mean
    h += damping * live_mean * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.inv(h)
    q = torch.empty(w.shape, dtype=fmt.dtype)
    for i in order:
        qi = to_fp8(w[:, i].float(), scale.reshape(-1), fmt)
        q[:, i] = qi
        err = (w[:, i] - qi.double() * scale.reshape(-1).double()) / hinv[i, i]
        w -= err[:, None] * hinv[i][None, :]
        hinv = hinv - torch.outer(hinv[:, i], hinv[i]) / hinv[i, i]
    return q


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)
