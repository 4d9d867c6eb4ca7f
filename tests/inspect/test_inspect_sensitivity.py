"""Sensitivity ranking, FLOP arithmetic and auto_fallback (toy models, and the real MiniLM: slow)."""

import math

import pytest
import torch
import torch.nn.functional as F
from inspect_toys import MLP, batches

import dbr_quant as dq
import dbr_quant.inspect as dqi

PER_TENSOR = dq.QConfig(weight=dq.TensorQConfig(granularity="tensor"))


def _cast(x, scale):
    return (x.double() / scale.double()).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale.double()


@pytest.fixture
def outlier():
    """fc2 gets one huge weight; with per-tensor weight scales the rest of fc2 underflows in FP8. The weight
    reads an input channel that fc1 keeps at zero, so it does not change the model's activations."""
    torch.manual_seed(0)
    model = MLP().eval()
    with torch.no_grad():
        model.fc1.weight[5] = 0.0
        model.fc1.bias[5] = -1.0  # relu → channel 5 of fc2's input is always 0
        model.fc2.weight[3, 5] = 1e4
    cal = batches(4)
    p = dq.prepare(model, (cal[0],), PER_TENSOR)
    dq.calibrate(p, cal, progress=False)
    return model, p, cal


def _cos(a, b):
    return F.cosine_similarity(a.double(), b.double(), dim=-1).mean().item()


def test_sensitive_layer_comes_first(outlier):
    model, p, cal = outlier
    ev = [torch.randn(8, 16) for _ in range(2)]
    sens = dqi.sensitivity(p, ev)
    assert [s.layer for s in sens][0] == "fc2"
    assert sens[0].sqnr_db < sens[1].sqnr_db - 6
    assert [s.sqnr_db for s in sens] == sorted(s.sqnr_db for s in sens)
    assert sorted(s.layer for s in sens) == ["fc1", "fc2", "fc3"]
    # independent fp64 emulation of "only fc2 in FP8"
    st = p._auto_quant_state
    op = next(o for o in st.seen_ops if o.fqn == "fc2")
    s_in = st.observers[f"{op.index}_input"].scale()
    w = model.fc2.weight.detach()
    ref, emu = [], []
    for x in ev:
        h = F.relu(model.fc1(x)).double()
        h2 = F.relu(F.linear(_cast(h, s_in), _cast(w, w.abs().max() / 448), model.fc2.bias.double()))
        emu.append(F.linear(h2, model.fc3.weight.double(), model.fc3.bias.double()))
        ref.append(model(x).double())
    ref, emu = torch.cat(ref), torch.cat(emu)
    sq = 10 * math.log10(ref.pow(2).sum().item() / (emu - ref).pow(2).sum().item())
    assert sens[0].sqnr_db == pytest.approx(sq, abs=0.3)
    assert sens[0].cosine == pytest.approx(_cos(emu, ref), abs=1e-3)
    by_cos = dqi.sensitivity(p, ev, by="cosine")
    assert by_cos[0].layer == "fc2" and [s.cosine for s in by_cos] == sorted(s.cosine for s in by_cos)
    assert p._dbr_record.inspector is None


def test_flops_by_hand(mlp_prepared, attn_prepared):
    _, p = mlp_prepared  # traced with x (8, 16): fc1 16→32, fc2 32→32, fc3 32→8
    flops = {op.fqn: dqi.op_flops(op) for op in p._auto_quant_state.seen_ops if op.kind == "linear"}
    assert flops == {"fc1": 2 * 8 * 16 * 32, "fc2": 2 * 8 * 32 * 32, "fc3": 2 * 8 * 32 * 8}
    assert dqi.fp8_flop_fraction(p) == 1.0
    assert dqi.fp8_flop_fraction(p, ["fc2"]) == pytest.approx((8192 + 4096) / 28672)
    assert dqi.fp8_flop_fraction(p, ["fc1", "fc3"]) == pytest.approx(16384 / 28672)
    _, a = attn_prepared  # x (2, 6, 16): q·kᵀ (2,6,16)@(2,16,6), p·v (2,6,6)@(2,6,16), sdpa on (2,1,6,16)
    ops = {n: dqi.op_flops(op) for n, op in dqi.named_ops(a) if op.kind in ("matmul", "sdpa")}
    assert set(ops) == {"matmul", "matmul#1", "sdpa"} and set(dqi.recorded_layers(a)) >= set(ops)
    assert sorted(ops.values()) == [2 * 2 * 6 * 6 * 16, 2 * 2 * 6 * 16 * 6, 2 * (2 * 1 * 6) * 6 * (16 + 16)]
    # a linear prepare() already skips counts in the denominator only
    torch.manual_seed(0)
    skip = dq.prepare(MLP().eval(), (torch.randn(8, 16),), dq.QConfig(overrides=(dq.Override("^fc3$", skip=True),)))
    assert dqi.fp8_flop_fraction(skip) == pytest.approx(24576 / 28672)


def test_auto_fallback_toy(outlier):
    model, p, cal = outlier
    ev = [torch.randn(8, 16) for _ in range(2)]
    res = dqi.auto_fallback(p, ev, target=0.9999)
    assert res.met and res.cosine >= 0.9999 and "fc2" in res.fallback
    assert res.curve[0].n_fallback == 0 and res.curve[0].fp8_flop_fraction == 1.0
    assert res.curve[-1].cosine == pytest.approx(1.0, abs=1e-12) and res.curve[-1].fp8_flop_fraction == 0.0
    assert res.curve[0].cosine < 0.9999  # all-FP8 misses the target
    assert res.fp8_flop_fraction == pytest.approx(dqi.fp8_flop_fraction(p, res.fallback))
    assert res.evaluations >= 3 + 2
    # apply: re-prepare with the suggested QConfig, calibrate the same way, convert: same quality
    p2 = dq.prepare(model, (cal[0],), res.qconfig())
    assert {r["fqn"] for r in dq.report(p2) if not r["fp8"]} == set(res.fallback)
    dq.calibrate(p2, cal, progress=False)
    c2 = dq.convert(p2)
    with torch.no_grad():
        got = torch.cat([c2(x) for x in ev])
        ref = torch.cat([model(x) for x in ev])
    assert _cos(got, ref) == pytest.approx(res.cosine, abs=1e-6)
    # the same selection as an inspect config
    with dqi.session(p, res.to_yaml()):
        with torch.no_grad():
            emu = torch.cat([p(x) for x in ev])
    assert _cos(emu, ref) == pytest.approx(res.cosine, abs=1e-9)
    s = res.summary()
    assert "met" in s and "fc2" in s


def test_auto_fallback_sqnr_and_unreachable(outlier):
    model, p, cal = outlier
    ev = [torch.randn(8, 16)]
    res = dqi.auto_fallback(p, ev, target=40.0, metric="sqnr_db", full_curve=False)
    assert res.met and res.sqnr_db >= 40.0 and len(res.curve) <= 4
    c = dq.convert(p)
    # converted with reference=: high-precision layers run with the reference's weights, all of them give fp32
    res2 = dqi.auto_fallback(c, ev, target=1.0, reference=model, full_curve=False, prune=False)
    assert res2.met and res2.sqnr_db == math.inf and len(res2.fallback) == 3
    res3 = dqi.auto_fallback(c, ev, target=1.5, reference=model)  # unreachable: the best point, not met
    assert not res3.met and res3.cosine == max(pt.cosine for pt in res3.curve)
    with pytest.raises(ValueError, match="metric"):
        dqi.auto_fallback(p, ev, target=1.0, metric="psnr")


def test_plots(outlier):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    _, p, _ = outlier
    ev = [torch.randn(8, 16)]
    res = dqi.auto_fallback(p, ev, target=0.9999)
    ax = dqi.plot_sensitivity(res.sensitivity)
    assert [t.get_text() for t in ax.get_yticklabels()][0] == res.sensitivity[0].layer
    ax2 = dqi.plot_tradeoff(res)
    assert len(ax2.lines) >= 3


@pytest.mark.slow
def test_auto_fallback_minilm():
    from dbr_quant.examples import minilm

    model, tok = minilm.load_minilm()
    cal = minilm.encode(tok, minilm.CALIBRATION_SENTENCES)
    ev = [minilm.encode(tok, minilm.EVAL_SENTENCES[:8])]
    p = dq.prepare(model, example_kwargs=cal)
    dq.calibrate(p, [cal], progress=False)
    res = dqi.auto_fallback(p, ev, target=0.9993, output_fn=minilm.sentence_embeddings, full_curve=False)
    assert res.met and res.cosine >= 0.9993
    assert res.curve[0].cosine < 0.9993  # all-FP8 alone does not reach it
    assert 0 < len(res.fallback) < 36 and 0.3 < res.fp8_flop_fraction < 1.0
    # applying the QConfig reproduces the measured quality with the real converted model
    p2 = dq.prepare(model, example_kwargs=cal, qconfig=res.qconfig())
    dq.calibrate(p2, [cal], progress=False)
    e_fp8 = minilm.sentence_embeddings(dq.convert(p2), ev[0])
    e_ref = minilm.sentence_embeddings(model, ev[0])
    assert (e_fp8 * e_ref).sum(-1).mean().item() >= 0.9993
