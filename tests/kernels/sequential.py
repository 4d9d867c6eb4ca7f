"""Plain-torch definitions the CPU kernels are checked against (imported by the kernel tests)."""

from __future__ import annotations

import torch


def sequential_linear(xq, xs, wq, ws, bias=None, relu=False, residual=None):
    """The small-linear definition in plain fp32 torch ops, one k at a time (every product and sum rounded):
    ``act(Σ_k (x·s_x)(w·s_w) + b) + r`` with the operands dequantized first."""
    xd = xq.float() * xs
    wd = wq.float() * (ws.reshape(-1, 1) if ws.dim() else ws)
    acc = torch.zeros(*xq.shape[:-1], wq.shape[0])
    for k in range(xq.shape[-1]):
        acc = acc + xd[..., k:k + 1] * wd[:, k]
    y = acc if bias is None else acc + bias
    y = torch.relu(y) if relu else y
    return y if residual is None else y + residual
