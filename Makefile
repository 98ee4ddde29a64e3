# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test soak ui install bytecode

# pip byte-compiles every package as it installs (keep it: where PYTHONDONTWRITEBYTECODE is set, as on the development
# machines, nothing writes a .pyc later, and every process would compile torch and Ray from source at each import)
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

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
test: bytecode
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
