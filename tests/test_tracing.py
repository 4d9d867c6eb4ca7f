"""prepare() on toy models: what gets recorded, and that user code sees no difference."""

import collections
import copy
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
from dbr_quant.ops.tags import fqn_of
from dbr_quant.quantize.weights import fp8_weight_of
from dbr_quant.runtime.interception import is_patched


def roundtrip(model, *args, qconfig=None, calib=None, **kwargs):
    """prepare → calibrate (on the example unless given) → convert."""
    p = dq.prepare(model, args, qconfig, example_kwargs=kwargs)
    dq.calibrate(p, calib or [args if not kwargs else kwargs], progress=False)
    return p, dq.convert(p)


def fp8_ops(model):
    return [r["fqn"] for r in dq.report(model) if r["fp8"]]


class TwoLinear(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 32), nn.Linear(32, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def close(a, b, cos=0.995):
    return F.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item() > cos


def test_state_attached_to_non_leaf_modules_and_printable():
    m = nn.Sequential(TwoLinear(), nn.ReLU(), TwoLinear()).eval()
    p = dq.prepare(m, (torch.randn(3, 16),))
    for child in (p[0], p[2]):
        st = dq.quant_state(child)
        assert isinstance(st, dq.AutoQuantizationState)
        assert [op.fqn for op in st.seen_ops] == [f"{fqn_of(child)}.fc1", f"{fqn_of(child)}.fc2"]
    assert dq.quant_state(p[0].fc1) is None  # leaves get no state
    text = str(p[0]._auto_quant_state)
    assert "linear 0.fc1 [Linear]" in text and "float32[3, 16]" in text and "fusion=mlp#" in text
    assert not hasattr(m[0], "_auto_quant_state"), "the user's model was modified"


class IterSeq(nn.Sequential):
    """A Sequential subclass whose forward iterates self and uses len()."""

    def forward(self, x):
        assert len(self) == 3
        for i, layer in enumerate(self):
            x = layer(x) if i != 1 else layer(x) * 1.0
        return x


class ListLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 2), "b": nn.Linear(8, 2)})

    def forward(self, x):
        assert len(self.layers) == 3 and len(list(self.layers.children())) == 3
        for layer in self.layers:
            x = F.gelu(layer(x))
        return {k: head(x) for k, head in self.heads.items()}


def test_containers_iterate_and_len_as_before():
    seq = IterSeq(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    x = torch.randn(4, 8)
    p, c = roundtrip(seq, x)
    assert len(p) == len(c) == 3 and [type(m) for m in c] == [nn.Linear, nn.GELU, nn.Linear]
    assert dq.quant_state(c) is not None and "_auto_quant_state" not in c._modules
    assert close(c(x), seq(x))
    loop = ListLoop().eval()
    p, c = roundtrip(loop, x)
    out = c(x)
    assert set(out) == {"a", "b"} and close(out["a"], loop(x)["a"])
    assert len(fp8_ops(c)) == 5


class KwargsDict(nn.Module):
    Pair = collections.namedtuple("Pair", "first second")

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)

    def forward(self, x, *, scale=1.0, mask=None):
        h = self.enc(x) * scale
        if mask is not None:
            h = h.masked_fill(~mask, 0.0)
        return {"h": h, "pair": self.Pair(h.sum(-1), [h.mean()]), "tuple": (h, h + 1)}


def test_kwargs_inputs_and_nested_outputs_stay_high_precision():
    m = KwargsDict().eval()
    x, mask = torch.randn(2, 8), torch.rand(2, 8) > 0.3
    p = dq.prepare(m, (x,), example_kwargs={"scale": 2.0, "mask": mask})
    with torch.no_grad():
        p(x * 2, scale=2.0, mask=mask)  # any forward of a prepared model calibrates
    c = dq.convert(p)
    out, ref = c(x, scale=2.0, mask=mask), m(x, scale=2.0, mask=mask)
    assert isinstance(out["pair"], KwargsDict.Pair) and isinstance(out["pair"].second, list)
    for got, want in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref)):
        assert got.dtype == torch.float32 and got.device.type == "cpu" and got.shape == want.shape
    assert close(out["h"], ref["h"])


class CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)

    def forward(self, x):
        return self.shared(self.shared(x) * 100.0)


def test_module_called_twice_keeps_one_scale_per_call():
    m = CalledTwice().eval()
    x = torch.randn(4, 8)
    p, c = roundtrip(m, x)
    st = dq.quant_state(c)
    assert [op.fqn for op in st.seen_ops] == ["shared", "shared"]
    s0, s1 = (st.scale(op, "input") for op in st.seen_ops)
    assert s1 / s0 > 10, "the second call sees 100x larger inputs and must have its own scale"
    assert c.shared.weight.qdata.dtype == torch.float8_e4m3fn  # one FP8 weight for both calls
    assert close(c(x), m(x))


class MakesModulesAndWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        torch.manual_seed(1)
        fresh = nn.Linear(8, 8)  # created inside forward: a new module every call
        w = self.base * 2 + 1  # a weight computed in forward
        return F.linear(fresh(x), w).relu_()  # in-place on the linear's output


def test_modules_created_in_forward_computed_weights_and_inplace_ops():
    m = MakesModulesAndWeights().eval()
    x = torch.randn(3, 8)
    p, c = roundtrip(m, x)
    rows = dq.report(c)
    assert [(r["fqn"], r["fp8"]) for r in rows] == [("linear", True), ("linear", True), ("base", False)]
    assert rows[2]["reason"].startswith("read by linear, which runs in FP8 quantizing this weight on every call")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must match the trace: no unseen-op warning
        assert close(c(x), m(x))


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, ids):
        counts = torch.bincount(ids.flatten(), minlength=50)  # integer ops pass through
        return self.proj(self.emb(ids)) + counts[:16].float()


def test_integer_inputs_and_embeddings_are_not_quantized():
    m = Embedder().eval()
    ids = torch.randint(0, 50, (2, 5))
    p, c = roundtrip(m, ids)
    assert fp8_ops(c) == ["proj"]
    assert c.emb.weight.dtype == torch.float32
    assert close(c(ids), m(ids))


def test_no_grad_inference_mode_and_new_shapes_after_convert():
    m = TwoLinear().eval()
    p, c = roundtrip(m, torch.randn(2, 16))
    for shape in [(1, 16), (7, 3, 16), (64, 16)]:
        x = torch.randn(shape)
        with torch.inference_mode():
            a = c(x)
        with torch.no_grad():
            b = c(x)
        assert a.shape == shape and torch.equal(a, b) and close(a, m(x))


def test_deepcopy_of_prepared_and_converted_models():
    m = TwoLinear().eval()
    x = torch.randn(4, 16)
    p, c = roundtrip(m, x)
    p2, c2 = copy.deepcopy(p), copy.deepcopy(c)
    assert torch.equal(c2(x), c(x))
    dq.calibrate(p2, [x * 3], progress=False)  # the copy calibrates independently
    assert not torch.equal(dq.convert(p2)(x), c(x))
    assert dq.quant_state(p).observers["0_input"].amax < dq.quant_state(p2).observers["0_input"].amax


def test_hooks_see_real_tensors_and_block_fusion():
    m = TwoLinear().eval()
    x = torch.randn(4, 16)
    seen = []
    m.fc1.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    p, c = roundtrip(m, x)
    assert all(r["fusion"] is None for r in dq.report(c)), "no subgraph may span a hooked module"
    seen.clear()
    out = c(x)
    (inp, hooked_out), = seen
    assert inp.device.type == "cpu" and hooked_out.device.type == "cpu" and hooked_out.shape == (4, 32)
    assert close(out, m(x))


def test_hook_added_after_convert_disables_the_fusion_it_crosses():
    m = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    x = torch.randn(4, 8)
    p, c = roundtrip(m, x)
    assert {r["fusion"] for r in dq.report(c)} == {"mlp"}
    ref = c(x)
    seen = []
    c[1].register_forward_hook(lambda mod, args, out: seen.append(out))
    out = c(x)
    assert seen and seen[0].device.type == "cpu" and seen[0].shape == (4, 8)
    assert torch.equal(out, ref), "materializing the subgraph op by op must give the same numbers"


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_b=False):
        x = self.a(x)
        if use_b:
            x = self.b(x) @ x.t()
        return x


def test_control_flow_unseen_ops_warn_once_and_run_high_precision():
    m = Branchy().eval()
    x = torch.randn(4, 8)
    p, c = roundtrip(m, x)
    with pytest.warns(UserWarning, match=r"module '<root>' ran op 'linear' \(b\)"):
        out = c(x, use_b=True)
    assert torch.allclose(out, Branchy.forward(m, x, use_b=True), atol=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c(x, use_b=True)  # warned once already
    # the traced path still runs in FP8: c.a's weight is float8 and the output is an FP8 emulation built from
    # torch casts (scales from the calibration batch, x itself), not the fp32 linear
    assert c.a.weight.qdata.dtype == torch.float8_e4m3fn
    w, sw, sx = m.a.weight.detach(), m.a.weight.detach().abs().amax(1) / 448, x.abs().amax() / 448
    x_q, w_q = (x / sx).to(torch.float8_e4m3fn), (w / sw[:, None]).to(torch.float8_e4m3fn)
    emulated = F.linear(x_q.double() * sx.double(), w_q.double() * sw.double()[:, None], m.a.bias.double())
    with torch.no_grad():
        out, fp32 = c(x), m.a(x)
    assert torch.allclose(out.double(), emulated, rtol=1e-6, atol=1e-6)
    assert (out - fp32).abs().max() > 1e-3  # FP8 rounding is visible: this is not the fp32 linear


def test_strict_mode_raises_a_named_error():
    m = Branchy().eval()
    x = torch.randn(4, 8)
    p, c = roundtrip(m, x, qconfig=dq.QConfig(strict=True))
    with pytest.raises(dq.UnseenOpError, match="linear.*'b'|\\(b\\)"):
        c(x, use_b=True)
    assert not is_patched()


class Boom(nn.Module):
    def __init__(self, exc):
        super().__init__()
        self.fc, self.exc = nn.Linear(4, 4), exc

    def forward(self, x, fail=False):
        x = self.fc(x)
        if fail:
            raise self.exc
        return x


@pytest.mark.parametrize("exc", [ValueError("bad"), KeyboardInterrupt()])
def test_global_state_restored_when_forward_raises(exc):
    m = Boom(exc).eval()
    x = torch.randn(2, 4)
    p, c = roundtrip(m, x)
    for model in (p, c):
        with pytest.raises(type(exc)):
            model(x, fail=True)
        assert not is_patched() and torch._C._len_torch_function_stack() == 0
        assert model(x).shape == (2, 4)


def test_prepare_error_names_the_module_and_keeps_the_model():
    m = Boom(RuntimeError("shape mismatch in user code")).eval()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(dq.PrepareError, match="RuntimeError.*shape mismatch"):
        dq.prepare(m, (torch.randn(2, 4),), example_kwargs={"fail": True})
    with pytest.raises(dq.PrepareError, match="in module fc"):
        dq.prepare(m, (torch.randn(2, 5),))
    assert "_dbr_record" not in m.__dict__ and all(torch.equal(v, m.state_dict()[k]) for k, v in state.items())
    # inplace=True cleans up after itself too
    with pytest.raises(dq.PrepareError):
        dq.prepare(m, (torch.randn(2, 5),), inplace=True)
    assert "_dbr_record" not in m.__dict__ and "forward" not in m.__dict__


def test_inplace_prepare_modifies_and_returns_the_same_model():
    m = TwoLinear().eval()
    p = dq.prepare(m, (torch.randn(2, 16),), inplace=True)
    assert p is m and dq.quant_state(m) is not None


def test_other_threads_are_not_intercepted_while_a_prepared_model_runs():
    plain = TwoLinear().eval()
    x = torch.randn(4, 16)
    want = plain(x)
    inside, release = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        armed = False

        def forward(self, x):
            if self.armed:
                inside.set()
                assert release.wait(10)
            return self.fc(x)

    prepared = dq.prepare(Waits().eval(), (x,))
    prepared.armed = True
    results = {}

    def other():
        try:
            assert inside.wait(10)
            assert is_patched()  # the prepared model is mid-forward in the main thread
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                results["out"] = plain(x)
            results["warnings"] = w
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread below
            results["error"] = e
        finally:
            release.set()  # never leave the main thread's forward waiting

    t = threading.Thread(target=other)
    t.start()
    prepared(x)
    t.join()
    if "error" in results:
        raise results["error"]
    assert torch.equal(results["out"], want) and not results["warnings"]
    assert len(dq.quant_state(prepared).seen_ops) == 1
    assert not is_patched()


def test_report_lists_high_precision_ops_with_reasons():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    qc = dq.QConfig(overrides=(dq.Override(pattern=r"^2$", skip=True),))
    p, c = roundtrip(m, torch.randn(2, 8), qconfig=qc)
    rows = {r["fqn"]: r for r in dq.report(c)}
    assert rows["0"]["fp8"] and not rows["2"]["fp8"] and "Override(pattern='^2$', skip=True)" in rows["2"]["reason"]
    assert fp8_weight_of(c[2]) is None and fp8_weight_of(c[0]) is not None
    table = dq.format_report(dq.report(c))
    assert table.splitlines()[1].startswith("2 ")  # high-precision rows first


def test_prepare_warns_when_nothing_is_quantizeable():
    with pytest.warns(UserWarning, match="no quantizeable op"):
        dq.prepare(nn.Sequential(nn.ReLU()), (torch.randn(2),))


def test_prepare_error_names_a_nested_module():
    m = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 5))).eval()
    with pytest.raises(dq.PrepareError, match=r"in module 0 > 0\.1"):
        dq.prepare(m, (torch.randn(2, 4),))


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(4))
        self.q = nn.Linear(8, 8)

    def forward(self, x, positions):
        freqs = self.inv_freq[:, None].float() @ positions[None, :].float()  # buffer × integer positions
        h = self.q(x)
        return torch.softmax(h @ h.transpose(-1, -2), -1) + freqs.sum()  # activation × activation, attention


def test_only_matmuls_between_two_activations_are_quantized():
    m = Rotary().eval()
    x, pos = torch.randn(4, 8), torch.arange(6)
    p = dq.prepare(m, (x, pos), dq.QConfig(quantize_attention=True))
    rows = dq.report(p)
    assert [(r["kind"], r["fp8"]) for r in rows] == [("matmul", False), ("linear", True), ("matmul", True)]
    assert "not an activation" in rows[0]["reason"]


class Products(nn.Module):
    """Matmuls between two activations: softmax attention, and products no softmax touches (a bilinear score,
    linear attention's chunked q·kᵀ·v, which a recurrent decode step computes without a matmul)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        attn = torch.softmax((q @ k.transpose(-1, -2)) * 0.35 + 0.0, dim=-1).to(x.dtype) @ v
        linear_attn = ((q @ k.transpose(-1, -2)).tril() @ v).sigmoid()
        return attn + linear_attn


def test_quantize_attention_quantizes_softmax_attention_only():
    p = dq.prepare(Products().eval(), (torch.randn(2, 5, 8),), dq.QConfig(quantize_attention=True))
    rows = [r for r in dq.report(p) if r["kind"] == "matmul"]
    assert [r["fp8"] for r in rows] == [True, True, False, False]
    assert all("outside softmax attention" in r["reason"] for r in rows[2:])
    # nothing observes the two kept high precision: calibration and convert ignore them
    state = dq.quant_state(p)
    kept = [op.index for op in state.seen_ops if op.kind == "matmul" and not op.quantize]
    assert len(kept) == 2 and not any(k.split("_")[0] in map(str, kept) for k in state.observers)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        p(x)
        c = dq.convert(p)
        assert torch.nn.functional.cosine_similarity(c(x).flatten(), Products.forward(p, x).flatten(), 0) > 0.99
