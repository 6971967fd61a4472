# memplan: `make demo` and `make test` work on a fresh machine (they install first).
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel of this torch lies on the build machines' disk; override for a GPU build, e.g.
# `make install TORCH='torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124'`.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.memplan-installed
THREADS ?= 1
# Test processes (pytest-xdist): two, the cores of the CI machine; each runs THREADS threads.
JOBS ?= 2

.PHONY: install demo test typecheck lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH) -e '.[dev]'
	$(BIN)/python -c 'from memplan.core.planners.optimal import warm_up; warm_up()'  # numba cache
	touch $(STAMP)

demo: install
	$(BIN)/memplan demo

test: install
	OMP_NUM_THREADS=$(THREADS) MEMPLAN_TEST_THREADS=$(THREADS) $(BIN)/python -m pytest -n $(JOBS) tests

typecheck: install
	$(BIN)/python -m mypy --strict src/memplan
	$(BIN)/python -m mypy --strict benchmarks

lint: install
	$(BIN)/python -m ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .hypothesis
