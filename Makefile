# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test soak ui install bytecode lock

# The run's set and the test set, exact and hashed (requirements.txt, requirements-test.txt: `make lock` writes both
# from pyproject.toml), installed by uv, which checks every file it fetches against its hash; --no-deps, the lock being
# the whole set, and the project itself last with --no-deps too, so nothing outside the lock is installed (a package
# already installed at the lock's version stays: a CUDA torch 2.13.0 put there first, README "torch builds"). uv because it is faster here: a fresh run's set in 176-237 s
# against pip's 567 s on this machine, shared (docs/training.md, "Dependencies"). uv does not read pip's configuration:
# the find-links pip is given here (this machine's CPU torch wheel) is passed on. Every package is byte-compiled as it
# installs (keep it: where PYTHONDONTWRITEBYTECODE is set, as on the development machines, nothing writes a .pyc
# later, and every process would compile torch and Ray from source at each import)
UV_VERSION := 0.13.9
PIP_FIND_LINKS := $(shell $(PY) -m pip config get global.find-links 2>/dev/null)
UV_INSTALL = $(BIN)/uv pip install -q --no-deps --compile-bytecode --python $(BIN)/python \
	$(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)
	$(UV_INSTALL) -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# make test's additions: the extras s3, hf and test, at the same pins as the run's set
TEST_STAMP := $(VENV)/.installed-test
$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(UV_INSTALL) -r requirements-test.txt
	touch $(TEST_STAMP)

# Regenerate both locks (with the venv's uv, which make installs, or one on PATH). One resolution: the test set first, then the run's set
# constrained by it, so the pins agree (uv keeps the files' other pins unless pyproject.toml rules them out; delete
# the two files to move everything to its newest release). torch is held at the CPU wheel on this machine's disk
# (/opt/wheels; PyPI's linux torch is the CUDA build and pulls the nvidia-* wheels); its local label (+cpu) is dropped
# at the end so that the line also accepts a CUDA torch 2.13.0 installed first (README, "torch builds"). The test
# set keeps extras on its lines (pip's hash-checking mode wants typepy[datetime] pinned as such); the run's set has
# none, so that it also serves as pip constraints (the wheel test, a cluster image).
UV ?= $(if $(wildcard $(BIN)/uv),$(BIN)/uv,uv)
LOCK_OPTS = --quiet --generate-hashes --find-links /opt/wheels --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock"
lock:
	echo 'torch==2.13.0+cpu' | $(UV) pip compile pyproject.toml --extra test $(LOCK_OPTS) --no-strip-extras \
	  -c /dev/stdin -o requirements-test.txt
	$(UV) pip compile pyproject.toml $(LOCK_OPTS) -c requirements-test.txt -o requirements.txt
	sed -i 's/^torch==\([0-9.]*\)+cpu /torch==\1 /' requirements.txt requirements-test.txt

install: $(STAMP)

# The project's own modules byte-compiled (stale ones only: well under a second), for the same reason: a run starts
# dozens of Ray worker processes that import them, each compiling ~140 files from source when no .pyc is written
# (0.4 CPU s of a tiny 2-worker run's 23)
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q minimind_ray pipelines

## the main job: pretrain then SFT on the built-in demo corpus, then a chat sample
demo: bytecode
	$(BIN)/python -m pipelines.demo

## the test suite (what .ci/run calls), on TEST_WORKERS pytest-xdist processes (one test file per process at a time;
## the files that start a Ray of their own run one after another in one process, heaviest files first:
## tests/conftest.py). TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
test: bytecode $(TEST_STAMP)
	$(BIN)/python -m pytest -q --durations=30 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) tests

## the checks `make test` leaves out (tests/soak/, marker `soak`): the chaos soak and the chaos table (minutes to an
## hour each), GGUF files read back by llama.cpp (needs llama-cpp-python), the GPU checks (need CUDA; the Ray one also
## rehearses on CPU), RL's learning margins over seeds. Tables print as they come (-s). SOAK=tests/soak/test_gguf.py picks
## one file; pytest options after it, e.g. make soak SOAK="tests/soak/test_chaos_soak.py --soak-runs 3"
SOAK ?= tests/soak
soak: bytecode
	$(BIN)/python -m pytest -q -s -m soak $(SOAK)

## the MLflow UI over the default local store, on 127.0.0.1 only; the link opens the experiments in MLflow's
## 'Model training' view (its home opens the GenAI one). MLflow's telemetry is off (its own switches,
## MLFLOW_DISABLE_TELEMETRY and DO_NOT_TRACK; `make ui MLFLOW_DISABLE_TELEMETRY=false` turns it back on)
MLFLOW_DISABLE_TELEMETRY ?= true
DO_NOT_TRACK ?= true
ui: $(STAMP)
	@echo "MLflow UI: http://127.0.0.1:5000/#/experiments?workflowType=machine_learning  (the 'Model training' view)"
	MLFLOW_DISABLE_TELEMETRY=$(MLFLOW_DISABLE_TELEMETRY) DO_NOT_TRACK=$(DO_NOT_TRACK) \
	  $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000
