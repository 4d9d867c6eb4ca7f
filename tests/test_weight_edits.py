"""In-place edits of a converted weight (PEFT merge, HF init, accelerate, user code) re-quantize it: never a no-op.

Every edit is checked against an fp32 reference: the same op on the weight's dequantized fp32 values, quantized
with torch's own cast (scale = amax / 448 per channel, per tensor or per block, as convert's RunningMax rule),
and the converted model's output must equal that of a copy holding the reference bytes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_field import Block
from torch import nn

import dbr_quant as dq
from dbr_quant.ops.basic import stacked_gate_up
from dbr_quant.quantize.weights import FP8Weight

E4M3_MAX = 448.0
GRANULARITIES = {
    "channel": dq.QConfig(),
    "tensor": dq.QConfig(weight=dq.TensorQConfig(granularity="tensor")),
    "block": dq.QConfig(weight=dq.TensorQConfig(granularity="block", block=(16, 8))),
}


def _delta(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.05


def _data_iadd(w):  # PEFT merge_and_unload (safe_merge=False): `weight.data += delta_weight`
    w.data += _delta(w.shape)


def _peft_safe_merge(w):  # PEFT safe_merge=True: clone, add, check, assign back
    merged = w.data.clone()
    merged += _delta(w.shape)
    assert torch.isfinite(merged).all()
    w.data = merged


def _data_assign(w):  # `param.data = new_tensor`
    w.data = _delta(w.shape) * 10


def _setitem(w):
    w[:, 1:3] = 0.25


# name → the edit (on the module's weight, under no_grad, seeded) and the same edit on an fp32 tensor
EDITS = {
    "data_iadd": (_data_iadd, lambda t: t.add_(_delta(t.shape))),
    "peft_safe_merge": (_peft_safe_merge, lambda t: t.add_(_delta(t.shape))),
    "add_": (lambda w: w.add_(_delta(w.shape)), lambda t: t.add_(_delta(t.shape))),
    "mul_": (lambda w: w.mul_(3.0), lambda t: t.mul_(3.0)),
    "zero_": (lambda w: w.zero_(), lambda t: t.zero_()),
    "fill_": (lambda w: w.fill_(0.125), lambda t: t.fill_(0.125)),
    "normal_": (lambda w: w.normal_(0.0, 0.3), lambda t: t.normal_(0.0, 0.3)),
    "uniform_": (lambda w: w.uniform_(-0.2, 0.2), lambda t: t.uniform_(-0.2, 0.2)),
    "init_normal_": (lambda w: nn.init.normal_(w, std=0.02), lambda t: nn.init.normal_(t, std=0.02)),
    "copy_": (lambda w: w.copy_(_delta(w.shape) * 4), lambda t: t.copy_(_delta(t.shape) * 4)),
    "data_assign": (_data_assign, lambda t: t.copy_(_delta(t.shape) * 10)),
    "setitem": (_setitem, lambda t: t.__setitem__((slice(None), slice(1, 3)), 0.25)),
}


def _reference_fp8(values: torch.Tensor, granularity: str, block=(16, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's own saturating cast of ``values`` [N, K] with amax / 448 scales (1 where amax is 0)."""
    n, k = values.shape
    if granularity == "channel":
        amax = values.abs().amax(1)
    elif granularity == "tensor":
        amax = values.abs().amax()
    else:
        bn, bk = block
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        padded[:n, :k] = values.abs()
        amax = padded.reshape(padded.shape[0] // bn, bn, -1, bk).amax(dim=(1, 3))
    scale = amax / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if granularity == "channel":
        full = scale[:, None]
    elif granularity == "tensor":
        full = scale
    else:
        full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    q = (values * torch.reciprocal(full)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


_CONVERTED: dict[str, nn.Module] = {}


def _converted(granularity: str) -> nn.Module:
    """One converted Block per granularity (its gate and up share one [gate; up] buffer); tests edit copies."""
    if granularity not in _CONVERTED:
        torch.manual_seed(0)
        m = Block().eval()
        p = dq.prepare(m, (torch.randn(2, 5, 16),), GRANULARITIES[granularity])
        dq.calibrate(p, [torch.randn(2, 5, 16) for _ in range(3)], progress=False)
        _CONVERTED[granularity] = dq.convert(p)
    return copy.deepcopy(_CONVERTED[granularity])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize("granularity", sorted(GRANULARITIES))
@pytest.mark.parametrize("name", ["fc1", "gate"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_in_place_edit_requantizes_like_an_fp32_reference(edit, name, granularity):
    c = _converted(granularity)
    on_weight, on_fp32 = EDITS[edit]
    w = getattr(c, name).weight
    assert type(w) is FP8Weight
    x = torch.randn(2, 5, 16)
    up_before = (c.up.weight.qdata.clone(), c.up.weight.scale.clone())
    with torch.no_grad():
        before = c(x)
        values = w.dequantize(torch.float32)
        torch.manual_seed(3)
        on_fp32(values)
        torch.manual_seed(3)
        on_weight(w)
        after = c(x)
    w = getattr(c, name).weight  # the module's weight is still an FP8 weight with its layout
    assert type(w) is FP8Weight and w.qdata.dtype == torch.float8_e4m3fn and w.block == c.fc2.weight.block
    q_ref, s_ref = _reference_fp8(values, granularity)
    assert torch.equal(_bits(w.qdata), _bits(q_ref)), edit
    assert torch.equal(w.scale, s_ref.expand_as(w.scale)), edit  # a per-tensor scale in a stacked row buffer: all rows
    assert not torch.equal(after, before), f"{edit} on {name} left the output unchanged"
    ref = _converted(granularity)
    getattr(ref, name).weight.copy_(FP8Weight(q_ref, s_ref.expand_as(w.scale).clone(), torch.float32,
                                              block=w.block))  # the reference bytes as they are
    with torch.no_grad():
        assert torch.equal(after, ref(x))
    if name == "gate":  # up keeps its bytes; an edit in place keeps the shared buffer the fused GEMM reads
        assert torch.equal(_bits(c.up.weight.qdata), _bits(up_before[0])) and torch.equal(c.up.weight.scale,
                                                                                             up_before[1])
        gate_op = type("Call", (), {"module": c.gate})
        up_op = type("Call", (), {"module": c.up})
        if edit != "peft_safe_merge":  # `.data = clone` takes the clone's own buffer (as torch's .data = does)
            assert stacked_gate_up(gate_op, up_op) is not None
            assert c.gate.weight.qdata.untyped_storage().data_ptr() == c.up.weight.qdata.untyped_storage().data_ptr()


def test_transposed_conv1d_weight_requantizes_per_output_channel():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    m = nn.Sequential(Conv1D(24, 16), nn.GELU(), Conv1D(16, 24)).eval()
    c = dq.convert(dq.calibrate(dq.prepare(m, (torch.randn(3, 16),)), [torch.randn(3, 16)], progress=False))
    w = c[0].weight
    assert type(w) is FP8Weight and w.transposed and w.shape == (16, 24)
    with torch.no_grad():
        values = w.dequantize(torch.float32) + _delta((16, 24))
        w.data += _delta((16, 24))
    q_ref, s_ref = _reference_fp8(values.t(), "channel")  # stored [out, in]: one scale per output channel
    assert torch.equal(_bits(c[0].weight.qdata), _bits(q_ref)) and torch.equal(c[0].weight.scale, s_ref)


@pytest.mark.parametrize("bad, match", [
    (lambda w: setattr(w, "data", torch.zeros(3, 3)), "keeps its shape"),
    (lambda w: w.fill_(float("nan")), "NaN/inf"),
    (lambda w: w.t_(), "keeps its shape"),
])
def test_edits_that_cannot_be_stored_raise_and_leave_the_weight(bad, match):
    c = _converted("channel")
    w = c.fc1.weight
    q, s = w.qdata.clone(), w.scale.clone()
    with torch.no_grad(), pytest.raises((RuntimeError, ValueError), match=match):
        bad(w)
    assert torch.equal(_bits(w.qdata), _bits(q)) and torch.equal(w.scale, s)


def test_accelerate_set_module_tensor_to_device():
    from accelerate.utils import set_module_tensor_to_device

    c = _converted("channel")
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = c(x)
    # an FP8 weight as the value (what offload.py hands accelerate): loaded as it is
    set_module_tensor_to_device(c, "fc1.weight", "cpu", value=copy.deepcopy(c.fc1.weight))
    assert type(c.fc1.weight) is FP8Weight and isinstance(c.fc1.weight, nn.Parameter)
    with torch.no_grad():
        assert torch.equal(c(x), want)
    # high-precision values would need the weight's scale rule, which a constructor cannot see: a clear error
    with pytest.raises(TypeError, match="set_module_tensor_to_device.*copy_"):
        set_module_tensor_to_device(c, "fc1.weight", "cpu", value=torch.randn(64, 16))
    assert type(c.fc1.weight) is FP8Weight


def test_hf_init_weights_and_tie_weights():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    m = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=32, initializer_range=0.05)).eval()
    ids = torch.randint(0, 64, (2, 7))
    c = dq.convert(dq.calibrate(dq.prepare(m, (ids,)), [torch.randint(0, 64, (2, 7))], progress=False))
    dense = c.bert.encoder.layer[0].intermediate.dense
    assert type(dense.weight) is FP8Weight
    with torch.no_grad():
        before = c(ids).logits
        torch.manual_seed(5)
        c._init_weights(dense)  # transformers' init: normal_(0, initializer_range) on the weight, zeros on the bias
        torch.manual_seed(5)
        values = torch.empty(dense.weight.shape).normal_(0.0, 0.05)
        after = c(ids).logits
    q_ref, s_ref = _reference_fp8(values, "channel")
    assert torch.equal(_bits(dense.weight.qdata), _bits(q_ref)) and torch.equal(dense.weight.scale, s_ref)
    assert not torch.equal(after, before)
    # tie_weights re-ties the decoder to the (fp32) word embeddings: same values, so the same output
    c.tie_weights()
    assert c.cls.predictions.decoder.weight is c.bert.embeddings.word_embeddings.weight
    with torch.no_grad():
        torch.testing.assert_close(c(ids).logits, after, rtol=0, atol=1e-5)


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_moe_expert_weights_requantize_per_expert(granularity):
    from test_moe import _experts_modules, pipeline

    qc = dq.QConfig(weight=dq.TensorQConfig(granularity=granularity))
    _, _, c = pipeline("mixtral", "eager", qconfig=qc)  # 3-D expert weights [E, out, in]
    p = next(getattr(mod, name) for mod in _experts_modules(c) for name in mod._parameters
             if type(getattr(mod, name)) is FP8Weight and getattr(mod, name).dim() == 3)
    with torch.no_grad():
        values = p.dequantize(torch.float32) + _delta(p.shape)
        p.data += _delta(p.shape)
    stored = values.transpose(-2, -1) if p.transposed else values  # qdata's [E, out, in]
    for e in range(stored.shape[0]):
        q_ref, s_ref = _reference_fp8(stored[e], granularity)
        assert torch.equal(_bits(p.qdata[e]), _bits(q_ref)), e
        assert torch.equal(p.scale[e], s_ref.reshape(p.scale[e].shape)), e


def test_rewritten_graph_sees_edits_of_the_converted_model():
    from dbr_quant import fx_rewriter

    c = _converted("channel")
    x = torch.randn(2, 5, 16)
    gm = fx_rewriter.rewrite(c, (x,))
    with torch.no_grad():
        before = gm(x)
        c.fc1.weight.data += _delta(c.fc1.weight.shape)  # in place
        _peft_safe_merge(c.gate.weight)  # `.data =` another FP8 weight: rebinds its bytes
        after = gm(x)
        assert not torch.equal(after, before) and torch.equal(after, c(x))


class _ParamLinear(nn.Module):
    """A functional linear on a bare parameter: convert stores the parameter as an FP8 weight whose row slices
    (what MultiheadAttention's in_proj_weight.chunk(3) reads) are FP8 weights on the same bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w)


def _converted_param_linear(qconfig: dq.QConfig) -> nn.Module:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    p = dq.prepare(_ParamLinear(), (x,), qconfig)
    dq.calibrate(p, [x], progress=False)
    return dq.convert(p)


def test_editing_rows_of_a_per_channel_weight_requantizes_only_those_rows():
    c = _converted_param_linear(GRANULARITIES["channel"])
    assert isinstance(c.w, FP8Weight)
    before = c.w.dequantize(torch.float32).clone()
    with torch.no_grad():
        c.w[:4].mul_(3.0)
    ref = before[:4] * 3.0
    scale = ref.abs().amax(1, keepdim=True) / E4M3_MAX  # x·(1/s), as every dbr_quant quantize (README)
    want = (ref * torch.reciprocal(scale)).to(torch.float8_e4m3fn).float() * scale
    after = c.w.dequantize(torch.float32)
    torch.testing.assert_close(after[:4], want, rtol=0, atol=0)
    assert torch.equal(after[4:], before[4:])


def test_editing_rows_of_a_per_tensor_weight_raises_instead_of_rescaling_the_others():
    c = _converted_param_linear(GRANULARITIES["tensor"])
    before = c.w.dequantize(torch.float32).clone()
    with torch.no_grad(), pytest.raises(RuntimeError, match="per-tensor-scaled FP8 weight.*whole parameter"):
        c.w[:4].mul_(3.0)
    assert torch.equal(c.w.dequantize(torch.float32), before)
