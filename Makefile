# The README's two commands: `make demo` and `make test`. Both set up a virtual environment first.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: setup demo demo-figures test test-slow test-all bench clean

setup: $(STAMP)

# NB: torch 2.13.0 is installed on its own first: it resolves to the CPU build on disk here, whereas
# a bare `torch>=2.6` requirement with no torch present would pull several GB of CUDA wheels.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# results go to out/ (ignored by git)
demo: setup
	$(PY) -m adjoint_compile.cli demo

# regenerates the checked-in benchmarks/results/demo.{json,png} (on purpose only)
demo-figures: setup
	$(PY) -m adjoint_compile.cli demo --out benchmarks/results

# NB: one process per core, at most 4: most of a test's time is dynamo and the inner compiler in one thread (on
# CI's 2 cores `make test` takes 60% of its time in one process)
XDIST ?= -n auto --maxprocesses 4

# everything but the tests marked slow: about 20 minutes on 2 cores
test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) -m "not slow" tests

# the tests marked slow (real libraries, whole models compiled with inductor, many lengths, each > 7 s on 2 cores);
# CI (.ci/run) runs them after `make test`
test-slow: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) -m slow tests

test-all: test test-slow

bench: setup
	$(PY) benchmarks/scan.py

clean:
	rm -rf $(VENV) build *.egg-info
