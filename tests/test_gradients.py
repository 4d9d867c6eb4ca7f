"""Straight-through gradients (issue 20, point 4): with grad mode on and inputs that require grad, a converted
model's FP8 ops carry the gradient of the model as written with the dequantized FP8 weights.

Each model is compared with two references computed here with plain torch: the fp32 model (how much FP8
changes the gradient) and the "straight-through reference" — the fp32 model whose linear weights are the
converted FP8 weights cast back by torch (``qdata.float() * scale``), which is what the gradient should be
up to the FP8 rounding of activations. Eager, ``fx_rewriter.rewrite`` and rewrite + ``torch.compile`` must
give the same gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
from dbr_quant.fx_rewriter import rewrite
from dbr_quant.quantize.weights import FP8Weight


# ----------------------------------------------------------------------------------------- models
class LinearStack(nn.Module):
    def __init__(self, residual: bool, d: int = 32) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Linear(d, d)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(F.gelu(self.a(x)))
        if self.residual:
            y = y + x
        z = self.c(y)
        return z + y if self.residual else z


class GatedMLP(nn.Module):
    """RMSNorm → gate/up (stacked by convert) → silu·up → down + residual: the norm_gated_mlp fusion."""

    def __init__(self, d: int = 32, i: int = 64) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.gate, self.up, self.down = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False), nn.Linear(i, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, (x.shape[-1],), self.norm.weight, 1e-6)
        return self.down(F.silu(self.gate(h)) * self.up(h)) + x


class NormLinear(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


# ----------------------------------------------------------------------------------------- helpers
def convert(model: nn.Module, x: torch.Tensor, qconfig: dq.QConfig | None = None, **kwargs) -> nn.Module:
    """prepare → calibrate (on x and three perturbed copies) → convert; with ``kwargs`` a Hugging Face model
    called with ``inputs_embeds=x`` and them."""
    gen = torch.Generator().manual_seed(1)
    cal = [x] + [x + 0.1 * torch.randn(x.shape, generator=gen) for _ in range(3)]
    if kwargs:
        prepared = dq.prepare(model, example_kwargs={"inputs_embeds": x, **kwargs}, qconfig=qconfig)
        dq.calibrate(prepared, [{"inputs_embeds": c, **kwargs} for c in cal], progress=False)
    else:
        prepared = dq.prepare(model, x, qconfig=qconfig)
        dq.calibrate(prepared, cal, progress=False)
    return dq.convert(prepared)


def dequantized_weights(model: nn.Module, converted: nn.Module) -> nn.Module:
    """A copy of the fp32 model whose weights are the converted model's FP8 weights cast back by torch
    (``qdata.float()`` × per-channel or per-tensor scale; 3-D MoE experts too)."""
    ref = copy.deepcopy(model)
    for name, w in converted.named_parameters():
        if type(w) is FP8Weight:
            assert w.block is None, "these tests use per-channel / per-tensor weights"
            scale = w.scale.unsqueeze(-1) if w.scale.dim() == w.qdata.dim() - 1 else w.scale
            deq = w.qdata.to(torch.float32) * scale
            owner, _, leaf = name.rpartition(".")
            ref.get_submodule(owner)._parameters[leaf] = nn.Parameter(
                deq.transpose(-1, -2) if w.transposed else deq, requires_grad=False)
    return ref


def gradients(model: nn.Module, x: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, d <output, r> / d x) for a fixed random r (a sum would be blind behind a LayerNorm), with ``x``
    as ``inputs_embeds`` when kwargs are given (a Hugging Face model)."""
    x = x.clone().requires_grad_()
    out = model(inputs_embeds=x, **kwargs).last_hidden_state if kwargs else model(x)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


# (model, bound on the relative error vs fp32, bound vs the straight-through reference). Measured: vs fp32
# stack 0.042, stack_residual 0.014, gated_mlp 0.0062, norm_linear 0.025 (cosines ≥ 0.9991); vs the
# reference < 1e-5 for all four (each FP8 subgraph here sees its exact input or is linear, so the
# straight-through gradient is the reference's up to float rounding). Bounds ≥ 2× the measured errors.
CASES = {
    "stack": (lambda: LinearStack(residual=False), 0.1, 1e-4),
    "stack_residual": (lambda: LinearStack(residual=True), 0.03, 1e-4),
    "gated_mlp": (GatedMLP, 0.02, 1e-4),
    "norm_linear": (NormLinear, 0.05, 1e-4),
}


def build(name: str) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = CASES[name][0]().eval()
    x = torch.randn(4, 8, 32)
    return model, convert(model, x), x


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CASES))
def test_input_gradient_is_straight_through_and_close_to_fp32(name):
    model, converted, x = build(name)
    _, fp32_bound, ste_bound = CASES[name]
    out, grad = gradients(converted, x)
    _, want_fp32 = gradients(model, x)
    _, want_ste = gradients(dequantized_weights(model, converted), x)
    assert not torch.allclose(grad, torch.ones_like(grad)), "the gradient skipped the FP8 ops (all ones)"
    assert cos(grad, want_fp32) > 0.99 and rel(grad, want_fp32) < fp32_bound
    assert rel(grad, want_ste) < ste_bound
    with torch.no_grad():
        assert torch.equal(out, converted(x)), "the forward value is the FP8 one, grad mode or not"


@pytest.mark.parametrize("attn, quantize_attention", [("eager", False), ("sdpa", True)])
def test_bert_input_gradient(attn, quantize_attention):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=32, initializer_range=0.1,
                                 attn_implementation=attn)).eval()
    x = torch.randn(2, 8, 32)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    converted = convert(model, x, dq.QConfig(quantize_attention=quantize_attention), attention_mask=mask)
    _, grad = gradients(converted, x, attention_mask=mask)
    _, want_fp32 = gradients(model, x, attention_mask=mask)
    _, want_ste = gradients(dequantized_weights(model, converted), x, attention_mask=mask)
    assert cos(grad, want_fp32) > 0.999 and rel(grad, want_fp32) < 0.05  # measured 0.018
    assert rel(grad, want_ste) < 0.02  # measured 0.006–0.007: FP8 activations move the softmax / GELU points


def test_moe_experts_gradient():
    """A transformers-5 Mixtral layer: the 3-D experts run as one FP8 op; the gradient reaches the input
    and, through the routing weights, the router."""
    from transformers import MixtralConfig, MixtralModel

    torch.manual_seed(0)
    model = MixtralModel(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.05, experts_implementation="eager")).eval()
    x = torch.randn(2, 8, 32)
    mask = torch.ones(2, 8, dtype=torch.long)
    converted = convert(model, x, attention_mask=mask)
    experts = converted.layers[0].mlp.experts
    assert type(experts.gate_up_proj) is FP8Weight and type(experts.down_proj) is FP8Weight
    ref = dequantized_weights(model, converted)
    _, grad = gradients(converted, x, attention_mask=mask)
    _, want_fp32 = gradients(model, x, attention_mask=mask)
    _, want_ste = gradients(ref, x, attention_mask=mask)
    assert cos(grad, want_fp32) > 0.999 and rel(grad, want_fp32) < 0.02  # measured 0.0024
    assert rel(grad, want_ste) < 0.005  # measured 0.0008
    router, want_router = converted.layers[0].mlp.gate.weight.grad, ref.layers[0].mlp.gate.weight.grad
    assert router is not None and rel(router, want_router) < 0.05


def test_biases_and_norm_weights_get_gradients_fp8_weights_stay_frozen():
    model, converted, x = build("gated_mlp")
    ref = dequantized_weights(model, converted)
    gradients(converted, x)
    gradients(ref, x)
    got, want = dict(converted.named_parameters()), dict(ref.named_parameters())
    for name, p in got.items():
        if type(p) is FP8Weight:
            assert p.grad is None and not p.requires_grad, name
        else:
            assert p.grad is not None, f"{name} got no gradient"
            assert rel(p.grad, want[name].grad) < 0.02, name


def test_no_residual_backward_works_where_it_used_to_say_does_not_require_grad():
    model, converted, x = build("stack")
    x = x.clone().requires_grad_()
    for p in converted.parameters():
        p.requires_grad_(False)  # only the input requires grad: saliency on a frozen model
    out = converted(x)
    assert out.requires_grad
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_no_graph_and_no_reference_under_no_grad_or_when_nothing_requires_grad():
    model, converted, x = build("stack_residual")
    with torch.no_grad():
        assert not converted(x.clone().requires_grad_()).requires_grad
    for p in converted.parameters():
        p.requires_grad_(False)
    out = converted(x)
    assert out.grad_fn is None


@pytest.mark.parametrize("name", ["stack_residual", "gated_mlp"])
def test_rewritten_graph_gives_the_eager_gradients(name):
    model, converted, x = build(name)
    out, grad = gradients(converted, x)
    eager_params = {n: p.grad.clone() for n, p in converted.named_parameters() if p.grad is not None}
    converted.zero_grad(set_to_none=True)
    gm = rewrite(converted, (x.clone().requires_grad_(),))  # a trainable graph shares the model's parameters
    got_out, got = gradients(gm, x)
    assert torch.equal(got_out, out) and torch.allclose(got, grad, rtol=0, atol=1e-6)
    gm_params = dict(gm.named_parameters())
    for n, g in eager_params.items():
        assert gm_params[n] is dict(converted.named_parameters())[n]
        assert torch.allclose(gm_params[n].grad, g, rtol=0, atol=1e-5), n


@pytest.mark.slow  # ≈ 40 s: inductor compiles the forward and the backward
def test_compiled_rewritten_graph_gives_the_eager_gradients():
    model, converted, x = build("stack_residual")
    out, grad = gradients(converted, x)
    compiled = torch.compile(rewrite(converted, (x.clone().requires_grad_(),)), fullgraph=True)
    got_out, got = gradients(compiled, x)
    assert torch.allclose(got_out, out, rtol=0, atol=1e-5) and torch.allclose(got, grad, rtol=0, atol=1e-5)


def test_graph_rewritten_for_inference_says_how_to_get_gradients():
    model, converted, x = build("stack_residual")
    gm = rewrite(converted)
    with pytest.raises(RuntimeError, match="captured for inference.*rewrite with example inputs that require grad"):
        gradients(gm, x)
