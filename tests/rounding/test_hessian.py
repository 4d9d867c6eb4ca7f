"""HessianAccumulator: the sums equal 2/n Σ xᵀx from the definition, folds are round robin, bad rows are
left out, and the memory is what the docstring says."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rounding_helpers import hessian_of

from dbr_quant.quantize.rounding import HessianAccumulator


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 40), folds=st.integers(1, 4), sizes=st.lists(st.integers(0, 30), min_size=1, max_size=7),
       seed=st.integers(0, 2**31 - 1))
def test_folds_hold_their_batches_hessian(k, folds, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randn(2, n, k, generator=g) * 3 for n in sizes]  # 3-d inputs: [batch, seq, k]
    acc = HessianAccumulator(k, folds=folds)
    for x in batches:
        acc.add(x)
    assert acc.batches == len(batches)
    for f in range(folds):
        mine = [x for i, x in enumerate(batches) if i % folds == f]
        tokens = sum(x.shape[0] * x.shape[1] for x in mine)
        assert int(acc.tokens[f]) == tokens
        if tokens:
            expected = hessian_of(torch.cat([x.reshape(-1, k) for x in mine]))
            torch.testing.assert_close(acc.hessian([f]), expected, rtol=1e-5, atol=1e-5)
    if int(acc.tokens.sum()):
        everything = hessian_of(torch.cat([x.reshape(-1, k) for x in batches]))
        torch.testing.assert_close(acc.hessian(), everything, rtol=1e-5, atol=1e-5)
        assert acc.hessian().dtype == torch.float64


def test_nonfinite_tokens_are_skipped_and_counted():
    x = torch.randn(10, 6)
    bad = x.clone()
    bad[2, 1] = float("nan")
    bad[7, 0] = float("inf")
    acc = HessianAccumulator(6, folds=1)
    acc.add(bad)
    assert acc.skipped_tokens == 2 and int(acc.tokens[0]) == 8
    keep = torch.ones(10, dtype=torch.bool)
    keep[[2, 7]] = False
    torch.testing.assert_close(acc.hessian(), hessian_of(x[keep]))


def test_inference_mode_in_and_out():
    """calibrate may run under torch.inference_mode; an accumulator built there must still take batches later."""
    x, y = torch.randn(5, 3), torch.randn(4, 3)
    with torch.inference_mode():
        acc = HessianAccumulator(3, folds=1)
        acc.add(x)
    acc.add(y)
    with torch.inference_mode():
        acc.add(x)
    torch.testing.assert_close(acc.hessian(), hessian_of(torch.cat([x, y, x])))


def test_memory_cost_is_folds_times_k_squared():
    acc = HessianAccumulator(384, folds=2)
    assert acc.nbytes == HessianAccumulator.bytes_needed(384, 2) == 2 * 384 * 384 * 8
    assert HessianAccumulator(10, 3, dtype=torch.float32).nbytes == 3 * 10 * 10 * 4


def test_errors_name_the_problem():
    acc = HessianAccumulator(4, folds=2)
    with pytest.raises(ValueError, match=r"\[\.\.\., 4\]"):
        acc.add(torch.randn(3, 5))
    with pytest.raises(ValueError, match="no calibration tokens"):
        acc.hessian()
    acc.add(torch.randn(3, 4))
    with pytest.raises(ValueError, match="no calibration tokens"):
        acc.hessian([1])  # the second batch never came
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="in_features"):
            HessianAccumulator(bad)
    with pytest.raises(ValueError, match="folds"):
        HessianAccumulator(4, folds=0)
