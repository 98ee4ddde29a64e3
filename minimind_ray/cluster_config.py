"""The cluster's configuration (``cluster:``): which Ray cluster, how many workers of what, how failures are
retried; and the threads one worker uses. Read by the Ray layer (minimind_ray/raytrain) and by the engine (its
threads); minimind_ray/config.py composes it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from minimind_ray.config_checks import config_field as _f, need


@dataclass
class ClusterConfig:
    """Ray cluster and worker group."""

    address: Optional[str] = _f(None, "Ray address; None = RAY_ADDRESS or a local Ray started for this run")
    num_workers: int = _f(2, "training workers (DDP ranks)", ge=1)
    min_workers: Optional[int] = _f(None, "elastic: smallest worker group to continue with (None = fixed size)", ge=1)
    use_gpu: Optional[bool] = _f(None, "one GPU per worker; None = when the cluster has GPUs")
    cpus_per_worker: float = _f(1.0, "logical CPUs reserved per worker", gt=0)
    backend: str = _f("auto", "torch.distributed backend: auto (nccl with GPUs, else gloo) | nccl | gloo")
    max_failures: int = _f(3, "worker-group restarts before the run fails (faults: a lost worker or node, a failed "
                              "collective, storage errors; docs/reliability.md)")
    retry_mistakes: bool = _f(False, "retry a failure of the user's input (weights, data, a reward or tool plug-in) like "
                                     "a fault, within max_failures (a flaky plug-in); by default it ends the run at once")
    check_local_fit: bool = _f(True, "a Ray this run starts on this machine: refuse, before it starts, more training "
                                     "workers than 2 per core (or than its GPUs), or a memory estimate above its "
                                     "memory (docs/training.md); false: start them anyway")
    resource_timeout_s: float = _f(60.0, "fail if the cluster cannot place the worker group within this time; a "
                                         "restart waits this long for its full group before an elastic run goes on "
                                         "smaller (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, unless exported)", gt=0)
    worker_resource: Optional[str] = _f(None, "custom resource each worker takes one unit of (one slot per node makes elastic work)")


def validate_cluster(cl: ClusterConfig) -> None:
    need(cl.backend in ("auto", "nccl", "gloo"), "cluster.backend", "must be auto, nccl or gloo")
    if cl.min_workers is not None:
        need(cl.min_workers <= cl.num_workers, "cluster.min_workers", "must be in [1, num_workers]")


def worker_threads(cfg) -> int:
    """torch/OMP threads of one training worker: train.threads_per_worker, or its CPUs rounded up."""
    return cfg.train.threads_per_worker or max(1, math.ceil(cfg.cluster.cpus_per_worker))
