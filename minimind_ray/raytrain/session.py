"""The Ray a run uses: a cluster (``cluster.address``, ``RAY_ADDRESS``, a submitted job's), or a local one this
process starts and sizes for the run; and the Ray Train settings of the run's environment while it trains."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import tempfile
import traceback
from typing import Optional, Tuple

from minimind_ray.config import ConfigError, RunConfig
from minimind_ray.console import after_ray_start, ray_init_options, verbose
from minimind_ray.fsio import is_uri
from minimind_ray.raytrain.preemption import check_interval
from minimind_ray.raytrain.runtime_env import side_cpus, worker_pythonpath
from minimind_ray.stages import Stage, get_stage


def in_ray_job() -> bool:
    """True in the driver of a `ray job submit` (Ray sets this variable there, not RAY_JOB_ID)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def warn_relative_paths(cfg: RunConfig) -> None:
    """Under `ray job submit` the cwd is a temporary copy of the working dir: relative outputs vanish with it."""
    rel = [f for f, v in (("checkpoint.storage_path", cfg.checkpoint.storage_path),
                          ("data.cache_dir", cfg.data.cache_dir)) if not is_uri(v) and not os.path.isabs(v)]
    if cfg.tracking.enabled and not (cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")):
        rel.append("tracking.uri")
    if rel:
        print(f"[minimind-ray] WARNING: {', '.join(rel)} resolve inside the job's temporary working dir "
              f"({os.getcwd()}); pass absolute paths or URIs to keep the results", flush=True)


def connect_ray(cfg: RunConfig, dashboard: bool = True, num_cpus: Optional[int] = None,
                stage: Optional[Stage] = None):
    """Join cluster.address / RAY_ADDRESS, or start a local Ray sized for this run (with its dashboard
    unless ``dashboard=False``: ``prepare`` needs none, and it starts in half the time), or with ``num_cpus``
    logical CPUs if more (a sweep's trials at once). ``stage``: a resolved run's record (the driver's); a config
    that is not a run's (prepare's, a sweep's base) is sized by its train.stage's."""
    import ray

    if ray.is_initialized():
        return ray
    # Ray's settings that the project needs (the dashboard's start timeouts, the prepare tasks' OOM retries) are in
    # the environment already: Ray reads some at import, so minimind_ray/__init__.py sets them (ray_settings.py)
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {"PYTHONPATH": worker_pythonpath(), "TOKENIZERS_PARALLELISM": "false"}}
    quiet = ray_init_options()  # Ray's own lines to its log files, unless --verbose (console.py)
    if in_ray_job():
        after_ray_start(ray.init(**quiet))  # the job's own runtime env already applies; another one would conflict
    elif address:
        after_ray_start(ray.init(address=address, runtime_env=env, **quiet))
    else:
        # Logical CPUs: the workers plus room for Ray Data (it starves when workers take every CPU).
        # (and what runs beside the workers: the evaluation task of eval.tasks, GRPO's rollout actors)
        beside = side_cpus(cfg, stage or get_stage(cfg.train.stage))
        need = math.ceil(cfg.cluster.num_workers * cfg.cluster.cpus_per_worker + beside) + 1
        # The dashboard (127.0.0.1 only) also serves the state API that Ray Train's placement-group
        # cleaner polls; without it the cleaner logs a warning every few seconds. Its port is chosen here and
        # given to every actor (RAY_API_SERVER_ADDRESS): with other Rays on the machine the cleaner would
        # otherwise fail ("multiple active Ray instances") and a sweep's stopped trials keep their CPUs.
        port = _free_port() if dashboard else None
        if port:
            env["env_vars"]["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
        with local_start(ray):
            after_ray_start(ray.init(num_cpus=max(os.cpu_count() or 1, need, num_cpus or 0),
                                     include_dashboard=dashboard, dashboard_host="127.0.0.1", runtime_env=env,
                                     **({"dashboard_port": port} if port else {}), **quiet))
    return ray


class RayStartFailed(OSError):
    """A local Ray that did not start, in one line: what failed, the log to read (cli.py prints it, exit 2)."""


@contextlib.contextmanager
def local_start(ray):
    """The start of a local Ray: its failure becomes :class:`RayStartFailed`, one line naming what failed and the log
    to read, instead of Ray's traceback and the 20 lines of the dashboard's log it prints (issue 54: a busy machine).
    Ray's lines about it stay in its log files unless --verbose; what Ray had started is stopped."""
    services = logging.getLogger("ray._private.services")  # "Failed to start the dashboard" and its log's tail
    level = services.level
    if not verbose():
        services.setLevel(logging.CRITICAL)
    try:
        yield
    except Exception as e:
        with contextlib.suppress(Exception):
            ray.shutdown()
        logs = ray_logs_dir()
        dashboard = "dashboard" in f"{e} {''.join(traceback.format_tb(e.__traceback__))}"
        what = (f"its dashboard did not come up within RAY_DASHBOARD_STARTUP_TIMEOUT_S="
                f"{os.environ.get('RAY_DASHBOARD_STARTUP_TIMEOUT_S', '60')} s (a busy machine: export a larger value)"
                if dashboard else f"{type(e).__name__}: {next((x for x in str(e).splitlines() if x.strip()), '')}")
        raise RayStartFailed(f"the local Ray did not start: {what}; read {logs}/"
                             f"{'dashboard.log' if dashboard else 'raylet.out and gcs_server.out'}; --verbose shows "
                             f"Ray's own lines, --debug the traceback") from e
    finally:
        services.setLevel(level)


def ray_logs_dir() -> str:
    """The log folder of the newest local Ray session of this machine (Ray's default temp dir)."""
    try:
        from ray._common.utils import get_default_ray_temp_dir  # lazy: ray, only when a start failed

        root = get_default_ray_temp_dir()
    except Exception:  # another Ray version: its documented default
        root = os.path.join(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(), "ray")
    return os.path.join(root, "session_latest", "logs")


@contextlib.contextmanager
def train_env(cfg: RunConfig):
    """The Ray Train settings of this run in this process's environment while it trains, then as they were: Ray Train
    hands them on from the driver's environment to its controller and workers (ray.train.v2's
    ENV_VARS_TO_PROPAGATE), so they apply however the run reaches Ray: a local Ray, cluster.address, or a submitted
    job, whose runtime env this driver cannot extend (a ray.init env would conflict). A value exported by the user
    wins. Yields what applies."""
    from minimind_ray.raytrain.start_guard import START_GUARD  # lazy: ray, only when this runs

    wanted = {
        # the controller polls the workers at this interval, and a checkpoint's report waits for that poll (2 s by
        # default: a barrier of up to 2 s per checkpoint)
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        # a worker group that cannot be placed (e.g. after a node loss) is retried after this, smaller when elastic
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": f"{cfg.cluster.resource_timeout_s:g}",  # Ray reads a float
    }
    if not check_interval(cfg):  # checkpoint.preemption_check_interval=0: no rank asks, so no PreemptionWatcher
        wanted["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"  # actor polling the GCS for drains (raytrain/preemption.py)
    ours = {k: v for k, v in wanted.items() if k not in os.environ}
    # The start guard (raytrain/start_guard.py) goes before the user's own callbacks and Ray's: read by the driver's
    # TorchTrainer.fit, which builds the controller's callbacks
    callbacks = os.environ.get("RAY_TRAIN_CALLBACKS")
    ours["RAY_TRAIN_CALLBACKS"] = ",".join(c for c in (START_GUARD, callbacks) if c)
    saved = {k: os.environ.get(k) for k in ours}
    os.environ.update(ours)
    try:
        yield {k: os.environ[k] for k in [*wanted, "RAY_TRAIN_CALLBACKS"]}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def starts_own_ray(cfg: RunConfig) -> bool:
    """Will this process start a local Ray for the run (no cluster.address, RAY_ADDRESS or submitted job)?"""
    ray = sys.modules.get("ray")  # not imported for this: a check before Ray needs no Ray
    return not ((ray is not None and ray.is_initialized()) or in_ray_job() or cfg.cluster.address
                or os.environ.get("RAY_ADDRESS"))


def gpus_and_backend(cfg: RunConfig) -> Tuple[bool, str]:
    """(GPU workers or not, the torch.distributed backend), from the connected cluster and cluster.use_gpu/backend."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = bool(gpus) if cfg.cluster.use_gpu is None else cfg.cluster.use_gpu
    if cfg.cluster.backend == "nccl" and not use_gpu:
        raise ConfigError("cluster.backend: nccl needs GPU workers, and this run has none "
                          f"({'cluster.use_gpu=false' if cfg.cluster.use_gpu is False else 'the cluster has no GPUs'}); "
                          "use cluster.backend=auto (nccl on GPUs, gloo otherwise) or gloo")
    return use_gpu, cfg.cluster.backend if cfg.cluster.backend != "auto" else ("nccl" if use_gpu else "gloo")
