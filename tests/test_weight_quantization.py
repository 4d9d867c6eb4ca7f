"""Weights quantized in row blocks equal the whole weight observed and quantized at once, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dbr_quant as dq
from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.quantize.weight_quantization import quantize_weight

OBSERVERS = [dq.RunningMax(), dq.MovingAverage(0.1), dq.AmaxHistory(4, margin=1), dq.Percentile(99.0),
             dq.MSE(num_candidates=6)]


def _whole(w: torch.Tensor, cfg: dq.TensorQConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """What convert did before blocks: one observer on the whole weight, one quantize call."""
    per_channel = cfg.granularity == "channel"
    obs = cfg.observer.create(cfg.format, 0 if per_channel else None)
    obs(w)
    scale = obs.scale()
    return kernels.quantize(w, scale.unsqueeze(1) if per_channel else scale, cfg.format), scale


@settings(max_examples=30, deadline=None)
@given(observer=st.sampled_from(OBSERVERS), granularity=st.sampled_from(["tensor", "channel"]),
       fmt=st.sampled_from([FP8Format.E4M3, FP8Format.E5M2]), n=st.integers(1, 40), k=st.integers(1, 24),
       block=st.integers(1, 64), transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_blocks_equal_the_whole_weight(observer, granularity, fmt, n, k, block, transposed, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 2, n)[:, None]
    if transposed:  # Hugging Face Conv1D: the [out, in] weight is a transposed view
        w = w.t().contiguous().t()
    cfg = dq.TensorQConfig(format=fmt, observer=observer, granularity=granularity)
    quantized = quantize_weight(w, cfg, block_elements=block)
    q, scale = quantized.qdata, quantized.scale
    q_ref, scale_ref = _whole(w, cfg)
    assert torch.equal(scale, scale_ref)
    assert q.dtype == fmt.dtype and q.is_contiguous() and q.shape == w.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_default_block_size_on_a_large_weight(granularity):
    w = torch.randn(600, 1000) * 3
    cfg = dq.TensorQConfig(observer=dq.RunningMax(), granularity=granularity)
    quantized = quantize_weight(w, cfg)  # 3 blocks of 262 rows
    q, scale = quantized.qdata, quantized.scale
    q_ref, scale_ref = _whole(w, cfg)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
