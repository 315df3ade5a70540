# `make demo` and `make test` set up .venv (TensorFlow, Keras, the package
# with its compiled op library) on first use, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed
BUILT := $(VENV)/.sok-built
CSRC := $(shell find csrc -name '*.cc' -o -name '*.c' -o -name '*.h' -o -name '*.cuh')
NP ?= 2
# pytest-xdist workers: the multi-rank jobs wait on each other's startup
# and on deadlines, so with three of them two cores stay busy.
TEST_WORKERS ?= 3
# Ranks of the multi-process tests are forked from a server that has
# TensorFlow imported (tests/forkserver.py); 0 starts each one cold.
SOK_TEST_FORKSERVER ?= 1

.PHONY: demo test bench build clean

$(DEPS): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

$(BUILT): $(DEPS) setup.py setup.cfg pyproject.toml $(CSRC)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(BUILT)

demo: $(BUILT)
	TF_CPP_MIN_LOG_LEVEL=2 $(VENV)/bin/sokrun -np $(NP) --timeout 900 $(PY) -m sok_keras.examples.train_dlrm

test: $(BUILT)
	$(VENV)/bin/ruff check --select F sok_keras tests bench setup.py sokrun.py
	SOK_TEST_FORKSERVER=$(SOK_TEST_FORKSERVER) $(PY) -m pytest -q \
		-n $(TEST_WORKERS) --durations=15 tests

bench: $(BUILT)
	$(PY) bench/run_all.py

clean:
	rm -rf build *.egg-info sok_keras/_sok_ops*.so sok_keras/_build_info.py
