"""Sweeps with Ray Tune and ASHA (issue 23): pipelines/configs/sweep_tiny.yaml with 2 of its learning rates (3e-3,
then 1e-6; 12 steps, one trial at a time: two trial runs fewer than the recipe's 4), ASHA comparing eval_loss from
step 4: 1e-6 starts once 3e-3 has finished and is the worse at step 4, so it is stopped there. The driver is
SIGKILLed once the first trial has finished and the second has started, and the same command run again: the sweep
resumes, the finished trial is not trained again, the second is stopped early, and MLflow holds one parent run whose
children are the trials, the best trial's values and score on the parent, and its recipe written as a ready YAML.

The sweep's driver starts its own local Ray (with the dashboard: Ray Train's placement-group cleaner, which frees a
stopped trial's workers, reads the state API), in a temporary directory of this test. The data and the built-in
tokenizer come from the session's tiny_baseline cache (the same data settings)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
STEPS = 12  # ASHA's rungs at steps 4 and 8 (grace period 4, reduction factor 2)
LRS = [3.0e-3, 1.0e-6]  # the trials, in order, one at a time: the second starts when the first has finished


def _own_processes(marker: str):
    """PIDs of processes whose command line names ``marker`` (this test's Ray temp dir)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker in (p / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def _ray_did_not_start(log: str) -> bool:
    """The driver's local Ray failed to start (its dashboard's modules have 30 s, which a machine at load 15-30 can
    miss), before any trial: starting the same command again is what a user would do."""
    return "failed to start" in log and "Trial status" not in log


def test_asha_stops_weak_trials_and_the_sweep_resumes_after_its_driver_is_killed(tiny_baseline, tmp_path):
    from mlflow.tracking import MlflowClient

    from minimind_ray.config import load_config

    ray_dir = tempfile.mkdtemp(prefix="mmrs", dir="/tmp")  # short: Ray's unix sockets live under it
    # (the driver's local Ray gives the dashboard's modules 120 s to start and the dashboard 200 s: session.connect_ray)
    env = {**os.environ, "RAY_TMPDIR": ray_dir}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "pipelines.sweep", "--config", "pipelines/configs/sweep_tiny.yaml",
           f"space={{train.lr: {{grid: {LRS}}}}}", "max_concurrent_trials=1", f"train.max_steps={STEPS}",
           f"checkpoint.storage_path={tmp_path}/runs",
           f"data.cache_dir={tiny_baseline[0]['cache']}",  # the baseline's prepared data and built-in tokenizer
           f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    runs = tmp_path / "runs"
    log = tmp_path / "first.log"
    starts = 0

    def launch():
        nonlocal starts
        starts += 1
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    first = launch()
    try:
        deadline = time.monotonic() + 600
        # killed once a trial has trained to its end and the last trial has started (so that the rerun has little
        # left to train), never after the sweep ended: the resume after a SIGKILL is what this test is for
        while not (list(runs.glob("tiny-lr-*/sweep_trial.json")) and list(runs.glob(f"tiny-lr-*_{len(LRS) - 1:05d}"))):
            if first.poll() is not None and _ray_did_not_start(log.read_text()) and starts < 3:
                first = launch()  # a local Ray whose dashboard missed its start timeout, at load 15-30
                continue
            assert first.poll() is None, f"the first driver ended (exit {first.returncode}) before the kill: " \
                                         + log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)  # the driver, its local Ray and the trials with it
        first.wait(timeout=30)
        for pid in _own_processes(ray_dir):  # whatever of that Ray outlived its process group
            os.kill(pid, signal.SIGKILL)
    # the first driver died of the SIGKILL, with a trial unfinished: the rerun has something to resume
    assert first.returncode == -signal.SIGKILL, (first.returncode, log.read_text()[-4000:])
    finished = {p.parent.name for p in runs.glob("tiny-lr-*/sweep_trial.json")}
    assert 1 <= len(finished) < len(LRS), finished

    t0 = time.monotonic()
    for _ in range(3):
        second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        out = second.stdout + second.stderr
        if second.returncode == 0 or not _ray_did_not_start(out):
            break
    for pid in _own_processes(ray_dir):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(ray_dir, ignore_errors=True)
    assert second.returncode == 0, out[-5000:]
    assert "resuming sweep tiny-lr" in out
    print(f"\nsweep rerun after the kill: {time.monotonic() - t0:.0f}s; finished before the kill: {sorted(finished)}")

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("minimind-pretrain")
    every = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in every if r.data.tags.get("minimind.kind") == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    p = parents[0]
    trials = [r for r in every if r.data.tags.get("mlflow.parentRunId") == p.info.run_id]
    assert len(trials) == len(LRS) and all(r.info.run_name.startswith("tiny-lr-") for r in trials)
    lrs = sorted(float(r.data.params["train.lr"]) for r in trials)
    assert lrs == sorted(LRS)  # each trial's run carries its config
    stopped = [r for r in trials if r.data.tags.get("minimind.sweep.stopped_early") == "true"]
    done = [r for r in trials if r.info.status == "FINISHED"]
    assert stopped and all(r.info.status == "KILLED" for r in stopped), [(r.info.run_name, r.info.status) for r in trials]
    assert len(stopped) + len(done) == len(LRS)
    assert all(int(r.data.tags["minimind.sweep.stopped_at_step"]) < STEPS for r in stopped)
    # ASHA's rungs outlived the kill: every trial's step-4 score is there, those of the trials that reported after
    # the restore too (Tune keeps no scheduler state; raytrain/asha.py)
    rungs = {m: r for m, r in json.loads((runs / "tiny-lr.asha_rungs.json").read_text())["brackets"][0]}
    assert sorted(rungs[4]) == sorted(r.data.tags["minimind.sweep.trial_id"] for r in trials), rungs
    # the trials that had finished before the kill were not trained again: their runs were never reopened
    by_name = {r.info.run_name: r for r in trials}
    assert finished and all("minimind.resumes" not in by_name[n].data.tags for n in finished)
    # the best trial, on the parent and as a ready recipe
    best = by_name[p.data.tags["best.run_name"]]
    assert p.data.tags["best.run_id"] == best.info.run_id and best.info.status == "FINISHED"
    scores = {r.info.run_name: r.data.metrics.get("eval/loss") for r in done}
    assert best.info.run_name == min(scores, key=scores.get)
    assert abs(float(p.data.tags["best.score"]) - p.data.metrics["best/eval_loss"]) < 1e-9
    recipe = load_config(str(runs / "tiny-lr" / "best.yaml"))
    assert recipe.train.lr == float(best.data.params["train.lr"]) and recipe.train.max_steps == STEPS and recipe.name is None
    assert json.loads(p.data.tags["best.params.train.lr"]) == recipe.train.lr
