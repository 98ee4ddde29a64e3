"""A worker lost while Ray Train starts the worker group costs one restart, like a worker lost while training.

Ray Train 2.58 breaks that promise in two ways (docs/reliability.md, "A worker lost while the group starts", whose
script shows both against Ray alone), and 2.60.0 still does (the script, run again on 2.60.0: the same hang and the
same bare failure; ``WorkerGroup._start_impl`` is unchanged but for a new method):

* ``WorkerGroup._start_impl`` builds the group's state (its placement group, workers, sync actor) and only then
  runs the ``after_worker_group_start`` callbacks (the torch backend's set-up) and hands each worker the train
  function (``run_train_fn``). A worker that dies there raises out of ``_start`` with the state built, so
  ``_start``'s clean-up is skipped and the controller never learns of the group: its placement group keeps its
  CPUs until the driver exits. Every later start of the same size then waits for CPUs that never come
  (``WorkerGroupStartupTimeoutError``, retried without end: start errors count against
  ``FailureConfig.controller_failure_limit``, unlimited by default, not ``max_failures``).
* A death inside ``run_train_fn`` is a bare ``ActorDiedError``, which the failure policy does not retry: the run
  ends, whatever ``max_failures`` says.

Two pieces make such a death one restart:

* ``start_guard.StartGuard``, a Ray Train callback loaded first (``RAY_TRAIN_CALLBACKS``, which Ray reads before
  its own callbacks, so it sees the group before the backend's set-up can fail), remembers a group from the moment its
  state exists until its train function runs, and shuts down a group that never got there (workers, sync actor,
  placement group) when the controller handles the failure.
* :func:`fit`, the driver's loop around ``TorchTrainer.fit``: every start failure ends the fit
  (``controller_failure_limit=0``) and counts as one failure against ``cluster.max_failures``, together with the
  worker failures Ray Train already counted (a group that could not be placed within ``cluster.resource_timeout_s``
  counts too, unless an elastic run can go on smaller), and the same run is fitted again (Ray Train resumes a run of the same name
  and storage: the newest checkpoint, the data position, the MLflow run). A spent budget ends the run with one line
  (:class:`RestartsSpent`, exit 2).
"""
from __future__ import annotations

import re
import time
from typing import Callable, Optional, Tuple


# An elastic run that times out at a size above cluster.min_workers is fitted again for free (the new controller's
# elastic policy picks the size that fits): at most this many times in a row, so that a policy that keeps choosing an
# unplaceable size cannot loop for ever.
FREE_SHRINKS = 3


class RestartsSpent(RuntimeError):
    """The worker group could not be (re)started within ``cluster.max_failures``; the message is one line."""


def start_failure(error: BaseException) -> Optional[Tuple[str, Optional[int]]]:
    """(what went wrong, the size that timed out or None), if ``fit()`` ended because the worker group did not
    start; None for any other error."""
    from ray.exceptions import RayActorError
    from ray.train import ControllerError
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError, WorkerGroupStartupTimeoutError

    if not isinstance(error, ControllerError):
        return None
    cause = error.controller_failure
    if isinstance(cause, WorkerGroupStartupTimeoutError):
        # the seconds the controller waited, from Ray's message (made in the controller, from the setting it got)
        waited = re.search(r"timed out after ([\d.]+) seconds", str(cause))
        within = f" ({float(waited.group(1)):g} s)" if waited else ""
        return (f"{cause.num_workers} worker(s) could not be placed within cluster.resource_timeout_s{within}",
                cause.num_workers)
    if isinstance(cause, WorkerGroupStartupFailedError):
        return "a worker died while the group was set up", None
    if isinstance(cause, RayActorError):  # the bare ActorDiedError of run_train_fn
        return "a worker died while it received the train function", None
    return None


def fit(make_trainer: Callable[[int], object], max_failures: int, run_dir: str, name: str,
        min_workers: Optional[int] = None):
    """``make_trainer(failures_left).fit()``, fitted again after each start failure while ``max_failures`` allows.

    ``failures_left`` is what the run has left of ``cluster.max_failures``: worker failures of earlier fits
    (the controller's ``detected-*`` records, raytrain/faults.py) and start failures both spend it. A start that
    timed out above ``min_workers`` (an elastic run going on smaller, cluster.min_workers) spends nothing."""
    # lazy: omegaconf, pyarrow, torch, yaml, only when this runs
    from minimind_ray.raytrain.faults import worker_failures_since

    spent = free = 0
    while True:
        started = time.time()
        try:
            return make_trainer(max_failures - spent).fit()
        except Exception as e:
            failure = start_failure(e)
            if failure is None:
                raise
            why, timed_out_at = failure
            spent += worker_failures_since(run_dir, started)
            if min_workers is not None and timed_out_at is not None and timed_out_at > min_workers \
                    and free < FREE_SHRINKS and spent <= max_failures:
                free += 1
                print(f"[{name}] the worker group did not start: {why}; starting it again at the size that fits "
                      f"(elastic, cluster.min_workers={min_workers})", flush=True)
                continue
            spent, free = spent + 1, 0
            if spent > max_failures:
                raise RestartsSpent(
                    f"cluster.max_failures={max_failures} spent: the worker group did not start ({why}) after "
                    f"{spent - 1} restart(s); the run is kept and the same command resumes it from its newest "
                    f"checkpoint") from None
            print(f"[{name}] the worker group did not start: {why}; starting it again "
                  f"(failure {spent} of cluster.max_failures={max_failures})", flush=True)
