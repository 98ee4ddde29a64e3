"""The Ray Train callback that shuts down a worker group whose start failed after Ray built its state.

Why it is needed, and the driver's half (counting the failure, fitting again): raytrain/restarts.py.
"""
from __future__ import annotations

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

START_GUARD = f"{__name__}.StartGuard"  # for RAY_TRAIN_CALLBACKS (raytrain/session.py:train_env)


class StartGuard(ControllerCallback, WorkerGroupCallback):
    """Shuts down a worker group whose start failed after Ray Train built its state (raytrain/restarts.py).

    Runs in the Train controller. Ray constructs it from ``RAY_TRAIN_CALLBACKS`` with no arguments."""

    def __init__(self):
        self._starting = None  # the WorkerGroup between its state's build and its train function's launch

    def after_worker_group_start(self, worker_group):
        self._starting = worker_group

    def after_worker_group_training_start(self, worker_group):
        self._starting = None

    def before_controller_execute_failure_decision(self, failure_decision):
        self._shut_down_unstarted()

    async def before_controller_shutdown(self):
        self._shut_down_unstarted()

    def _shut_down_unstarted(self):
        group, self._starting = self._starting, None
        if group is not None and group.has_started():
            # kills its workers (dead ones included) and its sync actor, removes its placement group
            group.get_worker_group_state().shutdown()
