#!/usr/bin/env bash
# Does the package install? Builds the wheel, installs it with its declared dependencies into a fresh venv
# that holds only torch, and runs the README's quickstart on a plain nn.Module there (.ci/quickstart_check.py)
# — once as installed, once after uninstalling triton (the CPU-only / macOS / Windows case). A dependency
# missing from setup.cfg's install_requires fails here; the dev venv has everything, so the test suite can't
# see it. `make test` runs it (`make wheel-check`). Usage: .ci/wheel_check.sh [python that builds the wheel]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_PY=${1:-.venv/bin/python}
WORK=build/wheel-check
TORCH=$(grep -E '^torch==' requirements-dev.txt)  # the torch CI tests with (a CPU build from the local wheels)
start=$SECONDS
rm -rf "$WORK" && mkdir -p "$WORK"
# The venv holds a torch (~1.5 GB): gone on every exit, so repeated runs and CI clones do not fill the disk.
trap 'rm -rf "$WORK/venv"' EXIT
# --no-build-isolation: the dev venv already has setuptools; isolation would fetch it again every run.
"$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation . -w "$WORK/dist"
python3 -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip install -q --no-cache-dir)
"${PIP[@]}" "$TORCH"
"${PIP[@]}" "$TORCH" "$WORK"/dist/dbr_quant-*.whl  # with its dependencies; torch stays the one above
# Run from outside the repository so `import dbr_quant` finds the installed wheel, not ./dbr_quant.
(cd "$WORK" && venv/bin/python ../../.ci/quickstart_check.py)
"$WORK/venv/bin/python" -m pip uninstall -q -y triton
(cd "$WORK" && venv/bin/python ../../.ci/quickstart_check.py --no-triton)
echo "wheel check passed in $((SECONDS - start)) s"
