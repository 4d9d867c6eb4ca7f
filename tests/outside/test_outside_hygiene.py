"""What a foreign suite checks around the numbers: the user's model is left alone, and an exception inside the
model's forward (during prepare, calibrate, a converted forward or a half-done fused subgraph) leaves
``nn.Module.__call__``, ``Module._call_impl`` and the torch-function mode stack as they were."""

import threading

import pytest
import torch
import torch.nn.functional as F
from outside_models import CASES, D, lin
from outside_pipeline import Snapshot, assert_close_to_fp32, converted_case, rel_l2
from torch import nn
from torch.overrides import TorchFunctionMode

import dbr_quant as dq
from dbr_quant.quantize.weights import FP8Weight

STOCK_CALL, STOCK_CALL_IMPL = nn.Module.__call__, nn.Module._call_impl


class Boom(Exception):
    pass


class MaybeBoom(nn.Module):
    """An MLP (a → relu → b, one fused subgraph once converted) that raises between its two linears when told."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x, boom: bool = False):
        h = self.a(x)
        if boom:
            raise Boom("raised inside forward")
        return self.b(F.relu(h)).flatten(1)  # an op of the model's own that no FP8 kernel takes over


def assert_global_state_clean() -> None:
    assert nn.Module.__call__ is STOCK_CALL and nn.Module._call_impl is STOCK_CALL_IMPL
    assert torch._C._len_torch_function_stack() == 0


def _calibrated() -> tuple[nn.Module, nn.Module]:
    model = MaybeBoom().eval()
    prepared = dq.prepare(model, (torch.randn(4, D),))
    dq.calibrate(prepared, [torch.randn(4, D) for _ in range(3)], progress=False)
    return model, prepared


def test_prepare_raising_forward_restores_state_and_model():
    model = MaybeBoom().eval()
    before = Snapshot.of(model)
    with pytest.raises(dq.PrepareError, match="Boom") as info:
        dq.prepare(model, (torch.randn(4, D),), example_kwargs={"boom": True})
    assert isinstance(info.value.__cause__, Boom)
    assert_global_state_clean()
    before.assert_same(model)
    prepared = dq.prepare(model, (torch.randn(4, D),), inplace=True)  # inplace after a failed attempt: still works
    assert prepared is model


def test_prepare_inplace_raising_forward_undoes_everything():
    model = MaybeBoom().eval()
    before = Snapshot.of(model)
    with pytest.raises(dq.PrepareError):
        dq.prepare(model, (torch.randn(4, D),), example_kwargs={"boom": True}, inplace=True)
    assert_global_state_clean()
    before.assert_same(model)  # no _dbr_* attribute, no forward wrapper left behind


def test_calibrate_raising_forward_restores_state_and_keeps_calibrating():
    model, prepared = _calibrated()
    with pytest.raises(Boom):
        dq.calibrate(prepared, [((torch.randn(4, D), True))], progress=False)
    assert_global_state_clean()
    with pytest.raises(KeyboardInterrupt):  # not an Exception: the finally blocks must still run
        with torch.no_grad():
            prepared.a.register_forward_hook(_interrupt)
            try:
                prepared(torch.randn(4, D))
            finally:
                prepared.a._forward_hooks.clear()
    assert_global_state_clean()
    dq.calibrate(prepared, [torch.randn(4, D)], progress=False)
    converted = dq.convert(prepared)
    x = torch.randn(4, D)
    with torch.no_grad():
        assert_close_to_fp32(converted(x), model(x), "after exceptions during calibrate")


def _interrupt(module, args, out):
    raise KeyboardInterrupt


def test_converted_forward_raising_inside_a_fused_subgraph():
    """The converted MLP is pending (a's output is a placeholder) when the forward raises: the next forward
    must not see that half-done subgraph."""
    model, prepared = _calibrated()
    converted = dq.convert(prepared)
    x = torch.randn(4, D)
    with torch.no_grad():
        first = converted(x)
        with pytest.raises(Boom):
            converted(x, boom=True)
        assert_global_state_clean()
        again = converted(x)
        assert torch.equal(again, first)
        assert_close_to_fp32(again, model(x), "after an exception in a converted forward")


def test_user_torch_function_mode_around_converted_forward():
    """A user's own TorchFunctionMode (a profiler, a tracer) around a converted forward stays on the stack,
    sees the model's ops that no FP8 kernel took over, and is the only mode left after an exception."""
    model, prepared = _calibrated()
    converted = dq.convert(prepared)

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, D)
    with torch.no_grad(), Counting():
        out = converted(x)
        with pytest.raises(Boom):
            converted(x, boom=True)
        assert torch._C._len_torch_function_stack() == 1
    assert Counting.calls > 0
    assert_global_state_clean()
    with torch.no_grad():
        assert_close_to_fp32(out, model(x), "under a user's TorchFunctionMode")


def test_exception_in_one_thread_does_not_disturb_another():
    """Thread A's forward raises while thread B converts and runs: B's result is the single-threaded one."""
    model, prepared = _calibrated()
    converted = dq.convert(prepared)
    x = torch.randn(4, D)
    with torch.no_grad():
        want = converted(x)
    results, errors = [], []

    def worker(boom: bool) -> None:
        try:
            with torch.no_grad():
                for _ in range(20):
                    if boom:
                        with pytest.raises(Boom):
                            converted(x, boom=True)
                    else:
                        results.append(converted(x))
        except BaseException as e:  # collected: a thread's failure must fail the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(b,)) for b in (True, False, True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 40 and all(torch.equal(r, want) for r in results)
    assert_global_state_clean()


@pytest.mark.parametrize("case", [c.param() for c in CASES if c.name in ("nested_containers", "forward_hooks",
                                                                            "shared_child", "buffers")])
def test_user_model_unchanged_and_converted_independent(case):
    """prepare/convert copy: the user's model keeps its tensors, attributes, hooks and classes, and running
    or editing the converted model afterwards does not reach back into it."""
    torch.manual_seed(0)
    before = Snapshot.of(case.build().eval())
    model, converted = converted_case(case)
    before.assert_same(model)
    args, kwargs = case.inputs(torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(*args, **kwargs)
        converted(*args, **kwargs)
        for p in converted.parameters():
            if not isinstance(p, FP8Weight):
                p.add_(1.0)
        again = model(*args, **kwargs)
    before.assert_same(model)
    for a, b in zip(*(torch.utils._pytree.tree_leaves(o) for o in (want, again))):
        assert rel_l2(a, b) == 0.0
