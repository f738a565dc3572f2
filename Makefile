# lockstep: set-up and checks. Every target creates .venv in the repo root when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test test-fast typecheck clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test,plot]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/lockstep train

typecheck: install
	$(BIN)/mypy

# Two test tiers: `test-fast` runs the single-process tests (pytest -m "not slow", under a minute);
# `test` runs every test, the multi-process ones marked `slow` included, then the type checker.
test: install
	$(BIN)/python -m pytest -q tests
	$(BIN)/mypy

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
