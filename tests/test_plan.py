"""The converted runtime's precompiled plan (dbr_quant/runtime/plan.py) and the one path that uses it
(convert_run.ConvertRun ``_run_op``): the plan's step at the cursor must serve every op of a plain model, the
per-class selection of linear and activation modules (``module_call``) must compute exactly what the per-call
checks (``_module_call``) compute, weights and scales are read per call, and anything unusual falls back to
the general matching (``Run.match_position``: warnings, ``UnseenOpError``)."""

from __future__ import annotations

import copy
import dataclasses
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dbr_quant as dq
from dbr_quant.kernels import count_launches
from dbr_quant.ops.state import UnseenOpError
from dbr_quant.runtime import convert_run

ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU}


def _stack(layers: int, width: int, act: str, bias: bool) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width, bias=bias), ACTS[act]())])


def _convert(model: nn.Module, example: torch.Tensor, **qc) -> nn.Module:
    p = dq.prepare(model, (example,), dq.QConfig(**qc))
    dq.calibrate(p, [torch.randn_like(example) for _ in range(3)], progress=False)
    return dq.convert(p)


class _MatchingCounter:
    """Counts the ops the plan did not expect at its cursor (the general matching, ``Run.match_position``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = convert_run.ConvertRun.match_position

        def counted(run, *args):
            self.calls += 1
            return original(run, *args)

        monkeypatch.setattr(convert_run.ConvertRun, "match_position", counted)


class _NoRole(dict):
    def get(self, cls, default=None):
        return "other"


def _general_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switch the per-class selection off: every module takes the per-call checks of ``_module_call``."""
    monkeypatch.setattr(convert_run, "_ROLES", _NoRole())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


class Residual(nn.Module):
    """fc1 → act → fc2 → + x (the MLP fusion with its residual), then a standalone linear + act."""

    def __init__(self, d: int, act: str) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), ACTS[act](), nn.Linear(2 * d, d)
        self.out, self.out_act = nn.Linear(d, d), ACTS[act]()

    def forward(self, x):
        x = x + self.fc2(self.act(self.fc1(x)))
        return self.out_act(self.out(x))


@settings(max_examples=8, deadline=None)
@given(layers=st.integers(1, 5), width=st.sampled_from([8, 16, 24]), act=st.sampled_from(sorted(ACTS)),
       bias=st.booleans(), residual=st.booleans(), batch=st.integers(1, 3), dynamic=st.booleans())
def test_selection_by_class_equals_the_per_call_checks_bit_for_bit(layers, width, act, bias, residual, batch, dynamic):
    torch.manual_seed(layers * 31 + width)
    model = (Residual(width, act) if residual else _stack(layers, width, act, bias)).eval()
    x = torch.randn(batch, width)
    c = _convert(model, x, dynamic=dynamic)
    with torch.no_grad():
        selected = c(x)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _general_path_only(mp)
        general = c(x)
    assert torch.equal(_bits(selected), _bits(general))


def test_plan_fires_on_a_plain_stack_and_launches_the_same_kernels(monkeypatch):
    torch.manual_seed(0)
    c = _convert(_stack(6, 16, "relu", True).eval(), torch.randn(1, 16))
    counter = _MatchingCounter(monkeypatch)
    x = torch.randn(1, 16)
    with torch.no_grad(), count_launches() as launches:
        c(x)
    assert counter.calls == 0, "every linear of a plain stack should be the step at its plan's cursor"
    plan = dq.quant_state(c).plan
    assert [s.kind for s in plan.steps] == ["linear"] * 6
    assert [(s.step, s.last) for s in plan.steps] == [(0, False), (2, True)] * 3  # three fc1 → relu → fc2 MLPs
    assert dict(launches) == {"quantize": 3, "fp8_linear": 6}
    with pytest.MonkeyPatch.context() as mp, torch.no_grad(), count_launches() as general:
        _general_path_only(mp)
        c(x)
    assert general == launches


def test_plan_holds_no_tensors_and_reads_weights_per_call_after_load_state_dict_and_moves():
    torch.manual_seed(0)
    a = _convert(_stack(4, 16, "gelu", True).eval(), torch.randn(2, 16))
    torch.manual_seed(1)
    b = _convert(_stack(4, 16, "gelu", True).eval(), torch.randn(2, 16))
    x = torch.randn(2, 16)
    with torch.no_grad():
        a(x)  # builds a's plan
    plan = dq.quant_state(a).plan
    for step in plan.steps:  # structure only: nothing that .to() / load_state_dict could leave stale
        values = [getattr(step, f.name) for f in dataclasses.fields(step)] + list(vars(step.op).values())
        assert not any(isinstance(v, torch.Tensor) for v in values)
    a.load_state_dict(b.state_dict())
    with torch.no_grad():
        assert torch.equal(_bits(a(x)), _bits(b(x)))  # b's weights and scales, not a's
    assert dq.quant_state(a).plan is plan  # nothing to invalidate
    fresh = copy.deepcopy(b)
    a.half()
    fresh.half()  # moved before its first forward
    with torch.no_grad():
        out, ref = a(x.half()), fresh(x.half())
    assert out.dtype == torch.float16 and torch.equal(_bits(out), _bits(ref))


def test_deepcopy_drops_the_plan_and_the_copy_builds_its_own():
    torch.manual_seed(0)
    c = _convert(_stack(2, 16, "relu", True).eval(), torch.randn(1, 16))
    x = torch.randn(1, 16)
    with torch.no_grad():
        ref = c(x)
    c2 = copy.deepcopy(c)
    assert dq.quant_state(c2).plan is None
    with torch.no_grad():
        assert torch.equal(c2(x), ref)
    assert dq.quant_state(c2).plan.subgraphs is c2._dbr_record.subgraphs


class Branchy(nn.Module):
    """A forward whose op sequence depends on a flag: ``extra`` runs a linear the trace never saw, ``skip`` skips
    fc2 (its MLP subgraph then never completes)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.extra_fc = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), \
            nn.Linear(d, d)
        self.mode = "traced"

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if self.mode == "extra":
            h = self.extra_fc(h)
        if self.mode != "skip":
            h = self.fc2(h)
        return self.fc3(h)


@pytest.mark.parametrize("mode", ["extra", "skip"])
def test_a_changed_op_sequence_leaves_the_plan_for_the_general_path(mode, monkeypatch):
    torch.manual_seed(0)
    c = _convert(Branchy().eval(), torch.randn(2, 16))
    x = torch.randn(2, 16)
    c.mode = mode
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        selected = c(x)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad(), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _general_path_only(mp)
        general = c(x)
    assert torch.equal(selected, general)
    unseen = [str(w.message) for w in caught if "never saw" in str(w.message)]
    if mode == "extra":  # the untraced linear is named, with its module, and runs in high precision
        assert len(unseen) == 1 and "'linear' (extra_fc)" in unseen[0] and "<root>" in unseen[0]
    else:
        assert unseen == []


def test_strict_mode_still_raises_for_an_op_the_plan_does_not_expect():
    torch.manual_seed(0)
    c = _convert(Branchy().eval(), torch.randn(2, 16), strict=True)
    c.mode = "extra"
    with pytest.raises(UnseenOpError, match=r"module '<root>' ran op 'linear' \(extra_fc\)"), torch.no_grad():
        c(torch.randn(2, 16))


def test_hooks_added_after_convert_take_the_general_path_and_see_real_tensors():
    torch.manual_seed(0)
    c = _convert(_stack(2, 16, "relu", True).eval(), torch.randn(1, 16))
    x = torch.randn(1, 16)
    with torch.no_grad():
        ref = c(x)
    seen = []
    handle = c[1].register_forward_hook(lambda m, i, o: seen.append((i[0].device.type, o.device.type)))
    try:
        with torch.no_grad():
            out = c(x)
    finally:
        handle.remove()
    assert seen == [("cpu", "cpu")]  # no placeholder (meta tensor) reached the hooked activation
    assert torch.allclose(out, ref, rtol=0.05, atol=0.05)  # fc1's FP8 hand-off to fc2 is now unfused


def test_many_threads_on_the_plan_get_the_single_threaded_outputs():
    torch.manual_seed(0)
    c = _convert(_stack(8, 16, "silu", True).eval(), torch.randn(1, 16))
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1 + i % 3, 16, generator=g) for i in range(6)]
    with torch.no_grad():
        expected = [c(x) for x in xs]
    failures: list[str] = []
    errors: list[BaseException] = []
    compared = [0] * 6
    start = threading.Barrier(6)

    def work(t: int) -> None:
        try:
            start.wait()
            with torch.no_grad():
                for k in range(3):
                    for i in (range(len(xs)) if (t + k) % 2 else reversed(range(len(xs)))):
                        if not torch.equal(c(xs[i]), expected[i]):
                            failures.append(f"thread {t} input {i}")
                        compared[t] += 1
        except BaseException as e:  # noqa: BLE001 - a crashed worker fails the test below, not silently
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert failures == [] and compared == [3 * len(xs)] * 6
