# lockstep: set-up and checks. Every target creates .venv in the repo root when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
USER_STAMP := $(VENV)/.installed-user
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: install dev peers streaming-peers demo test test-fast typecheck lint docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Two installs: `make install` is a user's (lockstep and the packages it needs to run: torch,
# torchvision, numpy, scikit-learn, tqdm); `make dev` adds the test, plot and docs extras (pytest,
# mypy, ruff, a real S3 server, TensorBoard, MLflow, W&B, matplotlib, MkDocs), which every check
# below needs; `make peers` adds Lightning and Accelerate, the peers benchmarks/overhead.py measures;
# `make streaming-peers` builds .venv-streaming for benchmarks/streamed_data.py.
$(USER_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $(USER_STAMP)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test,plot,docs]'
	touch $(USER_STAMP) $(STAMP)

install: $(USER_STAMP)

dev: $(STAMP)

peers: dev
	$(BIN)/pip install -q -e '.[peers]'

# benchmarks/streamed_data.py's peers (Mosaic Streaming, litData) in an environment of their own:
# Mosaic Streaming pins numpy below the one the checks use. The weed binary serves S3 to both.
streaming-peers:
	$(PY) -m venv .venv-streaming
	.venv-streaming/bin/pip install -q -e '.[streaming-peers]'

demo: install
	$(BIN)/lockstep train

typecheck: dev
	$(BIN)/mypy

# ruff's lint and format checks (settings in pyproject.toml); `ruff format .` applies the format.
lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Test tiers: `test-fast` runs the single-process tests (pytest -m "not slow", under a minute);
# `test` runs every test but the end-to-end runs (the multi-process ones marked `slow` included,
# the docs' build and examples too), then the type checker; `test-e2e` runs whole commands end to
# end (`lockstep train`, a requeued job, the benchmark scripts: tests marked `e2e`), and
# `test-engines` runs them and then lockstep under the real engines. `make test` runs on
# TEST_WORKERS pytest-xdist workers (3 by default, one more than 2 cores: the multi-process tests
# wait on sockets, timeouts and child processes as much as they compute), `make test-e2e` on
# E2E_WORKERS (2: its whole commands start several processes each); 0 runs them one after another.
TEST_WORKERS ?= 3
E2E_WORKERS ?= 2
# --durations=20 prints the 20 slowest tests of every run (CI's too).
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not e2e" --durations=20 tests
	$(BIN)/mypy

# Planted bugs (tests/mutations/*.patch: each breaks one guarantee the README makes): each is
# applied to a copy of the tree and the tests named for it must fail. Prints caught / missed per
# mutation and the total; exits non-zero unless every one was caught. Not part of `make test`
# (tens of minutes); `make test` only checks that every patch still applies.
.PHONY: test-mutations
test-mutations: dev
	$(BIN)/python tests/mutations/run.py

.PHONY: test-e2e
test-e2e: dev
	$(BIN)/python -m pytest -q -n $(E2E_WORKERS) -m e2e --durations=20 tests

# The multi-process tests STRESS_RUNS times in a row (5 by default) while a CPU hog keeps both cores
# busy (stress-ng --cpu 2 where installed, else two busy Python processes); fails on the first
# failure. STRESS_TESTS picks the tests (pytest arguments; default: every multi-process test of
# make test). Prints one line per run. Hours on 2 cores for the default set; name a subset to go faster.
STRESS_RUNS ?= 5
STRESS_TESTS ?= -m "slow and not e2e" tests
.PHONY: test-stress
test-stress: dev
	tools/stress.sh $(BIN)/python $(STRESS_RUNS) $(STRESS_TESTS)

# The documentation site (MkDocs, Material theme, API reference by mkdocstrings) into build/docs;
# --strict: a broken link, a missing page or an unresolved reference fails it. tests/lockstep/test_docs.py
# runs the same build in `make test`, and runs the docs' marked examples.
docs: dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/docs

# The fast tier on FAST_WORKERS pytest-xdist workers (2, one per core here: its tests compute, they do not wait).
FAST_WORKERS ?= 2
test-fast: dev
	$(BIN)/python -m pytest -q -n $(FAST_WORKERS) -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# Optional: Horovod 0.28.1 built from its sdist for the torch in .venv, gloo ops (NCCL ops too
# where nvcc, nccl.h and a GPU are present). The wheel is cached in ~/.cache/lockstep/horovod per
# torch version: the first build takes minutes, later ones seconds. Not part of `make demo`.
.PHONY: horovod
horovod: dev
	tools/build_horovod.sh $(BIN)/python

# lockstep under the real engines, on two network-namespace hosts: Slurm (srun, sbatch, scancel and
# requeue), OpenMPI, Ray Train, a Kubeflow PyTorchJob's pods, `lockstep run` across hosts. Needs root;
# installs slurm-wlm, munge, openmpi-bin (apt) and ray[train] (pip) when missing; without root or
# network namespaces it cannot run: one line says why and it fails (make reports the script's
# exit 3; .ci/run tells that apart from a failed scenario). 6 to 20 minutes on 2 cores (more when busy); logs in build/test-engines/.
.PHONY: test-engines
test-engines: test-e2e
	bash tests/engines/run.sh
