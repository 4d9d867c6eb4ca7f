"""The README's quickstart on a plain nn.Module, run by .ci/wheel_check.sh in a venv that holds only torch and
the built wheel with its declared dependencies: a dependency missing from setup.cfg fails here.

    python quickstart_check.py [--no-triton]

``--no-triton``: triton has been uninstalled (as on macOS/Windows, or a CPU-only Linux install); the reference
path must import and run without it.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import dbr_quant as dq
from dbr_quant.kernels.cpu import e4m3

# Need what the extras install (demo, offload): transformers, accelerate.
EXTRAS_ONLY = ("dbr_quant.examples",)


def _import_every_module(no_triton: bool) -> None:
    """Every module of the package imports with the declared dependencies (dbr_quant.inspect needs PyYAML, the
    Triton kernels triton), not only what ``import dbr_quant`` pulls in."""
    for info in pkgutil.walk_packages(dq.__path__, "dbr_quant."):
        if info.name.startswith(EXTRAS_ONLY) or (no_triton and info.name.startswith("dbr_quant.kernels.triton.")
                                                 and info.name != "dbr_quant.kernels.triton.backend"):
            continue
        importlib.import_module(info.name)


def _check_c_kernels() -> None:
    """The wheel ships the C sources (package data) and they build where the CPU backend runs: a missing
    csrc/e4m3.c would silently fall back to the slower torch ops."""
    assert e4m3.SOURCE.is_file(), f"{e4m3.SOURCE} is not in the installed wheel (setup.cfg [options.package_data])"
    active, why = e4m3.status()
    assert active, f"the C E4M3 kernels did not build from the installed wheel: {why}"
    print(f"C E4M3 kernels: {why}")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval()


def main(no_triton: bool) -> None:
    # The installed wheel, not a source tree next to the working directory.
    assert "site-packages" in Path(dq.__file__).parts, f"dbr_quant imported from {dq.__file__}, not the wheel"
    if no_triton:
        assert importlib.util.find_spec("triton") is None, "triton is still installed"
    assert "triton" not in sys.modules, "import dbr_quant imported triton (only the CUDA backend needs it)"

    torch.manual_seed(0)
    model = _model()
    batches = [torch.randn(16, 64) for _ in range(4)]
    prepared = dq.prepare(model, (batches[0],))
    dq.calibrate(prepared, batches)
    converted = dq.convert(prepared)
    rows = dq.report(converted)
    print(dq.format_report(rows))
    assert [r["fp8"] for r in rows if r["kind"] == "linear"] == [True, True], rows
    assert converted[0].weight.qdata.dtype == torch.float8_e4m3fn

    x = batches[1]
    with torch.no_grad():
        ref, out = model(x), converted(x)
    rel = ((out - ref).norm() / ref.norm()).item()
    print(f"relative error vs fp32: {rel:.4f}")
    assert 1e-4 < rel < 0.1, rel  # FP8 rounding is visible, and no more than FP8 rounding

    with tempfile.TemporaryDirectory() as folder:  # save/load call Tensor.numpy(): needs numpy installed
        dq.save_pretrained(converted, folder)
        loaded = dq.load_pretrained(folder, _model(), example_inputs=(x,))
        with torch.no_grad():
            assert torch.equal(loaded(x), out), "load_pretrained(save_pretrained(m)) differs from m"
    _import_every_module(no_triton)
    _check_c_kernels()
    print("quickstart ok" + (" (without triton)" if no_triton else ""))


if __name__ == "__main__":
    main(no_triton="--no-triton" in sys.argv[1:])
