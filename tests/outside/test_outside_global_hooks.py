"""Global module hooks (``torch.nn.modules.module.register_module_forward_hook`` / ``_pre_hook``: profilers,
activation-statistics tools) see every module call of a converted model — its linears included — and what
they return counts, as in the fp32 model."""

import warnings
from collections import Counter

import pytest
import torch
from outside_models import D, lin
from outside_pipeline import rel_l2
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import dbr_quant as dq


def _mlp() -> nn.Module:
    return nn.Sequential(lin(), nn.GELU(), lin(), nn.ReLU(), lin()).eval()


def _converted(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, (torch.randn(4, D),))
        dq.calibrate(prepared, [torch.randn(4, D) for _ in range(3)], progress=False)
        return dq.convert(prepared)


def _halving_hook(kind: str, calls: Counter):
    if kind == "forward":
        def hook(mod, args, out):
            calls[type(mod).__name__] += 1
            return out * 0.5 if isinstance(mod, nn.Linear) else None
        return register_module_forward_hook(hook)

    def pre_hook(mod, args):
        calls[type(mod).__name__] += 1
        return (args[0] * 0.5,) if isinstance(mod, nn.Linear) else None
    return register_module_forward_pre_hook(pre_hook)


@pytest.mark.parametrize("kind", ["forward", "pre"])
@pytest.mark.parametrize("path", ["converted", "disabled"])
def test_global_hook_sees_and_changes_linears(kind, path):
    model = _mlp()
    converted = _converted(model)
    x = torch.randn(4, D)
    calls: Counter = Counter()
    handle = _halving_hook(kind, calls)
    try:
        with torch.no_grad():
            want = model(x)
            fp32_calls = dict(calls)
            calls.clear()
            if path == "disabled":
                with dq.disabled():
                    got = converted(x)
            else:
                got = converted(x)
    finally:
        handle.remove()
    assert dict(calls) == fp32_calls
    assert rel_l2(got, want) < 0.1


def test_global_hook_during_calibration_sees_linears():
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, (torch.randn(4, D),))
    calls: Counter = Counter()
    handle = register_module_forward_hook(lambda mod, args, out: calls.update([type(mod).__name__]))
    try:
        dq.calibrate(prepared, [torch.randn(4, D)], progress=False)
    finally:
        handle.remove()
    assert calls["Linear"] == 3
