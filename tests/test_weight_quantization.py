"""Weights quantized in row blocks equal the whole weight observed and quantized at once, bit for bit; a weight
quantized on every call equals what convert stores."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dbr_quant as dq
from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.quantize.weight_quantization import quantize_weight
from dbr_quant.quantize.weights import FP8Weight

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


class _SharedWeight(nn.Module):
    """``F.linear(x, self.w)`` plus another read of ``self.w``: the parameter stays high precision and the linear
    quantizes it on every call (runtime/param_weights.py)."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.linear(x, self.w), self.w.abs().amax()


def _converted(model: nn.Module, qconfig: dq.QConfig, x: torch.Tensor) -> nn.Module:
    prepared = dq.prepare(model, (x,), qconfig)
    dq.calibrate(prepared, [(x,)], progress=False)
    return dq.convert(prepared)


@pytest.mark.parametrize("observer", [dq.MSE(num_candidates=8), dq.Percentile(99.0), dq.AmaxHistory(4, margin=1),
                                      dq.RunningMax()])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_a_weight_quantized_per_call_uses_the_observer_convert_uses(observer, granularity, monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 16, generator=g) * torch.logspace(-1, 1, 24)[:, None]
    w[:, 0] *= 30  # an outlier in every row: percentile and MSE clip it
    x = torch.randn(5, 16, generator=g)
    qconfig = dq.QConfig(weight=dq.TensorQConfig(observer=observer, granularity=granularity))
    shared = _converted(_SharedWeight(w), qconfig, x)
    linear = nn.Linear(16, 24, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    stored = _converted(linear, qconfig, x)
    assert type(shared.w) is not FP8Weight and type(stored.weight) is FP8Weight  # per call vs stored by convert
    per_call = quantize_weight(w, qconfig.weight, per_call=True)
    assert torch.equal(per_call.scale, stored.weight.scale)
    assert torch.equal(per_call.qdata.view(torch.uint8), stored.weight.qdata.view(torch.uint8))
    weights_run = []
    fp8_linear = kernels.fp8_linear

    def spy(x_q, x_scale, w_q, w_scale, **kwargs):
        weights_run.append((w_q, w_scale))
        return fp8_linear(x_q, x_scale, w_q, w_scale, **kwargs)

    monkeypatch.setattr(kernels, "fp8_linear", spy)
    with torch.no_grad():
        assert torch.equal(shared(x)[0], stored(x))
    (shared_q, shared_scale), (stored_q, stored_scale) = weights_run
    assert torch.equal(shared_scale, stored_scale)
    assert torch.equal(shared_q.view(torch.uint8), stored_q.view(torch.uint8))


@pytest.mark.parametrize(("observer", "granularity"), [(o, g) for o in OBSERVERS for g in ("tensor", "channel")]
                         + [(dq.RunningMax(), "block")])  # block scales: each block's amax (RunningMax only)
def test_per_call_equals_convert(observer, granularity):
    w = (torch.randn(300, 40) * 2).t()  # a transposed view, as a matmul's weight operand arrives
    cfg = dq.TensorQConfig(observer=observer, granularity=granularity, block=(16, 32))
    a, b = quantize_weight(w, cfg), quantize_weight(w, cfg, per_call=True, block_elements=64)
    assert torch.equal(a.scale, b.scale) and a.block == b.block
    assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8))


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("transposed", [False, True])
@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_dequantize_in_row_chunks_equals_whole(granularity, transposed, n, k, seed):
    """A large weight's dequantize runs in row chunks (bounded fp32 temporaries): the same bits as one pass,
    ragged last chunk and ragged last block row included."""
    torch.manual_seed(seed)
    cfg = dq.TensorQConfig(granularity=granularity, block=(16, 32))
    q = quantize_weight(torch.randn(n, k) * 3, cfg)
    w = FP8Weight(q.qdata, q.scale, torch.bfloat16, transposed=transposed, block=q.block)
    whole = kernels.dequantize(w.qdata, w.elementwise_scale(), torch.bfloat16)
    whole = whole.t() if transposed else whole
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("dbr_quant.quantize.weights.DEQUANTIZE_CHUNK", 40)  # many chunks of a few rows
        with kernels.count_launches() as launches:
            chunked = w.dequantize()
    if n >= 64 and n * k > 40:  # more rows than one chunk takes (at most 40 // k rows, or two 16-row blocks)
        assert launches["dequantize"] > 1
    assert chunked.dtype == torch.bfloat16 and torch.equal(chunked.view(torch.int16), whole.view(torch.int16))


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("bias", [False, True])
@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 70), tokens=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_linear_on_an_fp8_weight_in_row_chunks(granularity, bias, n, k, tokens, seed):
    """F.linear on an FP8 weight outside the runtime (load_pretrained's trace) dequantizes its rows a chunk at a
    time into one output: the product of the input and the dequantized weight, the weight never whole."""
    torch.manual_seed(seed)
    cfg = dq.TensorQConfig(granularity=granularity, block=(16, 32))
    q = quantize_weight(torch.randn(n, k) * 3, cfg)
    w = nn.Parameter(FP8Weight(q.qdata, q.scale, torch.float32, block=q.block), requires_grad=False)
    x = torch.randn(2, tokens, k, requires_grad=True)
    b = torch.randn(n) if bias else None
    whole = F.linear(x, w.dequantize(), b)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("dbr_quant.quantize.weights.MATMUL_CHUNK", 40)  # a few rows per chunk
        with kernels.count_launches() as launches:
            chunked = F.linear(x, w, b)
    step = max(1, 40 // k) if granularity != "block" else max(1, 40 // k // 16) * 16
    assert launches["dequantize"] == (1 if n * k <= 40 else -(-n // step))
    assert chunked.shape == whole.shape and chunked.requires_grad
    # two summation orders of k products (BLAS picks its kernel by the output's width): within the fp32 bound
    magnitude = F.linear(x.abs(), w.dequantize().abs(), None if b is None else b.abs())
    bound = 2 * (k + 1) * torch.finfo(torch.float32).eps * magnitude
    assert bool(((chunked - whole).abs() <= bound).all())


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("transposed", [False, True])
def test_one_expert_of_stacked_fp8_experts_is_that_experts_fp8_weight(granularity, transposed):
    """``experts.gate_up_proj[e]`` (transformers' eager experts loop) is expert e's FP8 bytes and scales as a 2-D
    FP8 weight: its values are the stack's dequantized values of that expert, and a linear on it dequantizes
    that expert alone."""
    torch.manual_seed(0)
    n, k = 48, 32
    cfg = dq.TensorQConfig(granularity=granularity, block=(16, 16))
    q = quantize_weight(torch.randn(4, n, k) * 2, cfg)
    w = nn.Parameter(FP8Weight(q.qdata, q.scale, torch.float32, transposed=transposed, block=q.block),
                     requires_grad=False)
    whole = w.dequantize()
    for e in range(4):
        one = w[e]
        assert isinstance(one, FP8Weight) and one.shape == whole[e].shape
        assert torch.equal(one.qdata.view(torch.uint8), q.qdata[e].view(torch.uint8))
        assert torch.equal(one.dequantize(), whole[e])
        x = torch.randn(3, one.shape[-1])
        with kernels.count_launches() as launches:
            y = F.linear(x, one)
        assert launches["dequantize"] == 1 and torch.equal(y, F.linear(x, whole[e]))
