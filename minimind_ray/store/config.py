"""The store room's configuration: where checkpoints go, how often, and which are kept (``checkpoint:``); and the
schedule of checkpoints (and of the validations that run on them) that the loop and the RL plans keep."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minimind_ray.config_checks import config_field as _f, need


@dataclass
class CheckpointConfig:
    """Ray Train checkpoints."""

    interval: int = _f(100, "optimizer steps between checkpoints (and one at the end)", ge=1)
    num_to_keep: int = _f(3, "checkpoints kept by Ray Train (the newest always; the rest by score_metric when set)", ge=1)
    score_metric: Optional[str] = _f(None, "keep the num_to_keep best checkpoints by this metric, e.g. "
                                           "eval/<task>/acc (eval.tasks) or loss; None = the newest")
    score_order: str = _f("max", "max | min: which end of score_metric is best")
    storage_path: str = _f("runs", "local directory or URI (s3://, gs://) of run storage; shared by all nodes on a cluster")
    upload: str = _f("async", "sync | async: how a checkpoint reaches checkpoint.storage_path. sync: the step waits for every file's upload (Ray Train's report); async: the files are written to a local staging folder, the loop goes on while one background thread per worker uploads them (Ray Train's CheckpointUploadMode.ASYNC), the folder is removed once uploaded, and an upload that fails fails the worker group like any fault. A restart restores only a checkpoint whose COMPLETE.json files are all in storage at their sizes, in both modes. On local disk both cost the same; on a bucket async takes the upload off the step (docs/reliability.md, bench/bench_checkpoint_upload.py)")
    preemption_check_interval: Optional[int] = _f(None, "optimizer steps between asks for a drain notice (ray.train.get_preemption_info, a barrier of the ranks); on one, every rank checkpoints that step and waits for Ray Train's restart, so no step is lost (docs/reliability.md). None = every train.log_interval, 0 = never", ge=0)


def validate_checkpoint(c: CheckpointConfig) -> None:
    need(c.score_order in ("max", "min"), "checkpoint.score_order", "must be max or min")
    need(c.upload in ("sync", "async"), "checkpoint.upload", f"must be sync or async, got {c.upload!r}")


def validation_due(cfg, step: int, total_steps: int) -> bool:
    """Whether the benchmark tasks of ``eval.tasks`` run on this step's checkpoint (every ``eval.interval``
    steps and at the last); they run outside the loop, on the checkpoint (raytrain/validation.py)."""
    e = cfg.eval
    return bool(e.tasks) and ((e.interval > 0 and step % e.interval == 0) or step == total_steps)


def checkpoint_due(cfg, step: int, total_steps: int) -> bool:
    """Whether a checkpoint is saved after this step: every checkpoint.interval, the last, and each validated one."""
    return step % cfg.checkpoint.interval == 0 or step == total_steps or validation_due(cfg, step, total_steps)
