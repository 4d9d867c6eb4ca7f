"""Building the C E4M3 kernels (``csrc/e4m3.c``, loaded by :mod:`dbr_quant.kernels.cpu.e4m3`) with the system C
compiler, and caching the result.

* The compiler: ``$CC`` split like a shell would (``CC="ccache gcc"``, ``CC="gcc -std=gnu11"``), else the
  first of cc, gcc, clang on PATH.
* The cache key: the source, the compiler command, the identity of every executable in it (resolved path,
  size, modification time: a compiler upgrade replaces the file), the flags, this CPU's feature flags and
  torch's OpenMP runtime. Nothing is spawned to compute it, so a process that finds the library built only
  loads it (``cc --version`` would cost every process a few ms of fork + exec).
* Where: ``$DBR_QUANT_CACHE_DIR``, else ``$XDG_CACHE_HOME/dbr_quant`` (``~/.cache/dbr_quant``); where that
  cannot be written (read-only home, a file in the way), a per-user folder in the temp dir (created 0700 and
  used only if this user owns it and no one else can write it: a library found there is loaded into the
  process).
* A failed build is remembered: a marker ``e4m3_<key>.failed`` next to where the library would be, holding
  the compiler's message. Later processes read it and take the torch path without compiling or warning
  again; ``DBR_QUANT_CPU_REBUILD=1`` (or deleting the marker) retries. A different compiler or source is
  another key, so it is tried afresh.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

RETRY_ENV = "DBR_QUANT_CPU_REBUILD"  # "1": build again even where an earlier build failed
CACHE_ENV = "DBR_QUANT_CACHE_DIR"


@dataclass(frozen=True)
class Outcome:
    """What a build attempt gave: the library's path (None: unavailable), why, and whether this process is the
    one that found out about the failure (and so should warn; a remembered failure stays quiet)."""

    path: Path | None
    reason: str
    news: bool = False


def compiler_command() -> tuple[list[str] | None, str]:
    """(the compiler as an argument list, where it came from), or (None, why there is none)."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            argv = shlex.split(cc)
        except ValueError as e:
            return None, f"CC={cc!r} is not a valid command line ({e})"
        return (argv, f"CC={cc!r}") if argv else (None, f"CC={cc!r} names no command")
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found], found
    return None, "no C compiler found (CC is unset and there is no cc, gcc or clang on PATH)"


def _identity(argv: list[str] | None) -> list[str]:
    """What keys the cache for this compiler without running it: each word of the command that names an
    executable (the compiler, a wrapper like ccache), by resolved path, size and modification time."""
    if argv is None:
        return ["<no compiler>", os.environ.get("PATH", "")]
    parts = list(argv)
    for word in argv:
        found = None if word.startswith("-") else shutil.which(word)
        if found is None:
            continue
        real = os.path.realpath(found)
        try:
            st = os.stat(real)
        except OSError:
            continue
        parts.append(f"{real}:{st.st_size}:{st.st_mtime_ns}")
    return parts


def cache_key(source: str, argv: list[str] | None, flags: tuple[str, ...], extra: list[str]) -> str:
    return hashlib.sha256("\0".join([source, *_identity(argv), *flags, *extra]).encode()).hexdigest()[:20]


def configured_cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dbr_quant")
    return Path(base)


def _user_temp_dir() -> Path:
    user = str(os.getuid()) if hasattr(os, "getuid") else (os.environ.get("USERNAME") or "user")
    return Path(tempfile.gettempdir()) / f"dbr_quant-{user}"


def cache_dirs() -> list[Path]:
    """Where the library may be, in order: the configured cache, then the per-user temp fallback."""
    return [configured_cache_dir(), _user_temp_dir()]


def _check_private(folder: Path) -> None:
    """Raise PermissionError unless ``folder`` is this user's alone (a shared temp dir: anyone could have made it
    and planted a library there, which would be loaded into the process); OSError if it cannot be read."""
    if not hasattr(os, "getuid"):
        return
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{folder} is not private to this user (owner uid {st.st_uid}, mode "
                              f"{oct(st.st_mode & 0o777)})")


def _trusted(folder: Path, private: bool) -> bool:
    try:
        if private:
            _check_private(folder)
        return True
    except OSError:
        return False


def _prepare(folder: Path, private: bool) -> None:
    """Create ``folder`` (raises OSError where that is impossible); a private (temp) one must be this user's
    alone."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o777)
    if private:
        _check_private(folder)


def _run(argv: list[str]) -> tuple[bool, str]:
    """Run one compiler step: (succeeded, its error output or why it could not start)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{shlex.join(argv[:1])} could not run: {e}"
    return done.returncode == 0, done.stderr.strip()


def _compile(argv: list[str], source: str, flags: tuple[str, ...], omp: Path | None, target: Path) -> tuple[bool, str]:
    """Build into ``target`` atomically (concurrent builders never load a half-written file). With ``omp``:
    compile with -fopenmp and link against that runtime file only (not the compiler's own libgomp).
    Raises OSError when the folder cannot be written (the caller tries the next one)."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, obj, out = Path(tmp) / "e4m3.c", Path(tmp) / "e4m3.o", Path(tmp) / "e4m3.so"
        src.write_text(source)
        compile_flags = [f for f in flags if f != "-shared"] + (["-fopenmp"] if omp else [])
        ok, err = _run([*argv, *compile_flags, "-c", "-o", str(obj), str(src)])
        if ok:
            ok, err = _run([*argv, "-shared", "-o", str(out), str(obj), *([str(omp)] if omp else [])])
        if ok:
            os.replace(out, target)
        return ok, err


def build(source: str, flags: tuple[str, ...], extra: list[str], omp: Path | None) -> Outcome:
    """The library for ``source`` built with ``flags``: found in a cache folder (nothing spawned), or built
    into the first writable one; else why not. ``extra``: more strings for the key (CPU flags, runtime)."""
    argv, origin = compiler_command()
    key = cache_key(source, argv, flags, [*extra, str(omp)])
    name, marker = f"e4m3_{key}.so", f"e4m3_{key}.failed"
    folders = cache_dirs()
    trusted = [f for i, f in enumerate(folders) if _trusted(f, private=i > 0)]
    for folder in trusted:
        if (folder / name).is_file():
            return Outcome(folder / name, f"loaded from {folder / name}")
    retry = os.environ.get(RETRY_ENV, "").strip() not in ("", "0")
    for folder in trusted:
        if not retry and (folder / marker).is_file():
            try:
                said = (folder / marker).read_text().strip().splitlines()[0][:300]
            except (OSError, IndexError):
                said = "(no message)"
            return Outcome(None, f"an earlier build failed ({said}); to retry set {RETRY_ENV}=1 or delete "
                                 f"{folder / marker}")
    unusable = []
    for i, folder in enumerate(folders):
        try:
            _prepare(folder, private=i > 0)
            if argv is None:
                ok, err = False, origin
            else:
                ok, err = _compile(argv, source, flags, omp, folder / name)
                if not ok and omp is not None:  # no OpenMP in this compiler: one thread per pass
                    ok, err = _compile(argv, source, flags, None, folder / name)
        except OSError as e:
            unusable.append(f"{folder}: {e}")
            continue
        if ok:
            return Outcome(folder / name, f"built with {origin} into {folder / name}")
        what = origin if argv is None else f"building with {origin} failed: {err[:500] or 'no message'}"
        try:
            (folder / marker).write_text(what + "\n")
            remembered = f"remembered in {folder / marker}; set {RETRY_ENV}=1 or delete it to retry"
        except OSError:
            remembered = "not remembered (cannot write the cache)"
        return Outcome(None, f"{what} ({remembered})", news=True)
    return Outcome(None, "no writable cache folder for the built library (" + "; ".join(unusable) + f"); set "
                         f"{CACHE_ENV} to a writable folder", news=True)
