"""Benchmark tasks on checkpoints while training goes on: Ray Train 2.58's validation, off the training workers.

A recipe's ``eval.tasks`` (minimind_ray/evals/config.py:EvalConfig) make every ``eval.interval``-th step and the
last a checkpoint step whose ``ray.train.report(..., validation=True)`` hands the checkpoint to the Train
controller; its ValidationManager runs :func:`validate_checkpoint` as a Ray task of its own (``eval.num_cpus`` /
``num_gpus`` reserved, at most one at a time, cancelled after ``eval.timeout_s``) while the workers train on.
The task loads the checkpoint's model, runs each task through its kind in the eval registry
(minimind_ray/evals/run.py, evals/registry.py: the built-in kinds and a user's ``package.module:Class``), logs
``eval/<name>/<metric>`` to the run's MLflow run at the checkpoint's step, and returns the scores, which Ray
merges into the checkpoint's metrics (so ``checkpoint.score_metric`` can keep the best ones).

Exactly once: a marker ``<run_dir>/eval/step-<N>.json`` is written after the scores are logged, and a validation
that finds it returns its scores without logging (a restarted worker group reports its replayed checkpoints
again); the MLflow logger itself never sends a point at or below the newest step of a key (tracking/logger.py),
which covers a crash between logging and the marker. A task that fails is printed and tagged on the run
(``eval/<name>/error``) with its reason; the others still run, and training is never stopped by it.
"""
from __future__ import annotations

import json
import time
from typing import Dict, List, Optional

from minimind_ray.evals.config import EvalConfig, EvalTaskConfig, task_name
from minimind_ray.tracking.runs import set_tags


def validation_config(eval_cfg: EvalConfig, *, run_dir: str, tracking_uri: Optional[str], cache_dir: str,
                      tracking_timeout_s: float, py_modules=()):
    """The ``ValidationConfig`` of a run with ``eval.tasks`` (None without); ``py_modules``: the user's modules the
    task needs (a task class of their own: raytrain/runtime_env.py:user_modules)."""
    import dataclasses

    from ray.train.v2.api.validation_config import ValidationConfig, ValidationTaskConfig

    if not eval_cfg.tasks:
        return None
    kwargs = {"run_dir": run_dir, "tracking_uri": tracking_uri, "cache_dir": cache_dir,
              "tasks": [dataclasses.asdict(t) for t in eval_cfg.tasks], "threads": max(1, int(eval_cfg.num_cpus)),
              "tracking_timeout_s": tracking_timeout_s}
    return ValidationConfig(fn=validate_checkpoint, task_config=ValidationTaskConfig(kwargs, eval_cfg.timeout_s),
                            ray_remote_kwargs={"num_cpus": eval_cfg.num_cpus, "num_gpus": eval_cfg.num_gpus,
                                               "max_retries": 0,
                                               **({"runtime_env": {"py_modules": list(py_modules)}} if py_modules
                                                  else {})})


def _marker(run_dir: str, step: int) -> str:
    from minimind_ray.fsio import join  # lazy: pyarrow, only when this runs

    return join(join(run_dir, "eval"), f"step-{step}.json")


def _read_marker(path: str) -> Optional[dict]:
    import pyarrow.fs as pafs

    from minimind_ray.fsio import filesystem  # lazy: pyarrow, only when this runs

    fs, p = filesystem(path)
    if fs.get_file_info(p).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(p) as f:
        return json.loads(f.read())


def _write_marker(path: str, record: dict) -> None:
    from minimind_ray.fsio import write_json_atomic  # lazy: pyarrow, only when this runs

    write_json_atomic(path, record)  # a local path or a URI


def run_tasks(ckpt_dir: str, tasks: List[EvalTaskConfig], cache_dir: str, device: str):
    """({metric: value}, {task name: error}) of every task on the checkpoint's model, loaded once."""
    from minimind_ray.evals.run import evaluate_task, metric_items  # lazy: numpy, pyarrow, torch, only when this runs
    from minimind_ray.generate import tokenizer_for_weights  # lazy: torch, only when this runs
    from minimind_ray.store.weights import build_inference_model  # lazy: pyarrow, torch, only when this runs

    model, lw = build_inference_model(ckpt_dir, device=device)
    tok = tokenizer_for_weights(lw)
    scores: Dict[str, float] = {}
    errors: Dict[str, str] = {}
    for t in tasks:
        try:
            scores.update(metric_items(evaluate_task(ckpt_dir, t, model=model, tok=tok, loaded=lw,
                                                     cache_dir=cache_dir, device=device)))
        except Exception as e:  # noqa: BLE001 - one task's failure is reported, never fatal
            errors[task_name(t)] = " ".join(f"{type(e).__name__}: {e}".split())[:500]
    return scores, errors


def validate_checkpoint(checkpoint, *, run_dir: str, tracking_uri: Optional[str], cache_dir: str, tasks: List[dict],
                        threads: int, tracking_timeout_s: float) -> Dict[str, float]:
    """The validation function Ray Train calls with each validated checkpoint (see the module docstring)."""
    import ray
    import torch

    from minimind_ray.store.checkpoint import open_checkpoint  # lazy: pyarrow, torch, only when this runs

    torch.set_num_threads(threads)
    stored = open_checkpoint(checkpoint.path, checkpoint.filesystem)
    meta = stored.meta()
    marker = _marker(run_dir, meta.step)
    done = _read_marker(marker)
    if done is not None:  # this step was evaluated and logged already (a replayed checkpoint)
        return done["scores"]
    t0 = time.perf_counter()
    with checkpoint.as_directory() as local:  # storage may be a URI: the tasks read a local copy
        scores, errors = run_tasks(local, [EvalTaskConfig(**t) for t in tasks], cache_dir,
                                   "cuda" if torch.cuda.is_available() else "cpu")
    seconds = time.perf_counter() - t0
    for name, err in errors.items():
        print(f"[minimind-ray] evaluation {name!r} at step {meta.step} failed (training goes on): {err}", flush=True)
    if tracking_uri and meta.mlflow_run_id:
        _log(tracking_uri, meta.mlflow_run_id, meta.step, scores, errors, tracking_timeout_s)
    ctx = ray.get_runtime_context()
    _write_marker(marker, {"step": meta.step, "scores": scores, "errors": errors, "seconds": seconds,
                           "task_id": ctx.get_task_id(), "actor_id": ctx.get_actor_id(), "node_id": ctx.get_node_id()})
    print(f"[minimind-ray] evaluated step {meta.step} in {seconds:.1f}s: "
          + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()), flush=True)
    return scores


def _log(uri: str, run_id: str, step: int, scores: Dict[str, float], errors: Dict[str, str], timeout_s: float) -> None:
    from minimind_ray.tracking.logger import RunLogger  # lazy: pyarrow, only when this runs

    logger = RunLogger(uri, run_id, timeout_s=timeout_s)
    logger.log_metrics(scores, step=step)
    summary = logger.close(timeout_s=timeout_s)
    if summary.get("metrics_dropped"):
        print(f"[minimind-ray] evaluation scores of step {step} not all logged: {summary}", flush=True)
    if errors:
        set_tags(uri, run_id, {f"eval/{name}/error": f"step {step}: {err}" for name, err in errors.items()},
                 timeout_s=timeout_s)
