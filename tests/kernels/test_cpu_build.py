"""Building the C E4M3 kernels (kernels/cpu_build.py): compilers with arguments, failures remembered across
processes, no compiler spawned for a cached library, a cache folder that cannot be written, and what
cpu.describe() says."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from dbr_quant.kernels.cpu import build as cpu_build
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3
from dbr_quant.kernels.cpu import features as cpu

REPO = Path(__file__).resolve().parents[2]
SYSTEM_CC = shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A private cache folder and temp dir, the library read again before and after (the rest of the suite gets
    the normal one back)."""
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    for var in ("CC", cpu_build.RETRY_ENV, cpu_e4m3.ENV_VAR):
        monkeypatch.delenv(var, raising=False)
    cpu_e4m3.reset()
    yield tmp_path
    cpu_e4m3.reset()


def _load() -> tuple[bool, str, list[str]]:
    """(active, why, the RuntimeWarnings raised) for one fresh look-up in this process."""
    cpu_e4m3.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        active, why = cpu_e4m3.status()
    return active, why, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _works(lib) -> bool:
    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = torch.empty(256)
    lib.dbr_e4m3_to_fp32(q.data_ptr(), out.data_ptr(), 256)
    finite = torch.isfinite(q.float())
    return torch.equal(out[finite], q.float()[finite])


def _compilers_with_arguments() -> list[str]:
    found = [f"{SYSTEM_CC} -std=gnu11", f"{SYSTEM_CC} -O2 -Wall"]
    if shutil.which("ccache"):
        found.append(f"ccache {SYSTEM_CC}")
    return found


@pytest.mark.skipif(SYSTEM_CC is None, reason="needs a C compiler")
@pytest.mark.parametrize("cc", _compilers_with_arguments())
def test_a_compiler_with_arguments_builds(fresh, monkeypatch, cc):
    """CC is a command line (a wrapper, extra flags), split as a shell would: the kernels build and run."""
    monkeypatch.setenv("CC", cc)
    active, why, warned = _load()
    assert active and not warned, (why, warned)
    assert why.startswith(f"built with CC={cc!r} into {fresh / 'cache'}")
    assert _works(cpu_e4m3.library())


def test_a_cached_library_spawns_no_compiler(fresh, monkeypatch):
    """A process that finds the library built loads it: no compiler call (not even ``cc --version``)."""
    if SYSTEM_CC is None:
        pytest.skip("needs a C compiler")
    assert _load()[0]
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a) or pytest.fail(f"spawned {a}"))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: calls.append(a) or pytest.fail(f"spawned {a}"))
    active, why, warned = _load()
    assert active and why.startswith("loaded from ") and not calls and not warned
    assert _works(cpu_e4m3.library())


_PROBE = """
import json, warnings
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    active, why = cpu_e4m3.status()
print(json.dumps([active, why, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]]))
"""


def _fresh_process(env: dict[str, str]) -> tuple[bool, str, list[str]]:
    """status() in a new Python process with ``env`` on top of this one's (minus CC / the retry switch)."""
    base = {k: v for k, v in os.environ.items() if k not in ("CC", cpu_build.RETRY_ENV, cpu_e4m3.ENV_VAR)}
    done = subprocess.run([sys.executable, "-c", _PROBE], env={**base, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=300, check=True)
    active, why, warned = json.loads(done.stdout.strip().splitlines()[-1])
    return active, why, warned


@pytest.mark.slow  # four fresh Python processes (each imports torch): ~10 s on an idle machine
def test_a_failed_build_warns_once_and_is_remembered_across_processes(fresh, monkeypatch):
    """A compiler that fails (here: records each call, then fails) is run and warned about by the first
    process only; the next process reads the remembered failure and neither compiles nor warns; the retry
    switch compiles again. A compiler that does not exist: the same, one warning in all."""
    tmp_path = fresh
    log = tmp_path / "calls.log"
    bad = tmp_path / "bad-cc"
    bad.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\necho compiler says no >&2\nexit 1\n")
    bad.chmod(0o755)
    env = {cpu_build.CACHE_ENV: str(tmp_path / "cache"), "CC": str(bad), "TMPDIR": str(tmp_path)}
    active, why, warned = _fresh_process(env)
    calls = log.read_text().count("\n")
    assert not active and calls >= 1 and len(warned) == 1 and "compiler says no" in warned[0], (why, warned)
    active, why, warned = _fresh_process(env)
    assert not active and not warned and log.read_text().count("\n") == calls  # not run again
    assert "an earlier build failed (building with CC=" in why and "compiler says no" in why
    assert f"{cpu_build.RETRY_ENV}=1" in why and ".failed" in why
    for name, value in {**env, cpu_build.RETRY_ENV: "1"}.items():  # the retry, in this process
        monkeypatch.setenv(name, value)
    active, why, warned = _load()
    assert not active and len(warned) == 1 and log.read_text().count("\n") > calls

    env["CC"] = str(tmp_path / "no-such-cc")
    first, second = _fresh_process(env), _fresh_process(env)
    assert not first[0] and len(first[2]) == 1 and "no-such-cc" in first[2][0] and "could not run" in first[2][0]
    assert not second[0] and not second[2] and "an earlier build failed" in second[1]


def test_no_compiler_at_all_is_said_once(fresh, monkeypatch):
    monkeypatch.setenv("PATH", str(fresh / "empty"))
    active, why, warned = _load()
    assert not active and len(warned) == 1 and "no C compiler found" in warned[0]
    active, why, warned = _load()
    assert not active and not warned and "no C compiler found" in why


def test_an_unwritable_cache_falls_back_to_a_private_temp_folder(fresh, monkeypatch):
    """The configured cache cannot be written (a file where the folder should be: refused even to root): the
    library is built in a per-user temp folder. That folder must be this user's alone (a library found there is
    loaded into the process). Neither usable: the torch ops, with one warning naming both."""
    if SYSTEM_CC is None:
        pytest.skip("needs a C compiler")
    blocked = fresh / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(blocked))
    active, why, warned = _load()
    private = fresh / "tmp" / f"dbr_quant-{os.getuid()}"
    assert active and not warned and why.startswith("built with") and str(private) in why, (why, warned)
    assert (private.stat().st_mode & 0o777) == 0o700
    assert _load()[1].startswith(f"loaded from {private}")

    built = {p.name: p.read_bytes() for p in private.glob("*.so")}
    shutil.rmtree(private)
    private.mkdir(mode=0o777)
    private.chmod(0o777)  # anyone could have planted a library here: it is neither loaded nor built into
    for file_name, data in built.items():
        (private / file_name).write_bytes(data)
    active, why, warned = _load()
    assert not active and len(warned) == 1 and "no writable cache folder" in warned[0]
    assert str(blocked) in warned[0] and "not private to this user" in warned[0]
    assert sorted(p.name for p in private.iterdir()) == sorted(built)


def test_describe_says_whether_the_c_kernels_run(fresh, monkeypatch):
    monkeypatch.setenv(cpu_e4m3.ENV_VAR, "torch")
    cpu_e4m3.reset()
    assert cpu.describe().splitlines()[1] == ("C E4M3 kernels: inactive, torch ops instead (disabled by "
                                              f"{cpu_e4m3.ENV_VAR}=torch)")
    monkeypatch.delenv(cpu_e4m3.ENV_VAR)
    bad = fresh / "bad-cc"
    bad.write_text("#!/bin/sh\necho compiler says no >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    with pytest.warns(RuntimeWarning, match="compiler says no"):
        cpu_e4m3.reset()
        line = cpu.describe().splitlines()[1]
    assert line.startswith("C E4M3 kernels: inactive, torch ops instead (building with CC=") and "says no" in line
    if SYSTEM_CC is not None:
        monkeypatch.delenv("CC")
        cpu_e4m3.reset()
        assert cpu.describe().splitlines()[1].startswith("C E4M3 kernels: active (built with ")
