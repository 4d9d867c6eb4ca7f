"""Every registered fusion fires where it should, never where it must not, and equals its ops run one
by one (``QConfig(fuse=False)`` runs exactly that: each recorded op on its own)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dbr_quant as dq
from dbr_quant.ops.fusions import FUSIONS
from dbr_quant.quantize.weights import adjacent_rows

ACTS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class LinearAct(nn.Module):
    def __init__(self, d, act, bias=True):
        super().__init__()
        self.fc, self.act = nn.Linear(d, 2 * d, bias=bias), ACTS[act]

    def forward(self, x):
        return self.act(self.fc(x)) * 1.5  # the scalar mul keeps the act output out of any longer pattern


class LinearResidual(nn.Module):
    def __init__(self, d, act=None, bias=True):
        super().__init__()
        self.fc, self.drop = nn.Linear(d, d, bias=bias), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc(x))  # eval dropout is a passthrough inside the subgraph


class MLPBlock(nn.Module):
    def __init__(self, d, act, bias=True):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(d, 3 * d, bias=bias), nn.Linear(3 * d, d, bias=bias), ACTS[act]

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class NormMLP(nn.Module):
    def __init__(self, d, act, bias=True, rms=False):
        super().__init__()
        self.norm = nn.RMSNorm(d) if rms else nn.LayerNorm(d)
        self.fc1, self.fc2, self.act = nn.Linear(d, 2 * d, bias=bias), nn.Linear(2 * d, d, bias=bias), ACTS[act]

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Gated(nn.Module):
    def __init__(self, d, act, bias=False):
        super().__init__()
        self.gate, self.up = nn.Linear(d, 2 * d, bias=bias), nn.Linear(d, 2 * d, bias=bias)
        self.down, self.act = nn.Linear(2 * d, d, bias=bias), ACTS[act]

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    def __init__(self, d, act=None, bias=True, heads=2):
        super().__init__()
        self.qkv, self.heads = nn.Linear(d, 3 * d, bias=bias), heads

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).split(d, -1))
        scores = torch.matmul(q, k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        scores = scores + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return (probs @ v).transpose(1, 2).reshape(b, t, d)


class NormGated(nn.Module):
    """Llama's MLP block: RMSNorm → gate, up → silu(gate)·up → down, + residual."""

    def __init__(self, d, act="silu", bias=False):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=bias), nn.Linear(d, 2 * d, bias=bias)
        self.down, self.act = nn.Linear(2 * d, d, bias=bias), ACTS[act]

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(self.act(self.gate(h)) * self.up(h))


CASES = {
    "linear_act": LinearAct,
    "linear_residual": LinearResidual,
    "mlp": MLPBlock,
    "norm_linear": NormMLP,
    "gated_mlp": Gated,
    "norm_gated_mlp": NormGated,
    "attention": Attention,
}


def test_every_registered_fusion_has_a_case():
    assert {f.name for f in FUSIONS} == set(CASES)


def build(name, d, act, bias):
    return CASES[name](d, act if name != "attention" else None, bias=bias).eval()


def inputs(name, b, t, d):
    x = torch.randn(b, t, d) * 2
    if name == "attention":
        return (x, torch.where(torch.rand(b, 1, t, t) > 0.3, 0.0, -1e4))
    return (x,)


def convert_with(model, args, calib, fuse):
    qc = dq.QConfig(fuse=fuse, quantize_attention=True)
    p = dq.prepare(model, args, qc)
    dq.calibrate(p, calib, progress=False)
    return dq.convert(p)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(CASES)), d=st.sampled_from([4, 8, 12]), b=st.integers(1, 3),
       t=st.integers(1, 5), act=st.sampled_from(sorted(ACTS)), bias=st.booleans())
def test_fused_subgraph_equals_its_ops_one_by_one(name, d, b, t, act, bias, close_to_reference):
    model = build(name, d, act, bias)
    args = inputs(name, b, t, d)
    calib = [inputs(name, 4, 6, d) for _ in range(3)] + [args]  # enough data that new inputs rarely clip
    fused, single = convert_with(model, args, calib, True), convert_with(model, args, calib, False)
    fusions = {r["fusion"] for r in dq.report(fused)}
    assert name in fusions, f"{name} did not fire: {fusions}"
    assert {r["fusion"] for r in dq.report(single)} == {None}
    new = inputs(name, b + 1, t, d)  # another shape than the trace
    with torch.no_grad():
        a, c = fused(*new), single(*new)
        ref = model(*new)
    assert torch.equal(a, c)
    close_to_reference(a, ref, min_cos=0.95, max_rel=0.15)


def test_fusion_does_not_fire_when_the_intermediate_has_another_consumer():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            return F.gelu(h), h.sum()  # h is used twice: a fused gelu would hide it

    p = dq.prepare(Leaky().eval(), (torch.randn(2, 8),))
    assert dq.report(p)[0]["fusion"] is None


def test_fusion_does_not_fire_across_an_intermediate_returned_to_the_caller():
    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = F.relu(self.fc1(x))
            return self.fc2(h), h

    p = dq.prepare(Returns().eval(), (torch.randn(2, 8),))
    assert [r["fusion"] for r in dq.report(p)] == ["linear_act", None]


def test_subgraph_materializes_when_control_flow_leaves_the_pattern():
    class Switch(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, other=False):
            h = self.fc1(x)
            h = torch.tanh(h) if other else F.gelu(h)
            return self.fc2(h)

    m = Switch().eval()
    x = torch.randn(3, 8)
    c_fused = convert_with(m, (x,), [(x,)], True)
    c_single = convert_with(m, (x,), [(x,)], False)
    assert {r["fusion"] for r in dq.report(c_fused)} == {"mlp"}
    with torch.no_grad():
        got = c_fused(x, other=True)
        want = c_single(x, other=True)
    assert torch.equal(got, want)
    assert torch.allclose(got, m(x, other=True), atol=0.1)


def test_launch_counts_show_the_epilogue_fusion():
    m = LinearAct(8, "gelu").eval()
    x = torch.randn(2, 8)
    c = convert_with(m, (x,), [(x,)], True)
    with dq.kernels.count_launches() as counts:
        c(x)
    assert dict(counts) == {"fp8_linear": 1, "quantize": 1}  # weights were quantized once, by convert


def test_placeholders_never_escape_into_outputs():
    m = MLPBlock(8, "relu").eval()
    c = convert_with(m, (torch.randn(2, 8),), [(torch.randn(2, 8),)], True)
    out = c(torch.randn(5, 8))
    assert out.device.type == "cpu" and out.shape == (5, 8) and torch.isfinite(out).all()


@pytest.mark.parametrize("rms", [False, True])
def test_norm_fusion_covers_layer_norm_and_rms_norm(rms):
    m = NormMLP(8, "silu", rms=rms).eval()
    p = dq.prepare(m, (torch.randn(2, 8),))
    assert {r["fusion"] for r in dq.report(p)} == {"norm_linear"}


def test_train_mode_dropout_inside_a_subgraph_is_not_skipped():
    m = LinearResidual(8).eval()
    x = torch.randn(4, 8)
    c = convert_with(m, (x,), [(x,)], True)
    assert {r["fusion"] for r in dq.report(c)} == {"linear_residual"}
    c.train()
    c.drop.p = 0.9
    torch.manual_seed(3)
    out = c(x)
    c.eval()
    assert not torch.allclose(out, c(x)), "dropout must apply in train mode"


@pytest.mark.parametrize("rms", [False, True])
def test_norm_mlp_runs_in_three_launches_with_fp8_between_the_gemms(rms):
    m = NormMLP(8, "gelu", rms=rms).eval()
    x = torch.randn(3, 8)
    c = convert_with(m, (x,), [(x,)], True)
    single = convert_with(m, (x,), [(x,)], False)
    with dq.kernels.count_launches() as fused, torch.no_grad():
        out = c(x)
    with dq.kernels.count_launches() as unfused, torch.no_grad():
        want = single(x)
    assert dict(fused) == {"norm_quantize": 1, "fp8_linear": 2}  # was 4 launches + the norm op
    assert dict(unfused) == {"quantize": 2, "fp8_linear": 2}
    assert torch.equal(out, want)


def test_mlp_hands_fp8_from_fc1_to_fc2():
    m = MLPBlock(8, "silu").eval()
    x = torch.randn(3, 8)
    c = convert_with(m, (x,), [(x,)], True)
    with dq.kernels.count_launches() as counts, torch.no_grad():
        c(x)
    assert dict(counts) == {"quantize": 1, "fp8_linear": 2}




@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_gated_mlp_runs_in_three_launches_and_equals_one_by_one(act, bias, close_to_reference):
    m = NormGated(8, act, bias).eval()
    x = torch.randn(2, 3, 8)
    calib = [(torch.randn(2, 3, 8),) for _ in range(2)]
    c, single = convert_with(m, (x,), calib, True), convert_with(m, (x,), calib, False)
    assert {r["fusion"] for r in dq.report(c)} == {"norm_gated_mlp"}
    assert adjacent_rows(c.gate.weight.qdata, c.up.weight.qdata).shape == (32, 8)  # stacked [gate; up]
    with dq.kernels.count_launches() as counts, torch.no_grad():
        out = c(x)
    assert dict(counts) == {"norm_quantize": 1, "fp8_linear": 2}  # unfused FP8: 8 (see roofline)
    with torch.no_grad():
        assert torch.equal(out, single(x))
        with dq.disabled():  # the stacked weights still serve each projection on its own
            hp = c(x)
    close_to_reference(hp, m(x), min_cos=0.999, max_rel=0.01)
    state = c.state_dict()
    c2 = convert_with(m, (x,), calib, True)
    c2.load_state_dict(state)
    assert torch.equal(c2(x), out)


class HFStyleRMSNorm(nn.Module):
    """Llama's RMSNorm: elementwise ops in a module of its own, not F.rms_norm."""

    def __init__(self, d, one_plus=False):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.variance_epsilon, self.one_plus = 1e-6, one_plus

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1 + self.weight) if self.one_plus else self.weight) * h.to(x.dtype)  # Gemma: 1 + w


class HFGatedBlock(NormGated):
    def __init__(self, d, one_plus=False):
        super().__init__(d)
        self.norm = HFStyleRMSNorm(d, one_plus)


@pytest.mark.parametrize("one_plus", [False, True])
def test_hf_style_rms_norm_modules_head_the_mlp_fusion_only_when_they_compute_rms_norm(one_plus, close_to_reference):
    m = HFGatedBlock(8, one_plus).eval()
    x = torch.randn(2, 3, 8)
    c = convert_with(m, (x,), [(x,)], True)
    fusions = {r["fusion"] for r in dq.report(c)}
    with dq.kernels.count_launches() as counts, torch.no_grad():
        out = c(x)
    if one_plus:  # not F.rms_norm: the module runs as written, the MLP fuses without it
        assert fusions == {"gated_mlp"} and counts["norm_quantize"] == 0
    else:
        assert fusions == {"norm_gated_mlp"} and dict(counts) == {"norm_quantize": 1, "fp8_linear": 2}
    close_to_reference(out, m(x), min_cos=0.999, max_rel=0.03)


class ParallelResidual(nn.Module):
    """GPT-NeoX's block: ``mlp(norm(x)) + attn_out(x) + x``. The earlier linear (attention's output
    projection) takes the ``mlp + attn`` add as its residual, so that add is gone when the MLP's
    pattern reaches it: the MLP must still fuse, without its optional residual step."""

    def __init__(self, d=8):
        super().__init__()
        self.dense, self.norm = nn.Linear(d, d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        attn = self.dense(x)
        mlp = self.fc2(F.gelu(self.fc1(self.norm(x))))
        return mlp + attn + x


def test_a_pattern_whose_optional_tail_is_taken_still_fuses_without_it():
    m = ParallelResidual().eval()
    x = torch.randn(3, 5, 8)
    calib = [(torch.randn(3, 5, 8),) for _ in range(3)]
    fused, single = convert_with(m, (x,), calib, True), convert_with(m, (x,), calib, False)
    assert {r["fqn"]: r["fusion"] for r in dq.report(fused)} == {
        "dense": "linear_residual", "fc1": "norm_linear", "fc2": "norm_linear"}
    new = torch.randn(2, 7, 8)
    with dq.kernels.count_launches() as counts, torch.no_grad():
        out = fused(new)
    assert dict(counts) == {"quantize": 1, "norm_quantize": 1, "fp8_linear": 3}  # was 3 quantize + 3 GEMMs
    with torch.no_grad():
        assert torch.equal(out, single(new))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])  # SwiGLU (Llama), GEGLU, GEGLU-tanh (Gemma)
def test_gated_mlp_hands_fp8_from_the_stacked_gemm_to_down(act):
    m = Gated(8, act).eval()
    x = torch.randn(2, 3, 8)
    calib = [(torch.randn(2, 3, 8),) for _ in range(2)]
    c, single = convert_with(m, (x,), calib, True), convert_with(m, (x,), calib, False)
    assert {r["fusion"] for r in dq.report(c)} == {"gated_mlp"}
    with dq.kernels.count_launches() as counts, torch.no_grad():
        out = c(x)
    assert dict(counts) == {"quantize": 1, "fp8_linear": 2}  # not 3 quantize + 3 GEMMs
    with torch.no_grad():
        assert torch.equal(out, single(x))
