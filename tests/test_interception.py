"""Interception (dbr_quant/runtime/interception.py): a run's own work runs inside ``suspended()`` (torch's
``DisableTorchFunction``, the run's one switch), where module calls run the stock way; a run started inside such
a block (the caller's own guard, or code a run executes as written) intercepts its forward all the same."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
from dbr_quant.kernels import count_launches
from dbr_quant.runtime import interception
from dbr_quant.runtime.interception import suspended


def _converted() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(4, 16)
    prepared = dq.prepare(model, (x,))
    dq.calibrate(prepared, [(torch.randn(4, 16),) for _ in range(3)], progress=False)
    return dq.convert(prepared), x


def test_a_converted_model_called_inside_disable_torch_function_runs_in_fp8():
    converted, x = _converted()
    with torch.no_grad(), count_launches() as outside:
        expected = converted(x)
    with torch.no_grad(), count_launches() as inside, torch._C.DisableTorchFunction():
        got = converted(x)
        assert torch._C._is_torch_function_all_disabled()  # the caller's guard is back after the forward
    assert torch.equal(got, expected)
    assert inside == outside and outside["fp8_linear"] > 0


class _AsWritten(nn.Module):
    """A quantizable linear, then one that its forward calls inside ``suspended()``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = nn.Linear(16, 16)
        self.hidden = nn.Linear(16, 16)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = self.seen(t)
        with suspended():
            return self.hidden(h)


def test_module_calls_inside_a_suspension_run_as_written():
    """prepare() records no op inside ``suspended()`` and the converted model runs that linear the stock way (high
    precision, no kernel launch): only the other linear is FP8."""
    torch.manual_seed(0)
    model, x = _AsWritten(), torch.randn(4, 16)
    with pytest.warns(UserWarning, match="hidden: never called during prepare"):
        prepared = dq.prepare(model, (x,))
    dq.calibrate(prepared, [(torch.randn(4, 16),)], progress=False)
    with pytest.warns(UserWarning, match="hidden: never called during prepare"):
        converted = dq.convert(prepared)
    fp8 = {r["fqn"] for r in dq.report(converted) if r["fp8"]}
    assert fp8 == {"seen"}
    seen_out: list[torch.Tensor] = []
    converted.seen.register_forward_hook(lambda m, a, out: seen_out.append(out))
    with torch.no_grad(), count_launches() as n:
        out = converted(x)
    assert n["fp8_linear"] == 1  # seen's; hidden ran as written
    with torch.no_grad():
        assert torch.equal(out, F.linear(seen_out[0], model.hidden.weight, model.hidden.bias))


@pytest.mark.parametrize("inside_a_guard", [False, True])
@pytest.mark.parametrize("exc", [RuntimeError("mode refused"), KeyboardInterrupt()])
def test_a_failure_while_entering_the_interception_restores_global_state(monkeypatch, exc, inside_a_guard):
    """``intercepting`` patches ``Module._call_impl`` and sets this thread's run before it pushes its torch-function
    mode (and, inside the caller's DisableTorchFunction, switches torch functions on first): when that push fails,
    all of it is undone, and the next forward runs as before."""
    converted, x = _converted()
    with torch.no_grad():
        expected = converted(x)

    def refuse(mode):
        raise exc

    monkeypatch.setattr(interception._FunctionMode, "__enter__", refuse)
    guard = torch._C.DisableTorchFunction() if inside_a_guard else contextlib.nullcontext()
    with torch.no_grad(), guard:
        with pytest.raises(type(exc)):
            converted(x)
        assert torch._C._is_torch_function_all_disabled() == inside_a_guard  # the caller's guard as it was
    assert not interception.is_patched() and interception.current_run() is None
    assert torch._C._len_torch_function_stack() == 0
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(converted(x), expected)
