"""What the operator's own hand does to a run (issue 54; docs/reliability.md, "What the operator does"), run as a
user runs it: the CLI in a subprocess, on the tiny recipe."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "pipelines" / "configs" / "tiny.yaml"


def _command(tmp_path: Path, *overrides):
    return [sys.executable, "-m", "minimind_ray.cli", "pretrain", "--config", str(TINY),
            f"checkpoint.storage_path={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",
            "tracking.enabled=false", *overrides]


def _env(extra=None) -> dict:
    return {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **(extra or {})}


def pretrain(tmp_path: Path, *overrides, env=None):
    """The tiny pretrain, its storage and cache under ``tmp_path``, on a local Ray of its own."""
    return subprocess.run(_command(tmp_path, *overrides), cwd=tmp_path, text=True, capture_output=True, timeout=600,
                          env=_env(env))


class Started:
    """A command started in the background, its stdout read line by line as it comes."""

    def __init__(self, args, cwd):
        self.proc = subprocess.Popen(args, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=_env())
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.out: list = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, pattern: str) -> str:
        """The lines up to the first that matches ``pattern`` (its match returned)."""
        while True:
            line = self.lines.get(timeout=600)
            assert line is not None, (self.proc.wait(), self.out[-30:], self.proc.stderr.read()[-3000:])
            self.out.append(line)
            if re.search(pattern, line):
                return line

    def finish(self):
        """(exit code, every stdout line, stderr) once it ends."""
        code = self.proc.wait(timeout=600)
        while (line := self.lines.get(timeout=60)) is not None:
            self.out.append(line)
        return code, self.out, self.proc.stderr.read()


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


def test_the_same_command_twice_trains_once_and_ctrl_c_stops_on_a_checkpoint_the_rerun_resumes(tmp_path):
    """Items 1 and 2. The same command started twice within a second: exactly one trains; the other is refused before
    Ray starts, in one line naming the holder (exit 2, nothing on stdout). The one that trains gets Ctrl-C (SIGINT)
    after its first checkpoint: it stops at the next step it checks, on a checkpoint whose upload it waited for,
    says so in one line and exits 130; the last step the console marked [checkpoint uploading] is that checkpoint's,
    nothing is left in its staging folder, and the MLflow run is KILLED, never FAILED (the loser never touched it).
    The same command then resumes from that step and finishes; one MLflow run, FINISHED."""
    from mlflow.tracking import MlflowClient

    from minimind_ray.raytrain.worker import staging_root

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = _command(tmp_path, "name=twice", "train.max_steps=60", "tracking.enabled=true", f"tracking.uri={tracking}")
    first, second = Started(args, tmp_path), Started(args, tmp_path)
    while first.proc.poll() is None and second.proc.poll() is None:
        try:  # whichever ends first is the one refused (the other trains for a minute)
            first.proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
    loser, winner = (first, second) if first.proc.poll() is not None else (second, first)
    code, out, err = loser.finish()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and out == [], (code, out, err[-3000:])
    run_dir = tmp_path / "runs" / "twice"
    assert lines[0].startswith(f"error: run {run_dir} is being trained by pid {winner.proc.pid} on host "), lines[0]
    assert lines[0].endswith("or pass name=<another> for a new run"), lines[0]

    winner.until(r"\[checkpoint uploading\]")  # its first checkpoint
    winner.proc.send_signal(signal.SIGINT)
    code, out, err = winner.finish()
    assert code == 130, (code, out[-30:], err[-3000:])
    stopped = [ln for ln in out if ln.startswith("[minimind-ray] interrupted at step ")]
    assert len(stopped) == 1, out[-30:]
    step = int(stopped[0].split()[4].rstrip(":"))
    assert stopped[0].endswith("in storage; run the same command to resume"), stopped[0]
    marked = [int(m.group(1)) for ln in out if (m := re.search(r"step (\d+)/60 .*\[checkpoint uploading\]", ln))]
    assert marked[-1] == step < 60, (marked, step)
    assert not staging_root(str(run_dir)).exists()
    client = MlflowClient(tracking)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["KILLED"]

    again = subprocess.run(args, cwd=tmp_path, text=True, capture_output=True, timeout=600, env=_env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"[minimind-ray] resuming run twice from step {step} of 60" in again.stdout, again.stdout[-3000:]
    assert f"[minimind-ray] restored step {step} " in again.stdout, again.stdout[-3000:]
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["FINISHED"]


def test_ctrl_c_before_training_begins_is_one_line_and_the_rerun_trains(tmp_path):
    """Ctrl-C while the run starts (its local Ray, its data), before any step: one line saying nothing was trained
    and the checkpoints are as they were, exit 130, no traceback, no checkpoint, the lease released: the same
    command then trains."""
    args = _command(tmp_path, "name=early", "train.max_steps=4")
    started = Started(args, tmp_path)
    started.until(r"^\[minimind-ray\] starting run early")  # said before Ray starts, which takes seconds
    started.proc.send_signal(signal.SIGINT)
    code, out, err = started.finish()
    assert code == 130, (code, out[-30:], err[-3000:])
    assert out[-1] == ("[minimind-ray] interrupted before training began: this command trained nothing and the run's "
                       "checkpoints are as they were; run the same command to go on"), out[-30:]
    assert "Traceback" not in err and not any("step 1/" in ln for ln in out), (out[-30:], err[-3000:])
    assert not list((tmp_path / "runs" / "early").glob("checkpoint_*"))
    again = pretrain(tmp_path, "name=early", "train.max_steps=4")
    assert again.returncode == 0 and "[minimind-ray] starting run early" in again.stdout, again.stderr[-3000:]
