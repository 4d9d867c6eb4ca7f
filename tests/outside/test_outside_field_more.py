"""A converted model used the way the field uses it, beyond tests/test_field.py and test_outside_field.py: inputs
of the wrong kind (integers, NaN, zeros), degenerate and strided batches, other dtypes, torch.autocast, moves,
copies, threads. Each case is compared with the unquantized model (or the converted model's own reference run);
where the library's behaviour is a choice, the test asserts that choice."""

from __future__ import annotations

import copy
import io
import pickle
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from outside_models import D
from outside_pipeline import REL_L2, rel_l2
from torch import nn

import dbr_quant as dq
from dbr_quant.quantize.weights import FP8Weight


class One(nn.Module):
    """One linear: nothing fused, the FP8 linear's output is the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        return self.a(x)


class Mlp(nn.Module):
    """a → relu → b: one fused MLP subgraph once converted."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


class NormBlock(nn.Module):
    """LayerNorm → MLP + residual, then a LayerNorm: what a transformer layer does (norm and residual fusions)."""

    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.a, self.b = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return self.n2(x + self.b(F.gelu(self.a(self.n1(x)))))


MODELS = {"one": One, "mlp": Mlp, "norm_block": NormBlock}


def _convert(model: nn.Module, example: torch.Tensor, batches: list[torch.Tensor] | None = None,
             ignore_warnings: bool = True) -> nn.Module:
    with warnings.catch_warnings():
        if ignore_warnings:
            warnings.simplefilter("ignore")
        prepared = dq.prepare(model.eval(), (example,))
        dq.calibrate(prepared, batches if batches is not None else [torch.randn_like(example) for _ in range(3)],
                     progress=False)
        return dq.convert(prepared)


def _pair(name: str = "mlp", seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = MODELS[name]().eval()
    return model, _convert(model, torch.randn(2, 5, D))


# ---------------------------------------------------------------------- inputs of the wrong kind
@pytest.mark.parametrize("name", ["one", "mlp"])
def test_integer_input_raises_naming_the_op(name):
    """The fp32 model raises on an int64 input (dtype mismatch in its linear); the converted one computed the
    FP8 linear in float and cast the result back to int64, silently truncated. Now a TypeError names the op."""
    model, converted = _pair(name)
    ids = torch.randint(0, 5, (2, 5, D))
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            model(ids)
        with pytest.raises((TypeError, RuntimeError), match=r"linear 'a' got a torch\.int64 'input' activation"):
            converted(ids)


def test_integer_calibration_batch_raises_naming_the_op():
    prepared = dq.prepare(Mlp().eval(), (torch.randn(2, 5, D),))
    with pytest.raises(TypeError, match=r"linear 'a' got a torch\.int64 'input' activation .*while calibrating"):
        dq.calibrate(prepared, [torch.randint(0, 5, (2, 5, D))], progress=False)


@pytest.mark.parametrize("bad", ["nan", "inf", "zeros", "empty"])
def test_calibration_that_saw_bad_data_warns_naming_the_activation(bad):
    """Observers skip NaN/inf (counting them) and give scale 1.0 to an activation that never saw a nonzero value:
    convert says so, naming each activation, instead of passing silently. The skipped values do not poison the
    scale: the converted model stays within FP8's error of fp32."""
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(2, 5, D)
    good = [torch.randn(2, 5, D) for _ in range(3)]
    if bad in ("nan", "inf"):
        poisoned = good[1].clone()
        poisoned[0, 0, 3] = float(bad)
        batches = [good[0], poisoned, good[2]]
    else:
        batches = [torch.zeros(2, 5, D)] if bad == "zeros" else [torch.zeros(0, 5, D)]
    prepared = dq.prepare(model, (x,))
    dq.calibrate(prepared, batches, progress=False)
    with pytest.warns(UserWarning, match=r"convert\(\): the calibration data of \d+ activation\(s\) look wrong") as w:
        converted = dq.convert(prepared)
    message = "\n".join(str(m.message) for m in w)
    if bad in ("nan", "inf"):  # a's input held the bad value, and b's input (relu(a(x))) inherits it
        assert "linear a 'input': 1 NaN/inf value(s) seen and ignored" in message, message
        with torch.no_grad():
            assert rel_l2(converted(x), model(x)) < REL_L2
    else:
        assert "linear a 'input': no nonzero value seen" in message, message
        assert torch.equal(dq.quant_state(converted).scale_0_input, torch.tensor(1.0))


def test_clean_calibration_warns_nothing():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _convert(Mlp(), torch.randn(2, 5, D), ignore_warnings=False)


# ---------------------------------------------------------------------- torch.autocast
AUTOCAST = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", AUTOCAST, ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_autocast_gives_the_dtypes_autocast_gives_the_fp32_model(name, dtype):
    """Under ``torch.autocast`` the FP8 ops return autocast's dtype (they replace linears, which autocast runs
    in it) and the ops around them get autocast's own treatment (layer_norm in fp32): the converted model's
    output dtype was float32 where the fp32 model's is bfloat16 (one linear), and a fused residual + LayerNorm
    ran in bfloat16 where autocast runs it in float32. Values stay within FP8's error of the fp32 model."""
    model, converted = _pair(name)
    x = torch.randn(3, 7, D)
    seen: dict[str, list[torch.dtype]] = {"fp32": [], "fp8": []}
    for key, m in (("fp32", model), ("fp8", converted)):
        m.a.register_forward_hook(lambda mod, args, out, key=key: seen[key].append(out.dtype))
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        want, got = model(x), converted(x)
    assert got.dtype == want.dtype and seen["fp8"] == seen["fp32"] == [dtype]
    with torch.no_grad():
        assert rel_l2(got, model(x)) < REL_L2


@pytest.mark.parametrize("dtype", AUTOCAST, ids=str)
def test_autocast_fp8_linear_is_the_exact_result_cast(dtype):
    """The FP8 kernels run with autocast off: under autocast a converted linear gives its own result (bit for
    bit) cast to the autocast dtype, not what autocast would make of the kernels' inner torch calls."""
    _, converted = _pair("one")
    x = torch.randn(4, 300, D)
    with torch.no_grad():
        want = converted(x)
        with torch.autocast("cpu", dtype=dtype):
            got = converted(x)
    assert torch.equal(got, want.to(dtype))


def test_autocast_with_gradients_and_float64_input():
    """Straight-through gradients under autocast reach the input in its own dtype; a float64 input stays
    float64 through an FP8 op, as autocast leaves float64 alone."""
    model, converted = _pair("norm_block")
    x = torch.randn(2, 5, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = converted(x)
    out.float().square().sum().backward()
    x_hp = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x_hp).float().square().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32 and rel_l2(x.grad, x_hp.grad) < REL_L2
    _, one = _pair("one")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert one(torch.randn(2, D, dtype=torch.float64)).dtype == torch.float64


# ---------------------------------------------------------------------- fine-tuning loops
@pytest.mark.parametrize("how", ["module_requires_grad_", "param_requires_grad_", "param_attribute"])
def test_fp8_weight_refuses_requires_grad(how):
    """``requires_grad = True`` on an FP8 weight was accepted and then never got a gradient (straight-through
    gradients stop at FP8 weights): a fine-tuning loop trained nothing and said nothing. Now it raises, saying
    what to do; False stays allowed, and the other parameters still train."""
    _, converted = _pair("mlp")
    w = converted.a.weight
    set_true = {"module_requires_grad_": lambda: converted.requires_grad_(True),
                "param_requires_grad_": lambda: w.requires_grad_(True),
                "param_attribute": lambda: setattr(w, "requires_grad", True)}[how]
    with pytest.raises(RuntimeError, match=r"FP8 weight \[64, 16\] is frozen.*Override\(pattern=\.\.\., skip=True"):
        set_true()
    assert not w.requires_grad
    converted.requires_grad_(False)
    w.requires_grad = False
    trainable = [p for p in converted.parameters() if not isinstance(p, FP8Weight)]
    for p in trainable:
        p.requires_grad = True
    converted(torch.randn(2, 5, D)).square().sum().backward()
    assert all(p.grad is not None for p in trainable) and w.grad is None and not w.requires_grad


# ---------------------------------------------------------------------- moves and copies
@pytest.mark.parametrize("name", ["mlp", "norm_block"])
def test_meta_then_to_empty_then_load_state_dict(name):
    """``model.to("meta")``, ``to_empty(device=...)``, ``load_state_dict(sd)``: how a model is rebuilt without
    materializing it twice. ``to_empty`` turned each FP8 weight into an empty fp32 parameter, which then refused
    the FP8 state dict (unexpected ``weight_scale``); now the layers stay FP8 and the reload is bit-exact."""
    _, converted = _pair(name)
    again = copy.deepcopy(converted).to("meta")
    assert isinstance(again.a.weight, FP8Weight) and again.a.weight.qdata.is_meta
    again.to_empty(device="cpu")
    assert isinstance(again.a.weight, FP8Weight) and again.a.weight.qdata.dtype == torch.float8_e4m3fn
    again.load_state_dict(converted.state_dict())
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        assert torch.equal(again(x), converted(x))
