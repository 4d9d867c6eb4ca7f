"""calibrate() and convert(): scales, FP8 weights, configuration, errors, saving and loading."""

import io

import pytest
import torch
from torch import nn

import dbr_quant as dq
from dbr_quant.formats import FP8Format
from dbr_quant.quantize.weights import fp8_weight_bytes


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(x) + x)


def make(qconfig=None, batches=None):
    m = Net().eval()
    x = torch.randn(8, 16)
    p = dq.prepare(m, (x,), qconfig)
    if batches is not False:
        dq.calibrate(p, batches or [torch.randn(8, 16) for _ in range(3)], progress=False)
    return m, p, x


def test_convert_before_calibration_lists_every_uncalibrated_tensor():
    m, p, x = make(batches=False)
    with pytest.raises(dq.UncalibratedError) as err:
        dq.convert(p)
    msg = str(err.value)
    assert "3 activation(s)" in msg and "block.0" in msg and "head" in msg and "calibrate" in msg
    dq.calibrate(p, [x], progress=False)
    assert dq.convert(p) is not p


def test_dynamic_mode_needs_no_calibration(close_to_reference):
    for granularity in ("tensor", "token"):
        qc = dq.QConfig(dynamic=True, activation=dq.TensorQConfig(granularity=granularity))
        m, p, x = make(qc, batches=False)
        c = dq.convert(p)
        close_to_reference(c(x), m(x), min_cos=0.998, max_rel=0.07)
        assert len(dq.quant_state(c).observers) == 0


def test_weights_become_fp8_and_the_fp32_weights_are_dropped():
    m, p, x = make()
    c = dq.convert(p)
    fc = c.block[0]
    assert fc.weight.qdata.dtype == torch.float8_e4m3fn and fc.weight.dtype == torch.float32
    assert fc.weight.scale.shape == (32,) and fc.weight.scale.dtype == torch.float32
    w = m.block[0].weight.detach()
    scale = w.abs().amax(1) / 448.0  # per output channel: the largest |w| of each row lands on E4M3's max
    assert torch.equal(fc.weight.scale, scale)
    # torch's own cast of the fp32 w·(1/scale) (the README's stated arithmetic), not the library's quantize
    want = (w * torch.reciprocal(scale[:, None])).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(fc.weight.qdata.view(torch.uint8), want.view(torch.uint8))
    fp32_bytes = sum(mod.weight.numel() * 4 for mod in m.modules() if isinstance(mod, nn.Linear))
    fp8_bytes = fp8_weight_bytes(c)
    assert fp8_bytes / fp32_bytes < 0.3
    assert "weight" in m.block[0]._parameters, "the user's model keeps its weights"


def test_activation_scales_come_from_the_observers():
    m, p, x = make(batches=[torch.ones(8, 16) * 4.48])
    c = dq.convert(p)
    st = dq.quant_state(c.block)
    first = st.seen_ops[0]
    assert st.scale(first, "input").item() == pytest.approx(4.48 / 448)
    assert st.observers["0_input"].amax.item() == pytest.approx(4.48)


def test_overrides_by_regex_and_type_and_e5m2(close_to_reference):
    qc = dq.QConfig(overrides=(
        dq.Override(pattern=r"^head$", skip=True),
        dq.Override(module_type=nn.Sequential, activation=dq.TensorQConfig(format="e5m2",
                                                                           observer=dq.Percentile(99.0))),
    ))
    m, p, x = make(qc)
    st = dq.quant_state(p.block)
    assert all(op.qconfig.activation.format is FP8Format.E5M2 for op in st.seen_ops)
    assert type(st.observers["0_input"]).__name__ == "PercentileObserver"
    c = dq.convert(p)
    rows = {r["fqn"]: r for r in dq.report(c)}
    assert not rows["head"]["fp8"] and rows["block.0"]["fp8"]
    assert "weight" in c.head._parameters
    close_to_reference(c(x), m(x), min_cos=0.99, max_rel=0.04)


def test_qconfig_validation_messages():
    with pytest.raises(ValueError, match="dynamic=True"):
        dq.QConfig(activation=dq.TensorQConfig(granularity="token"))
    with pytest.raises(ValueError, match="valid regex"):
        dq.Override(pattern="(", skip=True)
    with pytest.raises(ValueError, match="pattern .* or a module_type"):
        dq.Override(skip=True)
    with pytest.raises(ValueError, match="unknown FP8 format"):
        dq.TensorQConfig(format="e3m4")
    with pytest.raises(TypeError, match="QConfig"):
        dq.prepare(Net(), (torch.randn(2, 16),), {"dynamic": True})


def test_phase_errors_are_explicit():
    m, p, x = make()
    with pytest.raises(TypeError, match="prepare"):
        dq.calibrate(m, [x])
    c = dq.convert(p)
    with pytest.raises(RuntimeError, match="needs a prepared model, but this one is converted"):
        dq.convert(c)
    with pytest.raises(RuntimeError, match="already prepared"):
        dq.prepare(p, (x,))
    with pytest.raises(TypeError, match="batch 0 is a str"):
        dq.calibrate(p, ["not a batch"], progress=False)


def test_calibrate_accepts_tensors_tuples_dicts_and_stops_at_num_batches():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, y=None):
            return self.fc(x if y is None else x + y)

    p = dq.prepare(KW().eval(), (torch.randn(2, 4),))
    obs = dq.quant_state(p).observers["0_input"]
    dq.calibrate(p, [torch.ones(2, 4), (torch.ones(2, 4) * 2,), {"x": torch.ones(2, 4), "y": torch.ones(2, 4) * 2}],
                 progress=False)
    assert obs.amax.item() == 3.0 and obs.num_updates.item() == 3
    dq.calibrate(p, (torch.ones(1, 4) * k for k in range(10, 20)), num_batches=2, progress=False)
    assert obs.amax.item() == 11.0 and obs.num_updates.item() == 5


def test_disabled_runs_the_original_high_precision_path():
    m, p, x = make()
    c = dq.convert(p)
    with dq.disabled():
        assert torch.equal(p(x), m(x))  # prepared: bit-identical to the original
        hp = c(x)  # converted: FP8-stored weights, high-precision compute
    obs_before = dq.quant_state(p.block).observers["0_input"].num_updates.item()
    with dq.disabled():
        p(x)
    assert dq.quant_state(p.block).observers["0_input"].num_updates.item() == obs_before, "no calibration"
    assert (hp - m(x)).abs().max() < 0.1 and not torch.equal(hp, c(x))


def test_state_dict_round_trip_reproduces_outputs_exactly():
    m, p, x = make()
    c = dq.convert(p)
    sd = c.state_dict()
    assert sd["block.0.weight"].dtype == torch.float8_e4m3fn and sd["block.0.weight_scale"].shape == (32,)
    assert "block._auto_quant_state.scale_0_input" in sd, "container states save through hooks"
    assert "block._auto_quant_state.observers.0_input.amax" in sd and "_auto_quant_state.scale_0_input" in sd
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    # a fresh skeleton calibrated on other data: loading must overwrite every scale and weight
    _, p2, _ = make(batches=[torch.randn(8, 16) * 10])
    c2 = dq.convert(p2)
    assert not torch.equal(c2(x), c(x))
    missing, unexpected = c2.load_state_dict(torch.load(buf))
    assert not missing and not unexpected
    assert torch.equal(c2(x), c(x))


def test_sequential_root_saves_and_loads_its_hidden_state():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    x = torch.randn(4, 8)
    p = dq.prepare(m, (x,))
    dq.calibrate(p, [x], progress=False)
    c = dq.convert(p)
    p2 = dq.prepare(m, (x,))
    dq.calibrate(p2, [x * 5], progress=False)
    c2 = dq.convert(p2)
    c2.load_state_dict(c.state_dict())
    assert torch.equal(c2(x), c(x))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        c2.load_state_dict({**c.state_dict(), "_auto_quant_state.bogus": torch.zeros(1)})


def test_converted_outputs_are_close_to_fp32_on_a_deeper_model(close_to_reference):
    layers = []
    for _ in range(4):
        layers += [nn.LayerNorm(64), nn.Linear(64, 256), nn.SiLU(), nn.Linear(256, 64)]
    m = nn.Sequential(*layers).eval()
    x = torch.randn(32, 64)
    p = dq.prepare(m, (x,))
    dq.calibrate(p, [torch.randn(32, 64) for _ in range(4)], progress=False)
    c = dq.convert(p)
    out, ref = c(x), m(x)
    # 8 FP8 linears in a row without residuals: measured 0.9947; E4M3 rounds each by up to 2**-4
    close_to_reference(out, ref, min_cos=0.99, max_rel=0.15)
    assert out.dtype == torch.float32


def test_weight_observer_from_the_qconfig_is_used():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64)).eval()
    with torch.no_grad():
        m[0].weight[:, 0] = 50.0  # one outlier column, which a percentile observer clips
    x = torch.randn(4, 64)
    scales = {}
    for name, obs in (("max", dq.RunningMax()), ("pct", dq.Percentile(95.0))):
        qc = dq.QConfig(weight=dq.TensorQConfig(granularity="channel", observer=obs))
        p = dq.prepare(m, (x,), qc)
        dq.calibrate(p, [x], progress=False)
        scales[name] = dq.convert(p)[0].weight.scale
    assert torch.allclose(scales["max"], torch.full((64,), 50.0 / 448))
    assert (scales["pct"] < scales["max"] / 10).all()


class EncoderDecoder(nn.Module):
    """generate() of an encoder-decoder (T5, Whisper, BART) calls ``model.get_encoder()(...)`` on its own,
    then the root with ``encoder_out=``: a submodule called from outside the root's forward."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.decoder = nn.Linear(16, 4)

    def forward(self, x, encoder_out=None):
        if encoder_out is None:
            encoder_out = self.encoder(x)
        return self.decoder(encoder_out), encoder_out


def test_a_submodule_called_on_its_own_runs_in_its_phase():
    m = EncoderDecoder().eval()
    x = torch.randn(8, 16)
    p = dq.prepare(m, (x,))
    enc_observers = [o for st in (dq.quant_state(p.encoder),) for o in st.observers.values()]
    before = [o.amax.clone() for o in enc_observers]
    with torch.no_grad():
        p.encoder(torch.randn(8, 16) * 10)  # a direct call of a prepared submodule calibrates too
    assert all(not torch.equal(o.amax, b) for o, b in zip(enc_observers, before))
    dq.calibrate(p, [torch.randn(8, 16) for _ in range(3)], progress=False)
    c = dq.convert(p)
    with torch.no_grad():
        want_logits, want_enc = c(x)
        with dq.kernels.count_launches() as counts:
            enc = c.encoder(x)  # FP8, not the stock forward on missing (or dequantized) weights
        assert dict(counts) == {"quantize": 1, "fp8_linear": 2}
        assert torch.equal(enc, want_enc)
        assert torch.equal(c(x, encoder_out=enc)[0], want_logits)
        with dq.disabled():
            hp = c.encoder(x)
    assert not torch.equal(hp, enc) and torch.allclose(hp, m.encoder(x), atol=0.1)
    assert not any("forward" in mod.__dict__ for mod in m.modules()), "the original model was touched"
