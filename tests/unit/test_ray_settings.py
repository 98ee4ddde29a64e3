"""Ray's settings the project needs are in the environment before ``ray`` is imported (issue 54, item 4): Ray reads
some once, at import (ray/_private/ray_constants.py), so one set later (raytrain/session.py set the dashboard's
start timeout after ``import ray``) never applies, and a local Ray on a busy machine died in its start after 60 s.
Each check imports the modules in their real order, in a process of its own: an entry point, the driver, then Ray."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from minimind_ray.ray_settings import RAY_SETTINGS

REPO = Path(__file__).resolve().parents[2]
# what a run's process imports, in order: pipelines/pretrain.py (cli.py, every verb), the driver, then Ray itself
REAL_ORDER = ("import pipelines.pretrain\nimport minimind_ray.raytrain.driver\nimport ray\n"
              "from ray._private import ray_constants\nprint(ray_constants.RAY_DASHBOARD_STARTUP_TIMEOUT_S)\n")


def _constant(env_extra=None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in RAY_SETTINGS}
    out = subprocess.run([sys.executable, "-c", REAL_ORDER], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**env, **(env_extra or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_rays_dashboard_timeout_is_the_projects_once_ray_is_imported():
    assert _constant() == RAY_SETTINGS["RAY_DASHBOARD_STARTUP_TIMEOUT_S"] == "200"


def test_a_value_the_user_exported_wins():
    assert _constant({"RAY_DASHBOARD_STARTUP_TIMEOUT_S": "321"}) == "321"
