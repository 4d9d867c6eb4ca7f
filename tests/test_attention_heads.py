"""Per-head attention scales, ``QConfig(quantize_attention=True, attention_scales="head")``: the setting, the
per-head observers (q and the probabilities per query head, k and v per KV head under GQA), the converted run
against the kernel on hand-quantized operands, and the KV-head counts a scale meets (repeated or not)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
from dbr_quant import kernels
from dbr_quant.formats import FP8Format, safe_scale
from dbr_quant.ops.heads import fit_heads, observable

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
# kv heads whose keys lie 2^16 apart, their query heads scaled inversely so the scores are the unscaled model's.
# E4M3's relative precision is the same over its normal range (2^-6 .. 448, about 2^15): what one shared scale
# costs the small heads is the values it pushes below that range (subnormal spacing, then zero), so only spreads
# beyond ~2^12 cost accuracy (benchmarks/attention_heads.py measures the sweep)
K_SPREAD = torch.tensor([2.0**-8, 2.0**8])


class Attention(nn.Module):
    """GQA attention whose heads' ranges differ (q and k scaled per head after the projections, the scores
    unchanged); SDPA (kv heads as they are, or repeated) or eager (q·kᵀ, softmax, p·v on repeated kv heads)."""

    def __init__(self, eager: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(64, HEADS * HEAD_DIM)
        self.k = nn.Linear(64, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(64, KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, 64)
        self.eager = eager
        self.register_buffer("k_spread", K_SPREAD.reshape(1, KV_HEADS, 1, 1).clone())
        self.register_buffer("q_spread", 1 / self.k_spread.repeat_interleave(HEADS // KV_HEADS, dim=1))

    def forward(self, x: torch.Tensor, repeat: bool = False) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2) * self.q_spread
        k = self.k(x).view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2) * self.k_spread
        v = self.v(x).view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
        if repeat or self.eager:
            k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        if self.eager:
            p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM), dim=-1)
            out = torch.matmul(p, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not repeat)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


ATTENTION_ONLY = (dq.Override(pattern=r"^[qkvo]$", skip=True),)  # the linears high precision: attention's error


def _convert(model: nn.Module, scales: str, repeat_in_calibration: bool = False) -> nn.Module:
    qconfig = dq.QConfig(quantize_attention=True, attention_scales=scales, overrides=ATTENTION_ONLY)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, (torch.randn(2, 12, 64, generator=gen),), qconfig)
        dq.calibrate(prepared, [(torch.randn(2, 24, 64, generator=gen), repeat_in_calibration) for _ in range(3)],
                     progress=False)
        return dq.convert(prepared)


def _attention_state(converted: nn.Module):
    return next(st for st in converted.__dict__["_dbr_record"].states if any(op.quantize for op in st.seen_ops))


def test_setting_is_typed_and_checked():
    assert dq.QConfig().attention_scales == "tensor"
    with pytest.raises(ValueError, match="'tensor' or 'head'"):
        dq.QConfig(quantize_attention=True, attention_scales="channel")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="set quantize_attention=True"):
        dq.QConfig(attention_scales="head")
    with pytest.raises(ValueError, match="one scale per attention head .*set dynamic=False"):
        dq.QConfig(quantize_attention=True, attention_scales="head", dynamic=True)


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_scales_are_per_head_and_per_kv_head(eager):
    """SDPA: q per query head [4], k and v per kv head [2]; eager attention's matmuls (on repeated kv heads):
    each operand per head, the probabilities included. Each scale is its head's calibrated amax / 448."""
    model = Attention(eager)
    converted = _convert(model, "head")
    st = _attention_state(converted)
    shapes = {slot: tuple(st.scale(op, slot).shape) for op in st.seen_ops if op.quantize for slot in op.slots}
    assert shapes == ({"a": (HEADS,), "b": (HEADS,)} if eager else {"q": (HEADS,), "k": (KV_HEADS,), "v": (KV_HEADS,)})
    per_tensor = _attention_state(_convert(model, "tensor"))
    assert all(per_tensor.scale(op, s).dim() == 0 for op in per_tensor.seen_ops if op.quantize for s in op.slots)
    if not eager:  # the per-head amaxes, recomputed from the calibration batches
        gen = torch.Generator().manual_seed(1)
        torch.randn(2, 12, 64, generator=gen)
        xs = [torch.randn(2, 24, 64, generator=gen) for _ in range(3)]
        with torch.no_grad():
            ks = torch.stack([(model.k(x).view(2, 24, KV_HEADS, HEAD_DIM).transpose(1, 2) * model.k_spread)
                              .abs().amax(dim=(0, 2, 3)) for x in xs]).amax(0)
        op = next(op for op in st.seen_ops if op.quantize)
        assert torch.equal(st.scale(op, "k"), safe_scale(ks, FP8Format.E4M3))


def test_converted_sdpa_is_the_kernel_on_per_head_operands():
    """The converted attention = ``kernels.fp8_attention`` on q/k/v quantized per head by hand (bit for bit)."""
    model = Attention()
    converted = _convert(model, "head")
    st = _attention_state(converted)
    op = next(op for op in st.seen_ops if op.quantize)
    x = torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        b, n = x.shape[:2]
        q = model.q(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2) * model.q_spread
        k = model.k(x).view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2) * model.k_spread
        v = model.v(x).view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
        qs, ks, vs = (st.scale(op, s) for s in "qkv")
        quantized = [kernels.quantize(t, s.reshape(-1, 1, 1), FP8Format.E4M3) for t, s in ((q, qs), (k, ks), (v, vs))]
        out = kernels.fp8_attention(quantized[0], qs, quantized[1], ks, quantized[2], vs, is_causal=True)
        want = model.o(out.to(q.dtype).transpose(1, 2).reshape(b, n, -1))
        assert torch.equal(converted(x), want)


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_per_head_scales_beat_per_tensor_when_head_ranges_differ(eager):
    """Heads 2^16 apart: per-tensor scales put the small heads' values in FP8's subnormal range; per-head scales
    give every head the normal range. Measured on the attention output (linears high precision)."""
    model, unspread = Attention(eager), Attention(eager)
    unspread.k_spread.fill_(1.0)
    unspread.q_spread.fill_(1.0)
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(unspread(x), want)  # the spread leaves the function as it was
        out = {s: _convert(model, s)(x) for s in ("tensor", "head")}
        err = {s: ((y - want).norm() / want.norm()).item() for s, y in out.items()}
        assert err["head"] < 0.5 * err["tensor"], err
        # per head, a power-of-two spread moves each head's scale by its factor: the same FP8 codes, the same bits
        assert torch.equal(out["head"], _convert(unspread, "head")(x))


@pytest.mark.parametrize("calibrated_repeated", [False, True])
def test_kv_heads_repeated_or_not_give_the_same_result(calibrated_repeated):
    """A k/v scale calibrated on kv heads as they are ([2]) serves their repeated copies ([4]: the scale
    repeated) and one calibrated on repeated copies serves the kv heads (each group's largest, all equal): the
    same FP8 values either way, so the same output bit for bit."""
    converted = _convert(Attention(), "head", repeat_in_calibration=calibrated_repeated)
    st = _attention_state(converted)
    op = next(op for op in st.seen_ops if op.quantize)
    assert st.scale(op, "k").shape == (HEADS if calibrated_repeated else KV_HEADS,)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(converted(x, repeat=True), converted(x, repeat=False))


def test_head_counts_that_do_not_fit_are_errors_naming_the_op():
    assert torch.equal(fit_heads(torch.tensor([1.0, 2.0]), 4, "op"), torch.tensor([1.0, 1.0, 2.0, 2.0]))
    assert torch.equal(fit_heads(torch.tensor([1.0, 1.0, 3.0, 3.0]), 2, "op"), torch.tensor([1.0, 3.0]))
    x = torch.arange(2 * 4 * 3 * 2, dtype=torch.float32).reshape(2, 4, 3, 2)
    folded = observable(x, 2)  # groups of two heads folded into the sequence: per-group amax = per-kv-head amax
    assert folded.shape == (2, 2, 6, 2)
    assert torch.equal(folded.abs().amax(dim=(0, 2, 3)), x.abs().amax(dim=(0, 2, 3)).reshape(2, 2).amax(1))
    assert observable(x[:, :1], 4).shape == (2, 4, 3, 2)
    with pytest.raises(ValueError, match="sdpa attn 'k': 3 per-head scales .* operand has 2 heads"):
        fit_heads(torch.ones(3), 2, "sdpa attn 'k'")
    with pytest.raises(ValueError, match="sized for 3 heads cannot observe an operand with 4 heads"):
        observable(x, 3)
