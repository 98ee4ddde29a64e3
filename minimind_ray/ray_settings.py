"""The settings of Ray's that the project needs, put into the environment before ``ray`` is imported anywhere.

Ray reads some of its settings once, when it is imported (``ray/_private/ray_constants.py``:
``RAY_DASHBOARD_STARTUP_TIMEOUT_S``): a value set after ``import ray`` is never seen. Set in ``raytrain/session.py``
after the import, ray.init went on waiting 60 s for the dashboard, and a tiny pretrain on a busy machine (a
``make demo`` beside it) died in Ray's start (issue 54). ``minimind_ray/__init__.py`` calls :func:`apply`, so every
way in (the CLI, ``pipelines/``, a module that imports ray, a Ray worker unpickling the run) has them before its
first ``import ray``. A value the user exported wins.
"""
from __future__ import annotations

import os

PREPARE_OOM_RETRIES = 2  # a prepare task killed for memory more often than this fails the command (data/prepare.py)

RAY_SETTINGS = {
    # ray.init waits this long for a local Ray's dashboard (Ray's default: 60 s), and the dashboard's modules get
    # this long to come up (Ray's: 30 s): a busy machine (load 15-40 on 2 cores, measured) misses either, and the
    # whole local Ray fails to start
    "RAY_DASHBOARD_STARTUP_TIMEOUT_S": "200",
    "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "120",
    # tasks this driver owns (the prepare job's) that Ray's memory monitor kills are retried without end by default
    # ("infinite oom retries remaining"): the command would hang. Read when a local Ray starts.
    "RAY_task_oom_retries": str(PREPARE_OOM_RETRIES),
}


def apply() -> None:
    """:data:`RAY_SETTINGS` into this process's environment, where the user has not set them."""
    for key, value in RAY_SETTINGS.items():
        os.environ.setdefault(key, value)
