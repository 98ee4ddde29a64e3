"""Deterministic algorithms in every Ray worker of a run whose driver has this directory on its PYTHONPATH.

tests/soak/gpu_ray_check.py's restore part puts it there: the driver passes its PYTHONPATH on to the run's workers
(minimind_ray/raytrain/runtime_env.py:worker_pythonpath), and Python imports ``sitecustomize`` from the path
at start. Only Ray's worker processes (default_worker.py) change; the driver and Ray's daemons do not.
CUDA kernels with atomic adds need not repeat bit for bit; under these settings a restored run can be
compared with an uninterrupted one with torch.equal (docs/training.md, "On a GPU").
"""
import os
import sys

if sys.argv and sys.argv[0].endswith("default_worker.py"):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS makes its first handle
    import torch

    torch.use_deterministic_algorithms(True)
    import tempfile  # a marker per process: tests/soak/gpu_ray_check.py counts them (a worker's first prints are not forwarded)

    marks = os.path.join(tempfile.gettempdir(), "gpu_site_deterministic")
    os.makedirs(marks, exist_ok=True)
    open(os.path.join(marks, str(os.getpid())), "w").close()
