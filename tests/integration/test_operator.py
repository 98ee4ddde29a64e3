"""What the operator's own hand does to a run (issue 54; docs/reliability.md, "What the operator does"), run as a
user runs it: the CLI in a subprocess, on the tiny recipe."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "configs" / "tiny.yaml"


def pretrain(tmp_path: Path, *overrides, env=None, **popen):
    """The tiny pretrain, its storage and cache under ``tmp_path``, on a local Ray of its own."""
    args = [sys.executable, "-m", "minimind_ray.cli", "pretrain", "--config", str(TINY),
            f"checkpoint.storage_path={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",
            "tracking.enabled=false", *overrides]
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(args, cwd=tmp_path, text=True, capture_output=True, timeout=600, env={**base, **(env or {})},
                          **popen)


def test_a_local_ray_that_does_not_start_is_one_line_naming_the_log_to_read(tmp_path):
    """Item 4: a local Ray whose dashboard does not come up in time (a busy machine; here a timeout of 0 s) is one
    line: what failed, the log to read, --verbose; not Ray's 58-line traceback."""
    p = pretrain(tmp_path, env={"RAY_DASHBOARD_STARTUP_TIMEOUT_S": "0"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr[-3000:])
    assert lines[0].startswith("error: the local Ray did not start: its dashboard did not come up within "
                               "RAY_DASHBOARD_STARTUP_TIMEOUT_S=0 s"), lines[0]
    assert "dashboard.log" in lines[0] and "--verbose" in lines[0], lines[0]
    assert "Traceback" not in p.stdout + p.stderr
