#!/usr/bin/env bash
# tests/soak/gpu_ray_check.py on the lent GPU machine, in one device call (issue 25): the table and the verdict.
#
# That machine has torch, pyarrow, pandas, tokenizers, safetensors and PyYAML but no Ray, no omegaconf and no
# MLflow, and reaches no package registry. Beforehand, here, put the wheels it lacks into .whl/ (git-ignored):
# the workplace's device/ray-wheels.sh (Ray 2.58 without its 32 MB Java jar, which Python workers never load,
# and its dependencies: about 48 MB, under the 64 MiB a call carries), then
#     python3 -m pip download --no-deps --only-binary=:all: -d .whl omegaconf==2.4.0
# The call:  command "tests/soak/gpu_ray_check.sh", carry [".whl"], timeout_s 540 (the check stops starting parts
# after --budget-s 400; the install takes about half a minute). Tracking is off there (MLflow is not carried).
# Everything it writes lands in $OUT: gpu_ray_check.md (the table), .json, profile_*, pipeline_logs.txt, console.txt.
# Rehearse it on CPU first: .venv/bin/python -m tests.soak.gpu_ray_check --cpu --out /tmp/gpu-ray-smoke
set -euo pipefail
cd "$(dirname "$0")/../.."
ls .whl/ray-2.58.0-*.whl >/dev/null  # carried?
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out="${OUT:-gpu-ray-check-out}"
mkdir -p "$out"
python3 -m tests.soak.gpu_ray_check --out "$out" "$@" 2>&1 | tee "$out/console.txt"
