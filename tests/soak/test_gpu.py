"""The GPU checks under pytest (marker ``soak``): each runs as the script a lent GPU machine runs
(tests/soak/gpu_ray_check.sh, ``python3 -m tests.soak.gpu_check``), in a process of its own, and fails on its
verdict.

- The Ray Train path (``tests.soak.gpu_ray_check``): on CUDA the check itself; without CUDA its CPU rehearsal, the
  same code path with tiny sizes (about 15 minutes on 2 busy cores): every part ends, the restore is bit-equal, the
  out-of-memory run ends with one line and exit 2.
- The engine alone (``tests.soak.gpu_check``, CUDA only): NCCL's all-reduce, and a resume bit-equal under
  deterministic algorithms.

    .venv/bin/python -m pytest -m soak -s tests/soak/test_gpu.py [--gpu-out DIR]
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.integration.local_cluster import REPO
from tests.skip_budget import missing
from tests.soak.gpu_ray_check import PARTS, failures

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3 * 3600)]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
       "PYTHONUNBUFFERED": "1"}


def test_the_ray_train_gpu_check_passes_on_cuda_or_in_its_cpu_rehearsal(tmp_path, request):
    out = request.config.getoption("--gpu-out", None) or str(tmp_path / "out")
    mode = [] if torch.cuda.is_available() else ["--cpu", "--budget-s", "7200"]  # every part, however busy the CPU
    p = subprocess.run([sys.executable, "-m", "tests.soak.gpu_ray_check", "--out", out, *mode], cwd=REPO, env=ENV)
    results = json.loads(open(os.path.join(out, "gpu_ray_check.json")).read())
    assert not failures(results) and p.returncode == 0, failures(results)
    ran = {k.split("_compile_")[0] for k in results}  # speed: speed_compile_False, speed_compile_True
    assert ran == set(PARTS), f"parts that did not run: {sorted(set(PARTS) - ran)}"


def test_the_engine_alone_on_a_gpu(tmp_path):
    if not torch.cuda.is_available():
        missing("no CUDA device: the engine's GPU check runs on a GPU only")
    prep = subprocess.run([sys.executable, "-m", "minimind_ray.cli", "prepare", "data.train_path=[demo]",
                           "data.tokenizer=minimind2", "data.max_seq_len=512", f"data.cache_dir={tmp_path}/cache"],
                          cwd=REPO, env=ENV, capture_output=True, text=True)
    assert prep.returncode == 0, prep.stderr[-3000:]
    prepared = re.search(r"^prepared: (.+)$", prep.stdout, re.M).group(1).strip()
    p = subprocess.run([sys.executable, "-m", "tests.soak.gpu_check", "--prepared", prepared, "--parts", "1,4",
                        "--deterministic"], cwd=REPO, env={**ENV, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert p.returncode == 0, "the engine's GPU check failed: its verdict above"
