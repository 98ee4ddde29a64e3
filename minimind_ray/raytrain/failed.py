"""What a failed fit says: one line naming the cause, and every traceback in the run's ``error.log``.

Ray Train ends a fit with an exception whose text is a page: each rank's traceback, Ray's wrappers around them. The
user needs the cause and where to look; the driver turns what ``fit()`` raised into one exception whose message is one
line (the CLI prints it, exit 2), and writes the page to ``<run_dir>/error.log``:

* a worker out of memory (raytrain/oom.py: the settings to change);
* what a stage places beside the workers that could not be placed (failures.py:NotPlaced, RL's rollout actors);
* a failure that was not retried (failures.py: the user's mistake, or an error that recurred), whose line names the
  field or plug-in at fault;
* ``cluster.max_failures`` spent on faults.

Anything else is left as it is: a bug of the project keeps its traceback.
"""
from __future__ import annotations

import time
from typing import Optional

from minimind_ray.config import RunConfig
from minimind_ray.failures import TRACEBACK_ATTR, not_placed, one_line, run_stopped
from minimind_ray.fsio import join, redact, write_text_atomic
from minimind_ray.raytrain.oom import explain as explain_oom
from minimind_ray.raytrain.resources import ClusterTooSmall
from minimind_ray.raytrain.restarts import RestartsSpent

ERROR_LOG = "error.log"


def tracebacks(error: BaseException) -> str:
    """Every rank's traceback that ``error`` carries (Ray Train keeps each as text), else its own text."""
    failures = getattr(error, "worker_failures", None)
    if isinstance(failures, dict) and failures:
        return "\n".join(f"--- rank {rank} ---\n{(getattr(e, TRACEBACK_ATTR, '') or one_line(e)).rstrip()}"
                         for rank, e in sorted(failures.items()))
    return str(error)


def write_error_log(run_dir: str, line: str, detail: str) -> Optional[str]:
    """``<run_dir>/error.log``: the line, then the tracebacks; its location, or None when it cannot be written."""
    path = join(run_dir, ERROR_LOG)
    try:
        write_text_atomic(path, redact(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n\n{detail.rstrip()}\n"))
    except OSError:
        return None
    return path


def explain(cfg: RunConfig, run_dir: str, error: BaseException) -> Optional[Exception]:
    """The one-line exception for what ``fit()`` raised (its tracebacks written to error.log), or None."""
    oom = explain_oom(cfg, error)
    if oom is not None:
        return oom
    placed = not_placed(error)
    if placed:
        return ClusterTooSmall(placed)
    stop = run_stopped(error)
    if stop is not None:
        stop.log = write_error_log(run_dir, str(stop), stop.verdict.traceback or tracebacks(error))
        return stop
    if type(error).__name__ == "WorkerGroupError":  # Ray Train gave up: max_failures spent on faults
        failures = getattr(error, "worker_failures", None) or {}
        last = next((f"rank {r}: {one_line(getattr(e, '_base_exc', e))}" for r, e in sorted(failures.items())),
                    one_line(error))
        line = (f"cluster.max_failures={cfg.cluster.max_failures} spent; the last failure was {last}. The run is kept: "
                f"the same command resumes it from its newest checkpoint")
        log = write_error_log(run_dir, line, tracebacks(error))
        return RestartsSpent(line + (f" (tracebacks: {log})" if log else ""))
    return None
