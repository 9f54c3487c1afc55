# nograd: two commands on a fresh machine — `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The constraints file pins the CPU build of torch so a machine without a GPU never pulls CUDA.
PIP := $(BIN)/python -m pip
PIP_INSTALL := $(PIP) install --disable-pip-version-check -c constraints.txt
PYTEST_ARGS ?=

.PHONY: install install-dev run test test-slow lint format bench soak container-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Stamps make repeated `make test` cheap: pip runs again only when the dependency list changes.
$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP_INSTALL) -e '.[onnx]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml constraints.txt
	$(PIP_INSTALL) -e '.[dev]'
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# An editable install leaves nograd's modules uncompiled, and an environment with
# PYTHONDONTWRITEBYTECODE set never caches them: every process of the server (engine, fronts,
# workers) compiled all of them at each start. Compiled here once (only what changed since).
COMPILE := $(BIN)/python -m compileall -q nograd

run: install
	@$(COMPILE)
	$(BIN)/nograd

# Two passes: the tests that bound no time or memory on two workers (most wait on a server they
# started), then the `serial` ones alone (tests/conftest.py lists them); the wall time at the end.
# The first pass hands out whole files, the longest first (tests/conftest.py, LONGEST_FIRST).
# Beside it, a lane of its own runs the `waiting` files (mostly timers and paced clients, little
# CPU), so that their waits do not hold one of its workers; its output follows the first pass's.
# All share one engine cache, made for the run and removed after it: the serial pass's servers
# open the engines and memory profiles the first pass's servers measured.
# A pass that PYTEST_ARGS leaves without a test (pytest's exit 5) does not fail the target.
# TEST_WORKERS=0 runs the first pass in one process too.
# Bytecode is cached for the run whatever PYTHONDONTWRITEBYTECODE says: each server the suite
# starts, and each pass's collection (pytest's rewritten test modules), reads it instead of
# compiling again.
TEST_WORKERS ?= 2
# The files a marked pass collects (tests/conftest.py's SERIAL or WAITING) when PYTEST_ARGS names
# none: collecting only them, instead of the whole suite to deselect most of it, saves seconds.
MARKED = $(BIN)/python -c 'import sys, tests.conftest as c; print(*sorted({e.split("::")[0] for e in getattr(c, sys.argv[1])}))'

test: install-dev
	@started=$$(date +%s); engines=$$(mktemp -d -t nograd-test-engines-XXXXXX); \
	lane=$$(mktemp -d -t nograd-test-waiting-XXXXXX); \
	unset PYTHONDONTWRITEBYTECODE; $(COMPILE); \
	export NOGRAD_ENGINE_CACHE="$${NOGRAD_ENGINE_CACHE:-$$engines}"; \
	$(BIN)/python -m pytest -m "waiting and not slow and not serial" -n 1 -p no:cacheprovider \
		--basetemp "$$lane/tmp" --durations=10 $(or $(PYTEST_ARGS),$$($(MARKED) WAITING)) \
		> "$$lane/log" 2>&1 & waiting=$$!; \
	trap 'kill $$waiting 2>/dev/null; exit 130' INT TERM; \
	$(BIN)/python -m pytest -m "not slow and not serial and not waiting" -n $(TEST_WORKERS) \
		--dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS); parallel=$$?; \
	wait $$waiting; waited=$$?; echo "--- the waiting lane:"; cat "$$lane/log"; \
	$(BIN)/python -m pytest -m "serial and not slow" --durations=25 \
		$(or $(PYTEST_ARGS),$$($(MARKED) SERIAL)); serial=$$?; \
	rm -rf "$$engines" "$$lane"; \
	echo "make test: $$(( $$(date +%s) - started ))s wall (parallel pass exit $$parallel, waiting lane exit $$waited, serial pass exit $$serial)"; \
	for code in $$parallel $$waited $$serial; do [ $$code -eq 0 ] || [ $$code -eq 5 ] || exit $$code; done

test-slow: install-dev
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python scripts/check_structure.py

format: install-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# --- make bench --------------------------------------------------------------------------------
# nograd against the raw model, plain FastAPI, LitServe, the HTTP ceiling and the real peers
# (Triton through PyTriton, TorchServe, infinity), in one run (bench/run.py and bench/phases/;
# tables in bench/results/<timestamp>.md, quoted by BENCHMARKS.md). The peers' pinned venvs are
# built by the run itself under bench/.peers/ (bench/peers/envs.py), once.
# Takes ~90 minutes on 2 cores; `make bench BENCH_ARGS=--quick` is a shorter smoke run.
# wrk and Java (TorchServe) are Debian packages: installed here when missing (as root, or sudo).
BENCH_ARGS ?=

$(VENV)/.installed-bench: $(VENV)/.installed pyproject.toml constraints.txt
	$(PIP_INSTALL) -e '.[bench]'
	touch $@

bench: $(VENV)/.installed-bench
	bash scripts/install_debian_package.sh wrk wrk
	bash scripts/install_debian_package.sh openjdk-17-jre-headless java
	bash scripts/install_debian_package.sh haproxy haproxy
	$(BIN)/python -m bench.run $(BENCH_ARGS)

container-test:
	bash scripts/container_test.sh

# A 10-minute steady-load run (not part of CI): memory must stay flat and nothing may fail.
soak: install-dev
	$(BIN)/python scripts/soak.py --minutes $${SOAK_MINUTES:-10}

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
