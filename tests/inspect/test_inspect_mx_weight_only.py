"""dbr_quant.inspect on MXFP8 (``QConfig.mxfp8()``, floor and ceil) and weight-only FP8 (``QConfig.fp8_weight_only()``)
models: stats against independent float64 math, the input of a weight-only linear reported as not quantized,
sensitivity equal to a model converted with only that layer quantized, and the Scaling settings no GEMM computes
refused at the config's line. (Bit-identity of an inspect session with convert: test_inspect_features.py.)"""

import math

import pytest
import torch
import torch.nn.functional as F
from inspect_toys import MLP, batches

import dbr_quant as dq
import dbr_quant.inspect as dqi

ALL_LOGS = "all:\n  layers: {name_regex: '.'}\n  features:\n    LogTensorStats: {}\n    LogFP8Stats: {}\n"
FP8_STATS = {"underflow_pct", "saturated_pct", "mse", "sqnr_db", "scale", "scale_min", "scale_max"}


def _values(s, layer, tensor):
    return {r["stat"]: r["value"] for r in s.records if r["layer"] == layer and r["tensor"] == tensor}


def _prepared(qconfig):
    torch.manual_seed(1)
    model = MLP().eval()
    cal = batches(3)
    p = dq.prepare(model, (cal[0],), qconfig)
    dq.calibrate(p, cal, progress=False)
    return model, p, cal


def _mx_fake_quant(x: torch.Tensor, ceil: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized x, the scale of each element) in float64, OCP MX along the last dim in blocks of 32: scale =
    2^(floor(log2 amax) - 8) (floor), or the smallest power of two with amax / scale ≤ 448 (ceil); divide, saturate,
    cast to E4M3."""
    k = x.shape[-1]
    padded = F.pad(x.double(), (0, -k % 32))  # a ragged last block: its real elements only (zeros add no amax)
    blocks = padded.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    if ceil:
        exponent = torch.ceil(torch.log2(amax / 448))
    else:
        exponent = torch.floor(torch.log2(amax)) - 8
    scale = torch.exp2(exponent).expand_as(blocks)
    q = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale
    return q.reshape(padded.shape)[..., :k], scale.reshape(padded.shape)[..., :k]


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_mx_stats_match_float64_emulation(rounding):
    model, p, cal = _prepared(dq.QConfig.mxfp8(scale_rounding=rounding))
    x = cal[1]
    with dqi.session(p, ALL_LOGS) as s:
        p(x)
    for tensor, t in (("input", x), ("weight", model.fc1.weight.detach())):
        deq, scale = _mx_fake_quant(t, rounding == "ceil")
        st = _values(s, "fc1", tensor)
        assert st["scale_min"] == scale.min().item() and st["scale_max"] == scale.max().item()  # powers of two
        err = (deq - t.double()).pow(2)
        assert st["mse"] == pytest.approx(err.mean().item(), rel=1e-6)
        assert st["sqnr_db"] == pytest.approx(10 * math.log10(t.double().pow(2).sum().item() / err.sum().item()),
                                              rel=1e-6)
        saturated = 100 * ((t.double() / scale).abs() > 448).double().mean().item()
        assert st["saturated_pct"] == pytest.approx(saturated)
        if rounding == "ceil":
            assert saturated == 0  # the smallest scale that saturates nothing
    # fc1's output: the MX GEMM of the two fake-quantized operands (fp32 sums: close, not bit-equal)
    y_ref = F.linear(_mx_fake_quant(x, rounding == "ceil")[0],
                     _mx_fake_quant(model.fc1.weight.detach(), rounding == "ceil")[0], model.fc1.bias.double())
    assert _values(s, "fc1", "output")["amax"] == pytest.approx(y_ref.abs().max().item(), rel=1e-5)


def test_mx_floor_saturates_some_blocks():
    """The OCP floor rule leaves amax / scale in [256, 512): E4M3 clips what lies above 448 (a measured count)."""
    model, p, _ = _prepared(dq.QConfig.mxfp8())
    with dqi.session(p, "s:\n  layers: {name_regex: fc}\n  features: {LogFP8Stats: {tensors: [weight]}}\n") as s:
        p(torch.randn(4, 16))
    pct = [_values(s, n, "weight")["saturated_pct"] for n in ("fc1", "fc2", "fc3")]
    w = torch.cat([getattr(model, n).weight.detach().reshape(-1, 32) for n in ("fc1", "fc2", "fc3")])
    assert sum(pct) > 0 and (w.abs().amax(-1) / torch.exp2(torch.floor(torch.log2(w.abs().amax(-1))) - 8) > 448).any()


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_weight_only_input_is_reported_as_not_quantized(granularity):
    model, p, cal = _prepared(dq.QConfig.fp8_weight_only(granularity))
    x = cal[0]
    with dqi.session(p, ALL_LOGS) as s:
        p(x)
    for layer in ("fc1", "fc2", "fc3"):
        inp = _values(s, layer, "input")
        assert set(inp) == {"amax", "min", "max", "mean", "std"}  # seen, but no FP8 stats: it is not quantized
        assert FP8_STATS & set(_values(s, layer, "weight"))
    w = model.fc1.weight.detach()
    amax = w.abs().amax(1) if granularity == "channel" else w.abs().max()
    deq = (w.double() / (amax.double() / 448).reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn).double() * (
        amax.double() / 448).reshape(-1, 1)
    sq = 10 * math.log10(w.double().pow(2).sum().item() / (deq - w.double()).pow(2).sum().item())
    assert _values(s, "fc1", "weight")["sqnr_db"] == pytest.approx(sq, rel=1e-6)
    assert "input" not in s.table(stats=("sqnr_db",))


def test_weight_only_fake_quant_touches_only_the_weight():
    model, p, cal = _prepared(dq.QConfig.fp8_weight_only())
    x = cal[2]
    with dqi.session(p, "s:\n  layers: {name_regex: fc}\n  features: {FakeQuant: {}}\n"):
        y = p(x).double()
    h = x.double()
    for i, name in enumerate(("fc1", "fc2", "fc3")):
        lin = getattr(model, name)
        w = lin.weight.detach().double()
        s = w.abs().amax(1, keepdim=True) / 448
        h = F.linear(h, (w / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s, lin.bias.double())
        h = F.relu(h) if i < 2 else h
    assert torch.allclose(y, h, rtol=1e-5, atol=1e-6)  # the input went in as it is

    @dqi.register_feature
    class QuantizeInput(dqi.Feature):
        def process_tensor(self, ctx, t):
            return ctx.quantize(t).dequantize() if ctx.tensor == "input" else t

    try:
        with pytest.raises(RuntimeError, match=r"'fc1' runs weight-only FP8.*'input' is not quantized.*quantizes"):
            with dqi.session(p, "s:\n  layers: {name_regex: fc1}\n  features: {QuantizeInput: {}}\n"):
                p(x)
    finally:
        dqi.unregister_feature("QuantizeInput")


@pytest.mark.filterwarnings("ignore:dbr_quant.*stay high precision")
@pytest.mark.parametrize("scheme", ["mxfp8", "weight_only"])
def test_sensitivity_is_the_model_with_only_that_layer_quantized(scheme):
    qconfig = dq.QConfig.mxfp8 if scheme == "mxfp8" else dq.QConfig.fp8_weight_only
    model, p, cal = _prepared(qconfig())
    ev = [torch.randn(8, 16) for _ in range(2)]
    sens = {s.layer: s for s in dqi.sensitivity(p, ev)}
    with torch.no_grad():
        ref = [model(x) for x in ev]
    for layer in ("fc1", "fc2", "fc3"):
        others = dq.Override(pattern=f"^(?!{layer}$)", skip=True)
        only = dq.convert(dq.prepare(model, (cal[0],), qconfig(overrides=(others,))))
        with torch.no_grad():
            m = dqi.compare(ref, [only(x) for x in ev])
        assert (sens[layer].cosine, sens[layer].sqnr_db) == (m.cosine, m.sqnr_db)  # the same bits
        assert math.isfinite(m.sqnr_db)
    res = dqi.auto_fallback(p, ev, target=min(s.cosine for s in sens.values()) + 1e-9)
    assert res.met and res.fallback  # something must go back to high precision to beat the worst single layer


def test_scaling_an_mx_layer_to_per_token_per_channel_is_that_model():
    model, p, cal = _prepared(dq.QConfig.mxfp8())
    x = cal[0]
    cfg = ("s:\n  layers: {name_regex: fc}\n"
           "  features: {Scaling: {input_granularity: token, weight_granularity: channel}}\n")
    with dqi.session(p, cfg):
        y = p(x)
    per_token = dq.QConfig(activation=dq.TensorQConfig(granularity="token"), dynamic=True)
    want = dq.convert(dq.prepare(model, (cal[0],), per_token))(x)
    assert torch.equal(y, want)


@pytest.mark.parametrize(("scheme", "scaling", "words"), [
    ("weight_only", "{input_format: E5M2}", r"line 1: section 's'.*'fc1'.*weight-only.*input is not quantized"),
    ("weight_only", "{input_granularity: token}", r"'fc1'.*weight-only"),
    ("mxfp8", "{weight_granularity: channel}", r"'fc1'.*MXFP8.*the input would stay MX.*set both"),
    ("mxfp8", "{input_granularity: token}", r"'fc1'.*MXFP8.*the weight would stay MX"),
])
def test_scaling_no_gemm_computes_is_a_config_error(scheme, scaling, words):
    _, p, cal = _prepared(dq.QConfig.mxfp8() if scheme == "mxfp8" else dq.QConfig.fp8_weight_only())
    with pytest.raises(dqi.InspectConfigError, match=words):
        with dqi.session(p, "s:\n  layers: {name_regex: fc1}\n  features: {Scaling: " + scaling + "}\n"):
            pass
    # the format alone is fine: weight-only weights in E5M2, MX on both operands in E5M2
    other = "{weight_format: E5M2}" if scheme == "weight_only" else "{input_format: E5M2, weight_format: E5M2}"
    with dqi.session(p, "s:\n  layers: {name_regex: fc1}\n  features:\n    Scaling: " + other + "\n"
                     "    LogFP8Stats: {tensors: [weight]}\n") as s:
        p(cal[0])
    assert _values(s, "fc1", "weight")["sqnr_db"] < 30  # E5M2: 2 mantissa bits
