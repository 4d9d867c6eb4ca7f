"""auto_fallback(rank="error_per_flop", max_high_precision_flops=...): the ranking, the budget, the curve, and
models rounded with GPTQ (prepared: inspect measures the GPTQ weights convert will store; converted with
``reference=``: high-precision layers run with the original weights)."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
import dbr_quant.inspect as dqi
from dbr_quant.inspect import LayerSensitivity


class Wide(nn.Module):
    """Layers of very different FLOPs: the big ones cause less error per FLOP."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.up, self.down, self.head = nn.Linear(16, 32), nn.Linear(32, 128), nn.Linear(128, 32), \
            nn.Linear(32, 4)

    def forward(self, x):
        h = F.gelu(self.inp(x))
        return self.head(h + self.down(F.gelu(self.up(h))))


def _data(seed: int, n: int, tokens: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(16, 16, generator=g) / 4 + 0.3 * torch.eye(16)
    return [torch.randn(tokens, 16, generator=g) @ mix for _ in range(n)]


def _prepared(qconfig=None):
    torch.manual_seed(0)
    model = Wide().eval()
    cal = _data(0, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = dq.prepare(model, (cal[0],), qconfig)
        dq.calibrate(p, cal, progress=False)
    return model, p


def _cos(a, b):
    return F.cosine_similarity(a.double(), b.double(), dim=-1).mean().item()


def test_rank_layers_by_error_and_by_error_per_flop():
    sens = [LayerSensitivity("a", "linear", 0.99, 20.0, 1000), LayerSensitivity("b", "linear", 0.999, 30.0, 10),
            LayerSensitivity("c", "linear", 0.995, 23.0, 100), LayerSensitivity("d", "matmul", 0.9999, 40.0, 0)]
    assert [s.layer for s in dqi.rank_layers(sens, "cosine", "error")] == ["a", "c", "b", "d"]
    # errors per FLOP: a 1e-5, b 1e-4, c 5e-5, d (0 FLOPs) free → first
    assert [s.layer for s in dqi.rank_layers(sens, "cosine", "error_per_flop")] == ["d", "b", "c", "a"]
    # SQNR: noise/signal 10^(-dB/10): a 1e-2/1000, b 1e-3/10, c ≈ 5.0e-3/100
    assert [s.layer for s in dqi.rank_layers(sens, "sqnr_db", "error_per_flop")] == ["d", "b", "c", "a"]
    assert dqi.layer_error(sens[0], "sqnr_db") == pytest.approx(1e-2)
    with pytest.raises(ValueError, match="rank must be"):
        dqi.rank_layers(sens, "cosine", "flops")


def test_budget_curve_is_the_ranked_layers_that_fit_and_each_point_is_measured():
    model, p = _prepared(dq.QConfig(weight=dq.TensorQConfig(granularity="tensor")))
    ev = _data(1, 2)
    budget = 0.3
    res = dqi.auto_fallback(p, ev, max_high_precision_flops=budget, rank="error_per_flop")
    total = dqi.linear_flops(p)
    flops = {s.layer: s.flops for s in res.sensitivity}
    assert set(flops) == {"inp", "up", "down", "head"} and total == sum(flops.values())
    # the curve walks the error-per-FLOP order, passing over layers that no longer fit
    want, used = [], 0
    for s in sorted(res.sensitivity, key=lambda s: -(1 - s.cosine) / s.flops):
        if used + s.flops <= budget * total:
            want.append(s.layer)
            used += s.flops
    assert [list(pt.layers) for pt in res.curve] == [want[:k] for k in range(len(want) + 1)]
    for pt in res.curve:
        assert pt.fp8_flop_fraction == pytest.approx(1 - sum(flops[n] for n in pt.layers) / total)
        assert 1 - pt.fp8_flop_fraction <= budget + 1e-12
    best = max(res.curve, key=lambda pt: pt.cosine)
    assert res.met and res.target is None and res.fallback == best.layers and res.cosine == best.cosine
    # the chosen point, measured independently: prepare again with its QConfig, calibrate, convert
    cal = _data(0, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p2 = dq.prepare(model, (cal[0],), res.qconfig())
        dq.calibrate(p2, cal, progress=False)
        c2 = dq.convert(p2)
    with torch.no_grad():
        got = _cos(torch.cat([c2(x) for x in ev]), torch.cat([model(x) for x in ev]))
    assert got == pytest.approx(res.cosine, abs=1e-6)
    with dqi.fallback_applied(p, res.fallback), torch.no_grad():  # the same without converting again
        applied = _cos(torch.cat([p(x) for x in ev]), torch.cat([model(x) for x in ev]))
    assert applied == pytest.approx(got, abs=1e-6)
    with pytest.raises(ValueError, match="not recorded"):
        with dqi.fallback_applied(p, ["nope"]):
            pass
    table = res.curve_table()
    assert table.count("\n") == len(res.curve) and "FP8 FLOPs" in table and "%" in res.summary()


def test_target_with_a_budget_and_errors():
    _, p = _prepared()
    ev = _data(2, 2)
    res = dqi.auto_fallback(p, ev, target=1.5, max_high_precision_flops=0.0, rank="error_per_flop")
    assert not res.met and res.fallback == () and res.fp8_flop_fraction == 1.0 and len(res.curve) == 1
    with pytest.raises(ValueError, match="target"):
        dqi.auto_fallback(p, ev)
    with pytest.raises(ValueError, match="fraction"):
        dqi.auto_fallback(p, ev, max_high_precision_flops=1.5)


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fallback_on_gptq_models_measures_the_gptq_weights(granularity):
    weight = dq.TensorQConfig(granularity=granularity)
    model, p = _prepared(dq.QConfig(weight=weight, weight_rounding="gptq", fuse=False))
    _, p_near = _prepared(dq.QConfig(weight=weight, fuse=False))
    ev = _data(3, 2)
    with torch.no_grad():
        ref = torch.cat([model(x) for x in ev])

    def all_fp8(converted):
        with torch.no_grad():
            return _cos(torch.cat([converted(x) for x in ev]), ref)

    c = dq.convert(p)
    gptq, nearest = all_fp8(c), all_fp8(dq.convert(p_near))
    assert abs(gptq - nearest) > 1e-5  # far wider than the 1e-7 tolerance below
    kw = dict(max_high_precision_flops=1.0, rank="error_per_flop")
    on_prepared = dqi.auto_fallback(p, ev, **kw)  # the prepared model keeps its Hessians for convert
    on_converted = dqi.auto_fallback(c, ev, reference=model, **kw)
    for res in (on_prepared, on_converted):
        assert res.curve[0].cosine == pytest.approx(gptq, abs=1e-7)
        assert res.curve[-1].fp8_flop_fraction == 0.0 and res.curve[-1].sqnr_db == math.inf
    assert [pt.layers for pt in on_prepared.curve] == [pt.layers for pt in on_converted.curve]
    for a, b in zip(on_prepared.curve, on_converted.curve, strict=True):
        assert a.cosine == pytest.approx(b.cosine, abs=1e-7)
