"""A converted model used the way the field uses it, beyond tests/test_field.py and test_outside_field.py: inputs
of the wrong kind (integers, NaN, zeros), degenerate and strided batches, other dtypes, torch.autocast, moves,
copies, threads. Each case is compared with the unquantized model (or the converted model's own reference run);
where the library's behaviour is a choice, the test asserts that choice."""

from __future__ import annotations

import copy
import io
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


class NormMlp(nn.Module):
    """x + b(gelu(a(norm(x)))): the norm and a's input quantization run as one fused kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.a, self.b = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.b(F.gelu(self.a(self.norm(x))))


MODELS = {"one": One, "mlp": Mlp, "norm_block": NormBlock, "norm_mlp": NormMlp}


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
@pytest.mark.parametrize("name", ["one", "mlp", "norm_mlp"])
def test_integer_input_raises_naming_the_op(name):
    """The fp32 model raises on an int64 input (dtype mismatch in its linear or layer_norm); the converted one
    computed the FP8 linear (or the fused norm + quantize) in float and cast the result back to int64, silently
    truncated. Now a TypeError names the op, or the norm raises as in the fp32 model."""
    model, converted = _pair(name)
    ids = torch.randint(0, 5, (2, 5, D))
    with torch.no_grad():
        with pytest.raises(RuntimeError) as want:
            model(ids)
        if name == "norm_mlp":
            with pytest.raises(RuntimeError) as got:
                converted(ids)
            assert str(got.value) == str(want.value)
            return
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


@pytest.mark.parametrize("move", ["double", "torch_save_whole", "state_dict_into_other_converted", "train_eval"])
def test_moves_and_copies_keep_the_fp8_result(move):
    """What a converted model is put through after convert: each keeps the FP8 result bit for bit (``double()``:
    FP8 bytes and scales unchanged, the compute dtype float64, within rounding of the float32 result)."""
    _, converted = _pair("norm_block")
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        want = converted(x)
    if move == "double":
        moved = copy.deepcopy(converted).double()
        assert isinstance(moved.a.weight, FP8Weight) and moved.a.weight.dtype == torch.float64
        with torch.no_grad():
            got = moved(x.double())
        assert got.dtype == torch.float64 and rel_l2(got, want) < 1e-5
        return
    if move == "torch_save_whole":
        buffer = io.BytesIO()
        torch.save(converted, buffer)
        buffer.seek(0)
        moved = torch.load(buffer, weights_only=False)
    elif move == "state_dict_into_other_converted":  # other weights, other calibration: all of it is replaced
        _, moved = _pair("norm_block", seed=7)
        assert moved.load_state_dict(converted.state_dict()) is not None
    else:
        moved = converted.train().eval()
    with torch.no_grad():
        assert torch.equal(moved(x), want)


def test_introspection_sees_the_original_layout():
    """HF-style code reads parameters, their count and dtype, and module names: the converted model answers as
    the fp32 model does (its only extra module is the quantization state)."""
    model, converted = _pair("norm_block")
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in converted.named_parameters()]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in converted.parameters())
    for (n, p), q in zip(model.named_parameters(), converted.parameters()):
        assert (q.dtype, q.shape, q.device) == (p.dtype, p.shape, p.device), n
    extra = {n for n, _ in converted.named_modules()} - {n for n, _ in model.named_modules()}
    assert all(n.startswith("_auto_quant_state") for n in extra), extra
    converted.zero_grad()


# ---------------------------------------------------------------------- batches of every shape and layout
@pytest.mark.parametrize("shape", [(0, 5, D), (2, 0, D), (2, 1, D), (1, 1, D), (D,), (1, 4096, D)],
                         ids=["batch0", "seq0", "seq1", "one_token", "1d", "4096_tokens"])
@pytest.mark.parametrize("name", ["mlp", "norm_block"])
def test_degenerate_and_long_batches(name, shape):
    model, converted = _pair(name)
    x = torch.randn(shape)
    with torch.no_grad():
        want, got = model(x), converted(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel():
        assert rel_l2(got, want) < REL_L2


LAYOUTS = {
    "transposed": lambda: torch.randn(5, 2, D).transpose(0, 1),
    "strided_slice": lambda: torch.randn(2, 5, 2 * D)[..., ::2],
    "expanded_stride0": lambda: torch.randn(1, 1, D).expand(2, 5, D),
    "channels_last": lambda: torch.randn(2, D, 5, 1).contiguous(memory_format=torch.channels_last)[..., 0].mT,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["one", "mlp", "norm_block"])
def test_non_contiguous_inputs_give_the_contiguous_result(name, layout):
    _, converted = _pair(name)
    x = LAYOUTS[layout]()
    with torch.no_grad():
        assert torch.equal(converted(x), converted(x.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_other_float_input_dtypes_compute_in_that_dtype(dtype):
    """A choice: where the fp32 model raises on a float16/bfloat16/float64 input (its linear's dtype mismatch),
    the converted model computes in the input's dtype (an FP8 weight reports whatever dtype it is asked for) and
    returns it; the values are the FP8 result within that dtype's rounding."""
    model, converted = _pair("mlp")
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            model(x.to(dtype))
        got = converted(x.to(dtype))
        assert got.dtype == dtype and rel_l2(got, model(x)) < REL_L2


def test_inference_mode_equals_no_grad():
    _, converted = _pair("norm_block")
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        want = converted(x)
    with torch.inference_mode():
        assert torch.equal(converted(x), want)


# ---------------------------------------------------------------------- calibration coverage
def test_layer_never_reached_in_calibration_names_it():
    """A choice: a linear traced by prepare but never reached while calibrating has no scale, and convert
    refuses, naming it and saying what to do (rather than inventing a scale)."""
    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x, use_b: bool = False):
            return self.b(x) if use_b else self.a(x)

    with pytest.warns(UserWarning, match="never called during prepare"):  # a: the trace took the other branch
        prepared = dq.prepare(Branch().eval(), (torch.randn(2, D),), example_kwargs={"use_b": True})
    with pytest.warns(UserWarning, match=r"ran op 'linear' \(a\) that the trace in prepare\(\) never saw"):
        dq.calibrate(prepared, [torch.randn(2, D)], progress=False)
    with pytest.raises(dq.UncalibratedError, match=r"(?s)linear b input 'input'.*Run dbr_quant\.calibrate"):
        dq.convert(prepared)


# ---------------------------------------------------------------------- hooks, threads, global state
def test_forward_hook_on_a_fused_linear_fires_and_changes_the_output():
    model, converted = _pair("mlp")
    x = torch.randn(2, 5, D)
    seen = []
    with torch.no_grad():
        want_a = model.a(x)
    converted.a.register_forward_hook(lambda mod, args, out: seen.append(out) or out * 0)
    model.a.register_forward_hook(lambda mod, args, out: out * 0)
    with torch.no_grad():
        got, want = converted(x), model(x)
    assert len(seen) == 1 and rel_l2(seen[0], want_a) < REL_L2
    assert torch.equal(got, want.expand_as(got)) and torch.equal(got[0, 0], model.b.bias)  # b(relu(0)): b's bias


def test_thread_calibrating_while_another_infers():
    """Calibration of one model and inference of another converted one run at once: the converted outputs are
    the serial ones bit for bit, and the calibration equals a serial calibration."""
    _, converted = _pair("norm_block")
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        want = converted(x)
    batches = [torch.randn(2, 5, D) * (1 + i) for i in range(12)]
    torch.manual_seed(3)
    fresh = NormBlock().eval()
    serial, parallel = dq.prepare(fresh, (x,)), dq.prepare(fresh, (x,))
    dq.calibrate(serial, batches, progress=False)
    stop, results, errors = threading.Event(), [], []

    def infer() -> None:
        try:
            with torch.no_grad():
                while not stop.is_set() or not results:
                    results.append(torch.equal(converted(x), want))
        except BaseException as e:  # collected: a thread's failure must fail the test
            errors.append(e)

    worker = threading.Thread(target=infer)
    worker.start()
    try:
        dq.calibrate(parallel, batches, progress=False)
    finally:
        stop.set()
        worker.join()
    assert not errors, errors
    assert results and all(results)
    a, b = dq.convert(serial), dq.convert(parallel)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


def test_interrupted_calibration_generator_restores_global_state():
    """A generator of batches that raises KeyboardInterrupt (Ctrl-C while loading data) mid-calibration: the
    global state is the stock one, and calibrating goes on afterwards."""
    prepared = dq.prepare(Mlp().eval(), (torch.randn(2, 5, D),))

    def batches():
        yield torch.randn(2, 5, D)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dq.calibrate(prepared, batches(), progress=False)
    assert nn.Module.__call__ is STOCK_CALL and torch._C._len_torch_function_stack() == 0
    dq.calibrate(prepared, [torch.randn(2, 5, D)], progress=False)
    dq.convert(prepared)


def test_prepare_inside_a_forward_being_prepared():
    """prepare() of one model from inside another model's forward while that one is being traced (a wrapper
    that quantizes a submodel lazily): both prepare, both convert, global state stock afterwards."""
    inner = Mlp().eval()
    made: list[nn.Module] = []

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(D, D)

        def forward(self, x):
            if not made:
                made.append(dq.prepare(inner, (x,)))
            return self.head(x)

    x = torch.randn(2, 5, D)
    outer = dq.prepare(Outer().eval(), (x,))
    assert nn.Module.__call__ is STOCK_CALL and torch._C._len_torch_function_stack() == 0
    for prepared in (outer, made[0]):
        dq.calibrate(prepared, [x], progress=False)
    with torch.no_grad():
        assert rel_l2(dq.convert(made[0])(x), inner(x)) < REL_L2


STOCK_CALL = nn.Module.__call__


# ---------------------------------------------------------------------- the real MiniLM

MINILM_REL_L2 = 0.12  # measured 0.079 (fp32) / 0.078-0.080 (autocast) on these 8 sentences; last_hidden_state


@pytest.mark.parametrize("dtype", AUTOCAST, ids=str)
def test_minilm_under_autocast(minilm, dtype):
    """MiniLM under autocast: its last_hidden_state came back in bfloat16 (the fused residual + LayerNorm ran in
    it) where the fp32 model's is float32 (autocast runs layer_norm in float32)."""
    model, converted, batch = minilm
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        want = model(**batch).last_hidden_state
        got = converted(**batch).last_hidden_state
    with torch.no_grad():
        reference = model(**batch).last_hidden_state
    assert got.dtype == want.dtype and rel_l2(got, reference) < MINILM_REL_L2


@pytest.mark.parametrize("length", [0, 1, 2])
def test_minilm_short_and_empty_batches(minilm, length):
    """Sequences of one or two tokens work; an empty batch raises as the fp32 model does (its own attention
    reshape cannot infer the head dimension of 0 elements): the converted model adds no failure of its own."""
    model, converted, batch = minilm
    cut = {k: v[:length] for k, v in batch.items()}
    if length == 0:
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="cannot reshape tensor of 0 elements") as want:
                model(**cut)
            with pytest.raises(RuntimeError, match="cannot reshape tensor of 0 elements") as got:
                converted(**cut)
        assert str(got.value) == str(want.value)
        return
    cut = {k: v[:, :length] for k, v in batch.items()}
    with torch.no_grad():
        assert rel_l2(converted(**cut).last_hidden_state, model(**cut).last_hidden_state) < MINILM_REL_L2


def test_jit_trace_says_to_use_rewrite():
    """``torch.jit.trace`` of a converted model failed deep inside a kernel ('Expected bool, got Tensor' from a
    size check); it cannot record the C / Triton kernels anyway. The error now says what captures a graph."""
    _, converted = _pair("mlp")
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace cannot record the converted Mlp.*fx_rewriter\.rewrite"):
        torch.jit.trace(converted, torch.randn(2, 5, D), check_trace=False)
    assert nn.Module.__call__ is STOCK_CALL and torch._C._len_torch_function_stack() == 0
    with torch.no_grad():
        converted(torch.randn(2, 5, D))


@pytest.mark.parametrize("phases", [("prepare",), ("convert",), ("prepare", "calibrate", "convert")],
                         ids=lambda p: "+".join(p))
def test_phases_under_inference_mode(phases):
    """prepare / calibrate / convert called inside ``torch.inference_mode()`` (a script that wraps everything in
    it), the model used outside it afterwards. Calibrating after an inference-mode prepare raised 'Inplace update
    to inference tensor outside InferenceMode' (its observers were inference tensors); a model converted in it
    failed its first grad-mode forward ('Inference tensors cannot be saved for backward') and refused weight edits.
    Now each phase makes normal tensors, as the user's model holds."""
    torch.manual_seed(0)
    model, x = NormBlock().eval(), torch.randn(2, 5, D)

    def phase(name: str):
        return torch.inference_mode(name in phases)

    with phase("prepare"):
        prepared = dq.prepare(model, (x,))
    with phase("calibrate"):
        dq.calibrate(prepared, [torch.randn(2, 5, D) for _ in range(3)], progress=False)
    with phase("convert"):
        converted = dq.convert(prepared)
    x_fp8, x_hp = x.clone().requires_grad_(), x.clone().requires_grad_()
    converted(x_fp8).square().sum().backward()
    model(x_hp).square().sum().backward()
    assert rel_l2(x_fp8.grad, x_hp.grad) < REL_L2
    with torch.no_grad():
        converted.a.weight.mul_(2.0)
        model.a.weight.mul_(2.0)
        assert rel_l2(converted(x), model(x)) < REL_L2
