"""What a run asks of the cluster: one worker's resources, and the check that the worker group and what runs beside
it (the evaluation task, an RL stage's rollout actors) fit before any work starts."""
from __future__ import annotations

import time
from typing import Dict

from minimind_ray.config import ConfigError, RunConfig
from minimind_ray.raytrain.runtime_env import beside_workers
from minimind_ray.stages import Stage


class ClusterTooSmall(ConfigError):
    """The cluster cannot place the requested worker group; the message names the field to change."""


def worker_resources(cfg: RunConfig, use_gpu: bool) -> Dict[str, float]:
    res = {"CPU": cfg.cluster.cpus_per_worker}
    if use_gpu:
        res["GPU"] = 1
    if cfg.cluster.worker_resource:
        res[cfg.cluster.worker_resource] = 1
    return res


def check_resources(cfg: RunConfig, stage: Stage, use_gpu: bool) -> None:
    """Wait up to cluster.resource_timeout_s for the worker group and what runs beside it (the evaluation task, an RL
    stage's rollout actors) to fit, then fail with what is missing.

    Ray Train V2 would otherwise wait for resources forever, and a rollout actor Ray cannot place waits forever
    too; this turns a request the cluster cannot hold (4 GPU workers on a CPU cluster) into an error in seconds.
    ``stage``: the run's record (what it places beside the workers)."""
    import ray

    need_workers = cfg.cluster.min_workers or cfg.cluster.num_workers
    per = worker_resources(cfg, use_gpu)
    need = {k: v * need_workers for k, v in per.items()}
    for k, v in beside_workers(cfg, stage).items():
        need[k] = need.get(k, 0.0) + v
    deadline = time.monotonic() + cfg.cluster.resource_timeout_s
    while True:
        total = ray.cluster_resources()
        short = {k: (n, total.get(k, 0.0)) for k, n in need.items() if total.get(k, 0.0) < n}
        if not short:
            return
        if time.monotonic() >= deadline:
            detail = ", ".join(f"{k}: need {n:g}, cluster has {h:g}" for k, (n, h) in short.items())
            waited = f"waited {cfg.cluster.resource_timeout_s:g}s (cluster.resource_timeout_s)"
            workers_fit = all(total.get(k, 0.0) >= v * need_workers for k, v in per.items())
            if workers_fit and stage.beside(cfg):  # its record says what it places beside them and what to change
                field, lacks, change = stage.beside_shortfall(cfg)
                raise ClusterTooSmall(f"{field}: the cluster holds the {need_workers} worker(s) of {per} but not "
                                      f"{lacks} beside them ({detail}); {waited}. {change}")
            field = "cluster.use_gpu" if "GPU" in short else "cluster.num_workers"
            raise ClusterTooSmall(
                f"{field}: the cluster cannot hold {need_workers} worker(s) of {per} and what runs beside them "
                f"({detail}); {waited}. Lower cluster.num_workers, set cluster.use_gpu=false, or add nodes.")
        time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))
