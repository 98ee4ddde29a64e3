"""The driver's one hand-off to the workers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from minimind_ray.config import RunConfig
from minimind_ray.stages import Stage


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, built once by the driver from the run resolved once (config.py:RunSpec) and what
    the driver decided; the user's config is never edited.

    ``cfg`` is the driver's own copy with what the driver decided filled in (the run name, whether workers use GPUs,
    every weights path absolute), so a checkpoint's ``meta.json`` and the MLflow params say what really ran."""

    cfg: RunConfig
    stage: Stage  # the run's stage record, as resolved (it travels as its name: stages/__init__.py)
    storage: str  # checkpoint.storage_path, absolute (raytrain/resume.py:storage_root)
    run_dir: str  # <storage>/<name>: where this run's checkpoints are (local path or URI)
    prepared_dir: str  # the prepared data to train on
    use_gpu: bool
    tracking_uri: Optional[str] = None
    mlflow_run_id: Optional[str] = None  # None: untracked (a checkpoint's run id wins on a restore)
    progress_sink: Any = None  # the driver process's ProgressSink actor: rank 0 pushes interval metrics to it
    progress_run: str = ""  # this run's key there (raytrain/progress.py)
    report_every_eval: bool = False  # also ray.train.report each eval step's eval_loss (a sweep's trial: ASHA)
    launch_fault: Any = None  # a start fault that fires as a worker unpickles this (raytrain/faults.py:LaunchFault)
