"""Fixtures shared by the kernel tests."""

import pytest

from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3


@pytest.fixture(params=["c", "torch"])
def decode(request, monkeypatch):
    """The C E4M3 kernels, or the torch ops in their place."""
    monkeypatch.setenv(cpu_e4m3.ENV_VAR, request.param)
    cpu_e4m3.reset()
    if request.param == "c" and cpu_e4m3.library() is None:
        pytest.fail("the C E4M3 kernels did not build (a C compiler is part of the dev setup)")
    yield request.param
    monkeypatch.undo()
    cpu_e4m3.reset()
