"""oplib: the dbr_quant:: ops' registrations — a direct call on plain tensors, one node under tracing, fake
implementations, and a backward that is a clear error for every op."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dbr_quant  # noqa: F401  (defines the ops)
from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.fx_rewriter.oplib import OPS

OP = torch.ops.dbr_quant
GRAD_ERROR = "has no gradient: this graph was captured for inference"


def linear_inputs(gen, m=3, k=16, n=8):
    x = torch.randn(m, k, generator=gen)
    sx, sw = x.abs().amax() / 448, torch.tensor(0.01)
    xq = (x / sx).to(torch.float8_e4m3fn)
    wq = (torch.randn(n, k, generator=gen) / sw).clamp(-448, 448).to(torch.float8_e4m3fn)
    return xq, sx, wq, sw, torch.randn(n, generator=gen)


def test_every_op_has_a_fake_and_an_autograd_kernel_and_is_pt2_compliant():
    assert {"quantize", "fp8_linear", "fp8_mlp", "fp8_attention", "fp8_moe_experts", "fp8_to_fp32"} <= set(OPS)
    for name in OPS:
        qualname = f"dbr_quant::{name}"
        for key in ("Autograd", "CompositeExplicitAutograd", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), (name, key)
        assert torch.Tag.pt2_compliant_tag in getattr(OP, name).default.tags


@pytest.mark.parametrize("grad", [False, True])
def test_op_call_equals_the_kernel_it_wraps_with_grad_mode_on_or_off(grad):
    xq, sx, wq, sw, b = linear_inputs(torch.Generator().manual_seed(0))
    want = kernels.fp8_linear(xq, sx, wq, sw, bias=b, activation="gelu", out_dtype=torch.float32)
    with torch.set_grad_enabled(grad):
        got = OP.fp8_linear(xq, sx, wq, sw, b, "gelu", None, torch.float32, None, "e4m3")
    assert torch.equal(got, want) and got.grad_fn is None and not got.requires_grad
    with torch.inference_mode():  # the dispatcher skips the Autograd kernel here
        assert torch.equal(OP.fp8_linear(xq, sx, wq, sw, b, "gelu", None, torch.float32, None, "e4m3"), want)


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_under_a_dispatch_mode_the_op_is_one_call_not_its_body():
    """A Python mode (how tracing sees ops) must see the op itself: the direct-call fast path is only for
    plain tensors with no mode active."""
    xq, sx, wq, sw, b = linear_inputs(torch.Generator().manual_seed(1))
    want = OP.fp8_linear(xq, sx, wq, sw, b, "", None, torch.float32, None, "e4m3")
    with RecordOps() as rec:
        got = OP.fp8_linear(xq, sx, wq, sw, b, "", None, torch.float32, None, "e4m3")
    assert rec.ops == ["dbr_quant.fp8_linear.default"]
    assert torch.equal(got, want)


def test_fake_tensors_get_the_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    xq, sx, wq, sw, b = linear_inputs(torch.Generator().manual_seed(2), m=5, n=12)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(xq)
        out = OP.fp8_linear(fx, sx, wq, sw, b, "", None, torch.bfloat16, None, "e4m3")
        q, scale = OP.dynamic_quantize(mode.from_tensor(torch.randn(4, 6)), "e5m2", True)
    assert out.shape == (5, 12) and out.dtype == torch.bfloat16
    assert q.dtype == torch.float8_e5m2 and q.shape == (4, 6) and scale.shape == (4, 1)


def grad_cases(gen):
    """(op name, call) pairs, each with an input that requires grad, covering single and tuple outputs."""
    xq, sx, wq, sw, b = linear_inputs(gen)
    x = torch.randn(3, 16, generator=gen)
    b_grad, x_grad = b.clone().requires_grad_(), x.clone().requires_grad_()
    ln_w = torch.ones(16, requires_grad=True)
    return [
        ("fp8_linear", lambda: OP.fp8_linear(xq, sx, wq, sw, b_grad, "", None, torch.float32, None, "e4m3")),
        ("quantize", lambda: OP.quantize(x_grad, sx, "e4m3").float()),
        ("dynamic_quantize", lambda: OP.dynamic_quantize(x_grad, "e4m3", True)[1]),
        ("layer_norm_quantize", lambda: OP.layer_norm_quantize(x_grad, ln_w, None, 1e-5, sx, "e4m3", False)[0]),
        ("dequantize", lambda: OP.dequantize(xq, sx.clone().requires_grad_(), torch.float32)),
    ]


@pytest.mark.parametrize("case", range(5))
def test_backward_through_an_op_is_the_inference_only_error_naming_it(case):
    name, call = grad_cases(torch.Generator().manual_seed(3))[case]
    out = call()
    assert out.requires_grad, "an input requires grad, so the output is part of a graph"
    with pytest.raises(RuntimeError, match=f"dbr_quant::{name} {GRAD_ERROR}"):
        out.sum().backward()
    with torch.no_grad():  # and without grad the same call is plain inference
        assert not call().requires_grad


def test_format_strings_parse_in_any_case():
    x = torch.randn(4, 8)
    s = torch.tensor(0.01)
    want = kernels.quantize(x, s, FP8Format.E5M2)
    assert torch.equal(OP.quantize(x, s, "E5M2").view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="unknown FP8 format"):
        OP.quantize(x, s, "e3m4")
