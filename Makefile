# lockstep: set-up and checks. Every target creates .venv in the repo root when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test typecheck clean

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

test: install
	$(BIN)/python -m pytest -q tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
