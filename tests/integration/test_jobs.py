"""The cluster path for real: a run sent with `ray job submit` to a `ray start --head` cluster loses a node mid-run.

It uses cluster/local/start.sh (what users run), on free ports, and stops exactly what it started. (The job submission
and the node loss were two tests, each with its own cluster and run: one costs ~2 minutes less on 2 cores.)
"""
from __future__ import annotations

import json
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

from minimind_ray.store.checkpoint import open_checkpoint

from .helpers import assert_exactly_once, sample_record
from .local_cluster import RAY_BIN, REPO, _free_base, _sh, start_cluster

pytestmark = pytest.mark.integration


def common_args(tmp: Path, name: str):
    return ["--config", "pipelines/configs/tiny.yaml", f"name={name}", f"checkpoint.storage_path={tmp}/runs",
            f"data.cache_dir={tmp}/cache", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
            f"train.sample_log_dir={tmp}/samples/{name}"]


def _wait_for(what: str, cond, driver: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Poll ``cond`` until true; fail naming ``what`` (with the driver's last output) when the driver ends first."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert driver.poll() is None, f"the driver ended before {what}: {log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s: {log.read_text()[-4000:]}"
        time.sleep(0.2)


def _start(*args: str, env: dict) -> None:
    r = start_cluster(*args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


def _rank0_lines(samples: Path):
    """Rank 0's sample-log lines so far, in the order written (a line being written is left out)."""
    f, out = samples / "rank0.jsonl", []
    for line in f.read_text().splitlines() if f.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


@pytest.mark.timeout(900)
def test_a_submitted_job_continues_after_losing_a_worker_node(cluster_env, tmp_path):
    """`ray job submit` (the repo as the job's working dir) runs the tiny pretrain on the cluster, with one training
    worker per node (trainslot), elastic 1..2 workers. Node 2 is killed mid-run: the run restarts from its last
    checkpoint on the node that is left. Node 2 is started again: Ray Train's elastic policy sees its trainslot come
    back and restarts the group with 2 workers from the newest checkpoint (docs/training.md, "Elastic scale-up").
    The world goes 2 -> 1 -> 2 workers, every sample is trained once and every step trains one global batch of 16
    samples, whatever the world size; the job succeeds, its MLflow run FINISHED and tagged with the job's id."""
    from mlflow.tracking import MlflowClient

    state, env = cluster_env
    base = _free_base(2)
    _start("2", "--state-dir", state, "--port", str(base), "--head-cpus", "2", "--worker-cpus", "1", env=env)
    steps, name = 40, "node-loss"
    samples, log = tmp_path / "samples" / name, tmp_path / "driver.log"
    # Rank 0 stalls up to 300 s at step 14, which the run reaches on 1 worker: room for node 2 to come
    # back and for the group to grow. A resize ends the stall early: the new group restores from the
    # step-10 checkpoint and the fault, fired once per run, does not fire again.
    # the job client follows the job's log to its end: its exit is the job's
    with open(log, "w") as out:
        driver = subprocess.Popen(
            [str(RAY_BIN), "job", "submit", "--address", f"http://127.0.0.1:{base + 1}", "--working-dir", str(REPO),
             "--", "python", "-m", "pipelines.pretrain", *common_args(tmp_path, name),
             "cluster.num_workers=2", "cluster.min_workers=1", "cluster.worker_resource=trainslot",
             "cluster.resource_timeout_s=20", f"train.max_steps={steps}", "checkpoint.interval=5",
             "train.faults=[14:slow:0:300]"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for("step 8 on 2 workers", lambda: any(r["step"] >= 8 for r in _rank0_lines(samples)), driver, log)
        assert _sh("kill_node.sh", "2", "--state-dir", state, env=env, timeout=30).returncode == 0
        _wait_for("step on 1 worker", lambda: any(r["world"] == 1 for r in _rank0_lines(samples)), driver, log)
        _start("--node", "2", "--state-dir", state, env=env)
        assert driver.wait(timeout=600) == 0 and "succeeded" in log.read_text().lower(), log.read_text()[-5000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    ckpts = [c for c in (tmp_path / "runs" / name).glob("checkpoint_*") if c.is_dir()]
    assert ckpts and max(open_checkpoint(c).step for c in ckpts) == steps
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"attributes.run_name = '{name}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert "ray.job_submission_id" in runs[0].data.tags
    per_step, attempts = sample_record({"base": tmp_path}, name)
    assert_exactly_once(per_step, steps=steps)
    worlds = [r["world"] for r in _rank0_lines(samples)]
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [2, 1, 2], worlds
    # every step a worker group completed trained 16 samples, split over its ranks (8 + 8, or 16 on one)
    lines = defaultdict(list)
    for f in samples.glob("rank*.jsonl"):
        for r in map(json.loads, f.read_text().splitlines()):
            lines[r["attempt"], r["world"], r["step"]].append(len(r["ids"]))
    complete = {k: v for k, v in lines.items() if len(v) == k[1]}
    assert {k[1] for k in complete} == {1, 2} and all(sum(v) == 16 for v in complete.values()), complete
