"""Built-in features against independent computations, custom features, records and their export."""

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F
from inspect_toys import MLP, Attn, batches

import dbr_quant as dq
import dbr_quant.inspect as dqi

ALL_LOGS = "all:\n  layers: {name_regex: '.'}\n  features:\n    LogTensorStats: {}\n    LogFP8Stats: {}\n"


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype=torch.float8_e4m3fn, fmax=448.0) -> torch.Tensor:
    """Independent FP8 emulation in float64: divide, saturate, cast; returns the dequantized values."""
    q = (x.double() / scale.double()).clamp(-fmax, fmax).to(dtype)
    return q.double() * scale.double()


def _values(s, layer, tensor, step=None):
    return {r["stat"]: r["value"] for r in s.records
            if r["layer"] == layer and r["tensor"] == tensor and (step is None or r["step"] == step)}


@pytest.fixture
def known():
    """A prepared MLP with its calibration data (so scales can be computed independently)."""
    torch.manual_seed(1)
    model = MLP().eval()
    cal = batches(3)
    p = dq.prepare(model, (cal[0],))
    dq.calibrate(p, cal, progress=False)
    return model, p, cal


# each scheme's QConfig, given whether to quantize attention (weight-only leaves activations alone: never)
SCHEMES = {
    "per_tensor": lambda attention: dq.QConfig(quantize_attention=attention),
    "mxfp8": lambda attention: dq.QConfig.mxfp8(quantize_attention=attention),
    "mxfp8_ceil": lambda attention: dq.QConfig.mxfp8(scale_rounding="ceil", quantize_attention=attention),
    "weight_only": lambda attention: dq.QConfig.fp8_weight_only(),
    "weight_only_tensor": lambda attention: dq.QConfig.fp8_weight_only("tensor"),
}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_logging_only_is_bit_identical_to_fp8(scheme):
    for model_cls, example, attention in ((MLP, (8, 16), False), (Attn, (2, 6, 16), True)):
        torch.manual_seed(0)
        model = model_cls().eval()
        p = dq.prepare(model, (torch.randn(*example),), SCHEMES[scheme](attention))
        dq.calibrate(p, batches(3, example), progress=False)
        x = torch.randn(2, 6, 16)
        c = dq.convert(p)
        expected = c(x)
        with dqi.session(c, ALL_LOGS) as s:
            got_c = c(x)
        with dqi.session(p, ALL_LOGS):
            got_p = p(x)
        assert torch.equal(got_c, expected) and torch.equal(got_p, expected)
        assert s.records and not torch.equal(expected, model(x))  # FP8 really ran


def test_tensor_and_fp8_stats_match_independent_math(known):
    model, p, cal = known
    x = cal[1] * 1.5  # some values beyond the calibrated range: saturation > 0
    with dqi.session(p, ALL_LOGS) as s:
        p(x)
    st = _values(s, "fc1", "input")
    assert st["amax"] == pytest.approx(x.abs().max().item(), rel=1e-6)
    assert st["min"] == pytest.approx(x.min().item(), rel=1e-6)
    assert st["mean"] == pytest.approx(x.mean().item(), rel=1e-5, abs=1e-7)
    assert st["std"] == pytest.approx(x.std().item(), rel=1e-5)
    s_x = torch.stack([b.abs().max() for b in cal]).max() / 448.0  # running max over calibration
    assert st["scale"] == pytest.approx(s_x.item(), rel=1e-6)
    deq = _cast(x, s_x)
    assert st["saturated_pct"] == pytest.approx(100 * (x.abs() > s_x * 448).float().mean().item())
    assert st["saturated_pct"] > 0
    assert st["underflow_pct"] == pytest.approx(100 * ((x != 0) & (deq == 0)).double().mean().item())
    assert st["mse"] == pytest.approx((deq - x.double()).pow(2).mean().item(), rel=1e-4)
    sq = 10 * math.log10(x.double().pow(2).sum().item() / (deq - x.double()).pow(2).sum().item())
    assert st["sqnr_db"] == pytest.approx(sq, rel=1e-4)
    # weights: per-channel scales amax/448
    w = model.fc1.weight.detach()
    s_w = w.abs().amax(1) / 448.0
    sw = _values(s, "fc1", "weight")
    assert sw["scale_min"] == pytest.approx(s_w.min().item(), rel=1e-6)
    assert sw["scale_max"] == pytest.approx(s_w.max().item(), rel=1e-6)
    # fc1's FP8 output vs an fp64 emulation (the kernel rounds its GEMM once to bf16)
    y_ref = (deq @ _cast(w, s_w[:, None]).T + model.fc1.bias.double())
    so = _values(s, "fc1", "output")
    assert so["amax"] == pytest.approx(y_ref.abs().max().item(), rel=3e-3)
    assert so["mean"] == pytest.approx(y_ref.mean().item(), rel=1e-2, abs=1e-3)
    hp = model.fc1(x).detach().double()
    assert abs(hp.std().item() - so["std"]) > abs(y_ref.std().item() - so["std"])  # closer to FP8 than fp32


def test_step_window_and_freq(mlp_prepared):
    _, p = mlp_prepared
    cfg = "s:\n  layers: {name_regex: fc1}\n  features:\n    LogTensorStats: {freq: 2, start_step: 1, end_step: 5}\n"
    with dqi.session(p, cfg) as s:
        for _ in range(7):
            p(torch.randn(8, 16))
    assert s.steps == 7
    assert sorted({r["step"] for r in s.records}) == [1, 3, 5]
    assert {r["tensor"] for r in s.records} == {"input", "weight", "output"}


def test_disable_fp8(known):
    model, p, cal = known
    x = cal[0]
    with dqi.session(p, "s:\n  layers: {module_type: Linear}\n  features: {DisableFP8: {}}\n"):
        y = p(x)
    assert torch.equal(y, model(x))  # every layer in high precision = the fp32 model, bit for bit
    with dqi.session(p, "s:\n  layers: {name_regex: fc2}\n  features: {DisableFP8: {}}\n"):
        y2 = p(x)
    fp8 = dq.convert(p)(x)
    assert not torch.equal(y2, fp8) and not torch.equal(y2, y)


def test_fake_quant_matches_fp64_emulation(known):
    model, p, cal = known
    x = cal[2]
    with dqi.session(p, "s:\n  layers: {name_regex: fc}\n  features: {FakeQuant: {}}\n"):
        y = p(x).double()
    scales = {}
    for name in ("fc1", "fc2", "fc3"):
        st = p._auto_quant_state
        op = next(o for o in st.seen_ops if o.fqn == name)
        scales[name] = st.observers[f"{op.index}_input"].scale()
    h = x.double()
    for i, name in enumerate(("fc1", "fc2", "fc3")):
        lin = getattr(model, name)
        w = lin.weight.detach()
        h = F.linear(_cast(h, scales[name]), _cast(w, (w.abs().amax(1) / 448)[:, None]), lin.bias.double())
        h = F.relu(h) if i < 2 else h
    assert torch.allclose(y, h, rtol=1e-5, atol=1e-6)  # fake quant computes in fp32: no bf16 rounding
    assert (y - model(x).double()).abs().max() > 100 * (y - h).abs().max()
    with dqi.session(p, "s:\n  layers: {name_regex: fc}\n  features: {FakeQuant: {tensors: [weight]}}\n"):
        yw = p(x).double()
    assert not torch.allclose(yw, y, rtol=1e-5, atol=1e-6)


def test_scaling_formats_and_granularity(known):
    model, p, cal = known
    x = cal[0]
    cfg = ("s:\n  layers: {name_regex: fc1}\n  features:\n"
           "    Scaling: {weight_format: E5M2, weight_granularity: tensor, input_granularity: token}\n"
           "    LogFP8Stats: {}\n"
           "t:\n  layers: {name_regex: fc2}\n  features:\n    Scaling: {input_format: e5m2}\n    LogFP8Stats: {}\n")
    with dqi.session(p, cfg) as s:
        p(x)
    w = model.fc1.weight.detach()
    assert _values(s, "fc1", "weight")["scale"] == pytest.approx(w.abs().max().item() / 57344.0, rel=1e-6)
    row = x.abs().amax(-1) / 448.0
    si = _values(s, "fc1", "input")
    assert (si["scale_min"], si["scale_max"]) == (pytest.approx(row.min().item()), pytest.approx(row.max().item()))
    assert si["saturated_pct"] == 0
    # E5M2 input of fc2 with the calibrated amax: scale = amax / 57344 (E4M3's would be amax / 448)
    st = p._auto_quant_state
    op = next(o for o in st.seen_ops if o.fqn == "fc2")
    amax = st.observers[f"{op.index}_input"].scale() * 448.0
    assert _values(s, "fc2", "input")["scale"] == pytest.approx(amax.item() / 57344.0, rel=1e-5)
    # E5M2 has 2 mantissa bits: its SQNR is well below E4M3's
    with dqi.session(p, "s:\n  layers: {name_regex: fc2}\n  features: {LogFP8Stats: {}}\n") as s4:
        p(x)
    assert _values(s4, "fc2", "input")["sqnr_db"] > _values(s, "fc2", "input")["sqnr_db"] + 6


def test_attention_ops(attn_prepared):
    _, p = attn_prepared
    layers = dqi.recorded_layers(p)
    assert {r.info.kind for r in layers.values()} == {"linear", "matmul", "sdpa"}
    x = torch.randn(2, 6, 16)
    cfg = "s:\n  layers: {kind: sdpa}\n  features:\n    LogFP8Stats: {tensors: [q, k, v]}\n    DisableFP8: {}\n" \
          "m:\n  layers: {kind: matmul}\n  features:\n    LogTensorStats: {tensors: [a, b, output]}\n"
    with dqi.session(p, cfg) as s:
        y = p(x)
    assert {(r["tensor"]) for r in s.records if "sdpa" in r["layer"]} == {"q", "k", "v"}
    assert {(r["tensor"]) for r in s.records if "matmul" in r["layer"]} == {"a", "b", "output"}
    assert not torch.equal(y, dq.convert(p)(x))
    with dqi.session(p, "s:\n  layers: {kind: sdpa}\n  features: {Scaling: {input_granularity: token}}\n"):
        y_tok = p(x)
    assert torch.isfinite(y_tok).all() and not torch.equal(y_tok, y)


def test_custom_feature(mlp_prepared):
    _, p = mlp_prepared

    @dqi.register_feature
    class ClampOutput(dqi.Feature):
        limit: float = 1.0
        also_hp: bool = False

        def process_tensor(self, ctx, x):
            return x.clamp(-self.limit, self.limit) if ctx.tensor == "output" else x

        def use_fp8(self, layer):
            return False if self.also_hp else None

        def log_quantized(self, ctx, x, q):
            ctx.log("zeros", (q.data.float() == 0).sum().item())

    try:
        assert dqi.FEATURES["ClampOutput"] is ClampOutput
        with pytest.raises(ValueError, match="already registered"):
            dqi.register_feature(type("ClampOutput", (dqi.Feature,), {}))
        x = torch.randn(8, 16) * 4
        with dqi.session(p, "s:\n  layers: {name_regex: fc3}\n  features:\n    ClampOutput: {limit: 0.05}\n") as s:
            y = p(x)
        assert y.abs().max().item() == pytest.approx(0.05)
        assert {r["stat"] for r in s.records} == {"zeros"}
        err = pytest.raises(dqi.InspectConfigError, dqi.parse_config,
                            "s:\n  layers: {name_regex: fc3}\n  features:\n    ClampOutput:\n      limit: big\n")
        assert err.value.line == 5
        hp_cfg = "s:\n  layers: {name_regex: '.'}\n  features:\n    ClampOutput: {limit: 1e9, also_hp: true}\n"
        with dqi.session(p, hp_cfg):
            assert torch.equal(p(x), p.__class__.forward(p, x))  # all layers high precision = fp32
    finally:
        dqi.unregister_feature("ClampOutput")
    with pytest.raises(TypeError):
        dqi.register_feature(int)


def test_records_csv_json(mlp_prepared, tmp_path):
    _, p = mlp_prepared
    with dqi.session(p, ALL_LOGS) as s:
        p(torch.randn(8, 16))
        p(torch.randn(8, 16))
    assert all(set(r) == {"step", "layer", "tensor", "stat", "value"} for r in s.records)
    assert {r["step"] for r in s.records} == {0, 1}
    s.records.append({"step": 2, "layer": "fc1", "tensor": "input", "stat": "sqnr_db", "value": math.inf})
    s.to_csv(tmp_path / "r.csv")
    s.to_json(tmp_path / "r.json")
    with open(tmp_path / "r.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(s.records)
    assert all(float(a["value"]) == b["value"] and a["layer"] == b["layer"] for a, b in zip(rows, s.records))
    loaded = json.loads((tmp_path / "r.json").read_text())
    assert loaded[:-1] == s.records[:-1] and loaded[-1]["value"] == "inf"
    table = s.table(stats=("amax", "sqnr_db"), step=1)
    assert "fc1" in table and "sqnr_db" in table and len(table.splitlines()) == 2 + 9


def test_detaches_on_exception_and_refuses_nesting(mlp_prepared):
    _, p = mlp_prepared
    with pytest.raises(ZeroDivisionError):
        with dqi.session(p, ALL_LOGS):
            p(torch.randn(8, 16))
            raise ZeroDivisionError
    assert p._dbr_record.inspector is None and not p._forward_hooks and not p._forward_pre_hooks
    with dqi.session(p, ALL_LOGS):
        with pytest.raises(RuntimeError, match="already being inspected"):
            with dqi.session(p, ALL_LOGS):
                pass
    assert p._dbr_record.inspector is None
    with pytest.raises(TypeError):
        with dqi.session(MLP(), ALL_LOGS):
            pass


def test_converted_model_features(known):
    _, p, cal = known
    c = dq.convert(p)
    x = cal[0]
    with dq.disabled():
        hp = c(x)
    with dqi.session(c, "s:\n  layers: {kind: linear}\n  features: {DisableFP8: {}}\n"):
        assert torch.equal(c(x), hp)  # high precision on a converted model = its dequantized FP8 weights
    cfg = ("s:\n  layers: {name_regex: fc1}\n  features:\n"
           "    Scaling: {weight_granularity: tensor}\n    LogFP8Stats: {}\n")
    with dqi.session(c, cfg) as s:
        y = c(x)
    w_deq = c.fc1.weight.qdata.float() * c.fc1.weight.scale[:, None]
    assert _values(s, "fc1", "weight")["scale"] == pytest.approx(w_deq.abs().max().item() / 448, rel=1e-6)
    assert not torch.equal(y, c(x))
