"""Resume by re-running (issue 15): a run started with no name, its driver SIGKILLed after a checkpoint,
then the identical command run again, continues from that checkpoint and ends bit-identical to an
uninterrupted run, in one MLflow run.

The first driver is stopped at a known place: its rank 1 hangs at step 10 (after the step-8 checkpoint;
fault hooks are runtime settings, outside the run's identity), and the test kills the driver then.
The second run passes step 10: the hang fires once per run (a marker in the run directory). The run has
the training settings of helpers.run_tiny, so the session's uninterrupted ``tiny_baseline`` is its twin."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minimind_ray.config import load_config, run_identity
from minimind_ray.store.checkpoint import MODEL, checkpoints_in

from .helpers import CKPT_EVERY, GLOBAL_BATCH, STEPS, assert_exactly_once, sample_record

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
# lines of Ray's and MLflow's own, as a 2-worker run printed them before issue 38
RAY_INTERNAL = re.compile(r"TrainingReport\(|core_worker\.cc|PreemptionWatcher|logging_progress|streaming_executor|"
                          r"Started a local Ray|mlflow\.store|\(raylet\)|\d INFO |\tINFO ")


def _overrides(base: Path, address: str):
    return ["--config", "pipelines/configs/tiny.yaml", f"train.max_steps={STEPS}", f"checkpoint.interval={CKPT_EVERY}",
            "train.log_interval=2", f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=4",
            f"data.cache_dir={base / 'cache'}", f"checkpoint.storage_path={base / 'runs'}",
            f"tracking.uri=sqlite:///{base}/mlflow.db", f"cluster.address={address}",
            f"train.sample_log_dir={base / 'samples'}", "train.collective_timeout_s=600"]


def _driver(args, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipelines.pretrain", *args], cwd=REPO, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_the_same_command_resumes_after_the_driver_is_killed(ray_session, tiny_baseline, tmp_path):
    from mlflow.tracking import MlflowClient

    address = ray_session.get_runtime_context().gcs_address
    base = tmp_path / "killed"
    args = _overrides(base, address)
    cfg = load_config("pipelines/configs/tiny.yaml", args[2:])
    name = run_identity(cfg)
    run_dir = base / "runs" / name

    first = _driver(args + ["train.hang_at_step=10", "train.fail_rank=1"], tmp_path / "first.log")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        if (run_dir / ".faults" / "10-hang-1.json").exists() and any(s == 8 for s, _ in checkpoints_in(run_dir)):
            break
        time.sleep(0.2)
    assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)  # the driver and anything it started itself, at once
    first.wait(timeout=30)

    second = subprocess.run([sys.executable, "-m", "pipelines.pretrain", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resuming run {name} from step 8 of {STEPS}" in second.stdout
    # a quiet console (issue 38): minimind-ray's own lines and where Ray's logs are, nothing of Ray's or MLflow's
    console = (second.stdout + second.stderr).splitlines()
    assert any(line.startswith("[minimind-ray] Ray's own logs: ") for line in console), console
    internal = [line for line in console if RAY_INTERNAL.search(line)]
    assert not internal, internal
    # piped (issue 47): the workers' own lines as they wrote them, no "(RayTrainWorker pid=...)" prefix, no colour codes
    assert any(line.startswith("[minimind-ray] world 2 on ") for line in console), console
    prefixed = [line for line in console if "\x1b[" in line or re.match(r"\(\w+ pid=\d+", line)]
    assert not prefixed, prefixed

    ckpts = {s: p for s, p in checkpoints_in(run_dir)}
    w = torch.load(Path(ckpts[STEPS]) / MODEL, weights_only=True)
    w_ref = tiny_baseline[2]  # the same training settings, never interrupted
    assert all(torch.equal(w[k], w_ref[k]) for k in w_ref), "the resumed run differs from the uninterrupted one"

    per_step, attempts = sample_record({"base": base}, "")
    assert attempts == {0, 8}  # the second driver's workers started from the step-8 checkpoint
    assert_exactly_once(per_step, steps=STEPS)
    client = MlflowClient(f"sqlite:///{base}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`minimind.run_name` = '{name}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert [m.step for m in sorted(client.get_metric_history(runs[0].info.run_id, "train/loss"), key=lambda m: m.step)] \
        == list(range(1, STEPS + 1))
    # the same command once more: a no-op that says where the results are, exit 0 (issue 38), Ray never started
    third = subprocess.run([sys.executable, "-m", "pipelines.pretrain", *args], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert third.stdout.strip().splitlines()[-1].startswith(
        f"[minimind-ray] {name} already finished at step {STEPS}: {run_dir}, {run_dir / 'export'}, "
        f"MLflow {runs[0].info.run_id}; "), third.stdout
    assert "Ray's own logs" not in third.stdout
