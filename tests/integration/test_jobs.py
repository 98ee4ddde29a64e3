"""The cluster path for real: `ray job submit` to a `ray start --head` cluster, and a node lost mid-run.

Both use cluster/local/start.sh (what users run), on free ports, and stop exactly what they started.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from minimind_ray.store.checkpoint import open_checkpoint

from .helpers import assert_exactly_once, sample_record
from .local_cluster import RAY_BIN, REPO, _free_base, _sh

pytestmark = pytest.mark.integration


def common_args(tmp: Path, name: str):
    return ["--config", "pipelines/configs/tiny.yaml", f"name={name}", f"checkpoint.storage_path={tmp}/runs",
            f"data.cache_dir={tmp}/cache", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
            f"train.sample_log_dir={tmp}/samples/{name}"]


@pytest.mark.timeout(600)
def test_ray_job_submit_runs_the_tiny_pretrain(cluster_env, tmp_path):
    from mlflow.tracking import MlflowClient

    state, env = cluster_env
    base = _free_base(1)
    r = _sh("start.sh", "1", "--state-dir", state, "--port", str(base), "--head-cpus", "2", "--worker-cpus", "2",
            env=env)
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    cmd = [str(RAY_BIN), "job", "submit", "--address", f"http://127.0.0.1:{base + 1}", "--working-dir", str(REPO),
           "--", "python", "-m", "pipelines.pretrain", *common_args(tmp_path, "job-tiny"), "train.max_steps=10"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500, cwd=REPO)
    elapsed = time.monotonic() - t0
    assert p.returncode == 0 and "succeeded" in p.stdout.lower(), (p.stdout[-4000:], p.stderr[-2000:])
    ckpts = [c for c in (tmp_path / "runs" / "job-tiny").glob("checkpoint_*") if c.is_dir()]
    assert ckpts and max(open_checkpoint(c).step for c in ckpts) == 10
    runs = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_runs(
        [e.experiment_id for e in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_experiments()],
        filter_string="attributes.run_name = 'job-tiny'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert "ray.job_submission_id" in runs[0].data.tags
    print(f"\nray job submit, tiny pretrain, end to end: {elapsed:.0f}s")


@pytest.mark.timeout(600)
def test_training_continues_after_losing_a_worker_node(cluster_env, tmp_path):
    """One training worker per node (trainslot); node 2 is killed mid-run. The run restarts from its
    last checkpoint on the node that is left (elastic 1..2 workers) and trains every sample once."""
    state, env = cluster_env
    base = _free_base(2)
    r = _sh("start.sh", "2", "--state-dir", state, "--port", str(base), "--head-cpus", "2", "--worker-cpus", "1",
            env=env, timeout=240)
    assert r.returncode == 0, r.stderr
    steps, name = 60, "node-loss"
    driver = subprocess.Popen(
        [sys.executable, "-m", "pipelines.pretrain", *common_args(tmp_path, name), f"cluster.address=127.0.0.1:{base}",
         "cluster.num_workers=2", "cluster.min_workers=1", "cluster.worker_resource=trainslot",
         "cluster.resource_timeout_s=20", f"train.max_steps={steps}", "checkpoint.interval=5", "tracking.enabled=false"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "samples" / name / "rank1.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and driver.poll() is None:
        if log.exists() and sum(1 for _ in log.open()) >= 8:
            break
        time.sleep(0.2)
    assert driver.poll() is None, driver.stdout.read()[-4000:]
    assert _sh("kill_node.sh", "2", "--state-dir", state, env=env, timeout=30).returncode == 0
    out, _ = driver.communicate(timeout=420)
    assert driver.returncode == 0, out[-5000:]
    per_step, attempts = sample_record({"base": tmp_path}, name)
    assert_exactly_once(per_step, steps=steps)
    assert len(attempts) >= 2, "no restart seen after the node was killed"
