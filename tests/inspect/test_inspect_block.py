"""dbr_quant.inspect on block-scaled models (``QConfig.fp8_block()``: 128×128 weight blocks, dynamic 1×128
activation groups), with ragged blocks (200 / 300 / 72 features), against independent float64 math."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
import dbr_quant.inspect as dqi

ALL_LOGS = "all:\n  layers: {name_regex: '.'}\n  features:\n    LogTensorStats: {}\n    LogFP8Stats: {}\n"


class RaggedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(200, 300)
        self.fc2 = nn.Linear(300, 72)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.fixture
def block_mlp():
    torch.manual_seed(0)
    model = RaggedMLP().eval()
    x = torch.randn(2, 5, 200)
    prepared = dq.prepare(model, (x,), dq.QConfig.fp8_block())
    return model, prepared, dq.convert(prepared), x


def _blocks(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Each element's block index grid: scale[n // rows, k // cols] by index arithmetic."""
    n, k = t.shape
    return torch.arange(n)[:, None] // rows, torch.arange(k)[None, :] // cols


def _block_fake_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized w, block scales) in float64: scale = block amax / 448, divide, saturate, cast."""
    n, k = w.shape
    scale = torch.zeros(math.ceil(n / 128), math.ceil(k / 128), dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max().double() / 448
    r, c = _blocks(w, 128, 128)
    s = scale[r, c]
    return (w.double() / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s, scale


def _group_fake_quant(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.float64)
    for start in range(0, x.shape[-1], 128):
        part = x[..., start:start + 128].double()
        s = part.abs().amax(-1, keepdim=True) / 448
        out[..., start:start + 128] = (part / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s
    return out


def _values(s, layer, tensor):
    return {r["stat"]: r["value"] for r in s.records if r["layer"] == layer and r["tensor"] == tensor}


def test_logging_only_is_bit_identical_on_block_layers(block_mlp):
    _, prepared, converted, x = block_mlp
    expected = converted(x)
    with dqi.session(converted, ALL_LOGS) as s:
        got_c = converted(x)
    with dqi.session(prepared, ALL_LOGS):
        got_p = prepared(x)
    assert torch.equal(got_c, expected) and torch.equal(got_p, expected)
    assert {r["layer"] for r in s.records} == {"fc1", "fc2"}


def test_fp8_stats_of_block_weights_and_group_inputs(block_mlp):
    model, prepared, _, x = block_mlp  # prepared: weight stats against the high-precision weights
    with dqi.session(prepared, ALL_LOGS) as s:
        prepared(x)
    deq_w, scale = _block_fake_quant(model.fc1.weight.detach())
    sw = _values(s, "fc1", "weight")
    assert scale.shape == (3, 2)  # 300 × 200: ragged in both directions
    assert sw["scale_min"] == pytest.approx(scale.min().item(), rel=1e-6)
    assert sw["scale_max"] == pytest.approx(scale.max().item(), rel=1e-6)
    w = model.fc1.weight.detach().double()
    assert sw["sqnr_db"] == pytest.approx(10 * math.log10(w.pow(2).sum() / (deq_w - w).pow(2).sum()), rel=1e-4)
    assert sw["saturated_pct"] == 0
    si = _values(s, "fc1", "input")
    deq_x = _group_fake_quant(x)
    sq = 10 * math.log10(x.double().pow(2).sum() / (deq_x - x.double()).pow(2).sum())
    assert si["sqnr_db"] == pytest.approx(sq, rel=1e-4)
    groups = torch.stack([x[..., :128].abs().amax(-1), x[..., 128:].abs().amax(-1)], -1) / 448
    assert si["scale_min"] == pytest.approx(groups.min().item(), rel=1e-6)
    assert si["scale_max"] == pytest.approx(groups.max().item(), rel=1e-6)


def test_fake_quant_and_disable_on_block_layers(block_mlp):
    model, _, converted, x = block_mlp
    fq = "fq:\n  layers: {name_regex: '.'}\n  features:\n    FakeQuant: {}\n"
    with dqi.session(converted, fq), torch.no_grad():
        got = converted(x)
    w1, _ = _block_fake_quant(model.fc1.weight.detach())
    w2, _ = _block_fake_quant(model.fc2.weight.detach())
    with torch.no_grad():
        h = F.gelu(F.linear(_group_fake_quant(x), w1, model.fc1.bias.double()))
        want = F.linear(_group_fake_quant(h), w2, model.fc2.bias.double())
    # fp32 vs float64 rounding of fc1's output could move an fc2 input across an FP8 rounding boundary; here
    # none does: measured max abs difference 1.9e-7 (output max 0.64), fp32 GEMM rounding only
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    off = "disable:\n  layers: {name_regex: '.'}\n  features:\n    DisableFP8: {}\n"
    with dqi.session(converted, off), torch.no_grad():
        hp = converted(x)
        w1 = _block_fake_quant(model.fc1.weight.detach())[0].float()
        w2 = _block_fake_quant(model.fc2.weight.detach())[0].float()
        want = F.linear(F.gelu(F.linear(x, w1, model.fc1.bias)), w2, model.fc2.bias)
    assert torch.allclose(hp, want, rtol=1e-5, atol=1e-6)


def test_scaling_on_block_layers(block_mlp, close_to_reference):
    _, _, converted, x = block_mlp
    token = "t:\n  layers: {name_regex: '^fc1$'}\n  features:\n    Scaling: {input_granularity: token}\n"
    with dqi.session(converted, token), torch.no_grad():
        per_token = converted(x)
    with torch.no_grad():
        assert not torch.equal(per_token, converted(x))
        assert torch.nn.functional.cosine_similarity(per_token, converted(x), dim=-1).min() > 0.99
        close_to_reference(per_token, converted(x), max_rel=0.07)  # measured 0.040
    channel = "c:\n  layers: {name_regex: '^fc1$'}\n  features:\n    Scaling: {weight_granularity: channel}\n"
    with pytest.raises(ValueError, match="group-scaled activations but per-channel / per-tensor weights"):
        with dqi.session(converted, channel), torch.no_grad():
            converted(x)
    e5m2 = "e:\n  layers: {name_regex: '^fc1$'}\n  features:\n    Scaling: {weight_format: e5m2}\n"
    with dqi.session(converted, e5m2 + "    LogFP8Stats: {tensors: [weight]}\n") as s, torch.no_grad():
        converted(x)
    assert _values(s, "fc1", "weight")["scale_max"] == pytest.approx(
        _block_fake_quant(block_mlp[0].fc1.weight.detach())[1].max().item() * 448 / 57344, rel=1e-6)


def test_sensitivity_on_a_block_model(block_mlp):
    _, prepared, _, x = block_mlp
    rows = dqi.sensitivity(prepared, [x, x * 2])
    assert sorted(r.layer for r in rows) == ["fc1", "fc2"]
    for r in rows:
        assert 0.99 < r.cosine < 1.0 and 20 < r.sqnr_db < math.inf and r.flops > 0
