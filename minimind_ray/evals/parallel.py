"""``eval --workers N``: a task's batches shared out over N Ray tasks, each loading the weights itself.

The batches are made before they are shared out (evals/run.py:make_batches) and each keeps its index, which
also seeds its sampling, so every batch is computed as it would be with any other N: the result does not
depend on N. Worker w takes batches w, w + N, w + 2N, ... (the longest first, so the load evens out), runs
with one torch thread per CPU it holds, builds the task's kind from the registry by its name (evals/registry.py)
and returns its batches' results to be put back in order. A user's own kind (``package.module:Class``) reaches the
tasks on any node: the Ray this starts ships its module as a ``py_modules`` entry when it lies outside this project
and the installed packages (plugins.py:module_paths), as a training run ships the user's plug-ins.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import List, Optional

from minimind_ray.console import after_ray_start, ray_init_options
from minimind_ray.evals.config import EvalTaskConfig
from minimind_ray.evals.registry import plugin_names, task_for
from minimind_ray.plugins import module_paths

log = logging.getLogger(__name__)


def runtime_env(task: EvalTaskConfig) -> dict:
    """The ``runtime_env`` of the Ray that ``--workers`` starts: the project and the driver's PYTHONPATH entries on
    the tasks' path, and a user's own kind shipped as ``py_modules`` (as raytrain/driver.py ships a run's
    plug-ins: Ray takes local directories at the job level only)."""
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
                        "TOKENIZERS_PARALLELISM": "false"}}
    modules = module_paths(plugin_names([task]))
    if modules:
        env["py_modules"] = modules
    return env


def _connect(workers: int, task: EvalTaskConfig):
    import ray

    if not ray.is_initialized():
        env, quiet = runtime_env(task), ray_init_options()  # Ray's own lines to its log files unless --verbose
        if os.environ.get("RAY_ADDRESS"):
            after_ray_start(ray.init(runtime_env=env, **quiet))
        else:
            after_ray_start(ray.init(num_cpus=max(os.cpu_count() or 1, workers), include_dashboard=False,
                                     runtime_env=env, **quiet))
    elif module_paths(plugin_names([task])):
        log.warning("eval --workers: Ray was started before this task, so %s is not shipped to its workers; they "
                    "load it only if the job's own runtime_env has it", task.task)
    return ray


def _score_share(weights: str, preset: Optional[str], task: dict, jobs: List[tuple], eos_id: int, pad_id: int,
                 threads: int, rope_scaling: Optional[dict]) -> List[tuple]:
    import torch

    from minimind_ray.engine.step import autocast_for  # lazy: torch, only when this runs
    from minimind_ray.store.weights import build_inference_model  # lazy: pyarrow, torch, only when this runs

    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = build_inference_model(weights, preset, device=device, rope_scaling=rope_scaling)
    kind = task_for(EvalTaskConfig(**task))
    autocast = autocast_for("auto", torch.device(device))
    return [(i, kind.score(model, job, i, eos_id=eos_id, pad_id=pad_id, device=device, autocast=autocast))
            for i, job in jobs]


def score_on_ray(weights: str, preset: Optional[str], task: EvalTaskConfig, jobs: list, eos_id: int, pad_id: int,
                 workers: int, cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0,
                 rope_scaling: Optional[dict] = None) -> list:
    """The results of ``jobs`` (one per batch, in order), computed by ``workers`` Ray tasks."""
    ray = _connect(workers, task)
    if os.path.exists(weights):
        weights = os.path.abspath(weights)  # the tasks run in another working directory
    remote = ray.remote(_score_share).options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)
    shares = [[(i, jobs[i]) for i in range(w, len(jobs), workers)] for w in range(workers)]
    refs = [remote.remote(weights, preset, dataclasses.asdict(task), share, eos_id, pad_id,
                          max(1, int(cpus_per_worker)), rope_scaling) for share in shares if share]
    results = [None] * len(jobs)
    for share in ray.get(refs):
        for i, r in share:
            results[i] = r
    return results
