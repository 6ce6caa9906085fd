# One command runs the product on its embedded default, one runs the whole test suite.
# Each creates the virtual environment and installs what it needs by itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: demo test lint unit bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## make demo: 4 simulated engines + the exporter on http://127.0.0.1:9400/
demo: $(STAMP)
	$(PY) -m exporter demo $(DEMO_ARGS)

## make test: lint, type check and the whole test suite (2 workers)
test: $(STAMP) lint
	$(PY) -m pytest -n 2 -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check exporter tests bench tools
	$(PY) -m ruff format --check exporter
	$(PY) -m mypy

## make bench: benchmarks against simulated engines; writes docs/benchmarks.md
BENCH_ARGS ?= --compare docs/benchmarks-before.md
bench: $(STAMP)
	$(PY) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache build *.egg-info
