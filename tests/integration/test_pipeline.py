"""One job from data to a registered model (issue 23): pipelines/configs/pipeline_demo.yaml at miniature size
(tiny preset, a few steps per stage, 1 worker), its driver SIGKILLed during its second training stage (SFT) after a
checkpoint, then the same command run again: the finished steps are skipped, SFT resumes from its checkpoint, the
rest runs, and MLflow holds one parent run whose children carry the lineage from the data to the registered model.

The pretrain stage's data settings are those of the session's tiny_baseline, so its prepared data and the built-in
tokenizer come from that run's cache instead of being made again."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SFT_STEPS = 8


def _miniature(base: Path, cache: Path) -> Path:
    """The demo pipeline with overrides that make every stage small; the SFT stage stalls at step 6 (once per run:
    the fault's marker lives in the run's storage) so the test can kill the driver there."""
    pipe = yaml.safe_load((REPO / "pipelines/configs/pipeline_demo.yaml").read_text())
    pipe["name"] = "mini-demo"
    pipe["overrides"] = ["model.preset=tiny", "data.max_seq_len=64", "data.block_rows=64", "train.max_steps=8",
                         "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_interval=2",
                         "checkpoint.interval=4", "cluster.num_workers=1", "eval.tasks=[]", "train.eval_interval=0",
                         f"checkpoint.storage_path={base / 'runs'}", f"data.cache_dir={cache}",
                         f"tracking.uri=sqlite:///{base}/mlflow.db"]
    steps = {s["name"]: s for s in pipe["steps"]}
    steps["sft"]["overrides"] = [f"train.max_steps={SFT_STEPS}", "train.faults=[6:slow:0:120]"]
    steps["grpo"]["overrides"] = ["train.max_steps=2", "train.grpo.num_generations=4", "checkpoint.interval=2"]
    for t in steps["eval"]["tasks"]:
        t["limit"] = 40
    steps["register"]["registered_model"] = "minimind-mini-demo"
    path = base / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipe, sort_keys=False))
    return path


def test_the_demo_pipeline_resumes_after_its_driver_is_killed_and_records_its_lineage(ray_session, tiny_baseline,
                                                                                      tmp_path):
    from mlflow.tracking import MlflowClient

    from minimind_ray.store.checkpoint import checkpoints_in

    cache = tiny_baseline[0]["cache"]  # the baseline's prepared pretrain data and built-in tokenizer
    cfg = _miniature(tmp_path, cache)
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    cmd = [sys.executable, "-m", "pipelines.pipeline", "--config", str(cfg)]
    sft_dir = tmp_path / "runs" / "mini-demo-sft"
    log = tmp_path / "first.log"
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and first.poll() is None:
        if (sft_dir / ".faults" / "6-slow-0.json").exists() and any(s == 4 for s, _ in checkpoints_in(sft_dir)):
            break
        time.sleep(0.2)
    assert first.poll() is None, log.read_text()[-4000:]
    os.killpg(first.pid, signal.SIGKILL)  # the driver, in SFT's step 6, after its step-4 checkpoint
    first.wait(timeout=30)

    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-5000:]
    assert "step prepare: finished before, skipped" in out and "step pretrain: finished before, skipped" in out
    assert f"resuming run mini-demo-sft from step 4 of {SFT_STEPS}" in out

    state = json.loads((tmp_path / "runs" / "mini-demo" / "pipeline.json").read_text())["steps"]
    assert list(state) == ["prepare", "pretrain", "sft", "grpo", "eval", "register"]

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("minimind-mini-demo")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("minimind.kind") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED", [r.data.tags for r in parents]
    parent = parents[0].info.run_id
    assert parents[0].data.tags.get("minimind.resumes") == "1"  # the rerun reopened it
    kids = {r.data.tags.get("minimind.pipeline.stage"): r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent}
    assert set(kids) == {"prepare", "pretrain", "sft", "grpo", "eval"}, sorted(kids)
    ids = {k: r.info.run_id for k, r in kids.items()}
    tags = {k: r.data.tags for k, r in kids.items()}
    # lineage: the data's manifest hash on every training run (the pretrain stage's equals the prepare stage's),
    # each stage started from the run before it
    sha = tags["prepare"]["minimind.data.manifest_sha256"]
    assert len(sha) == 64 and tags["pretrain"]["minimind.data.manifest_sha256"] == sha
    assert all(len(tags[k]["minimind.data.manifest_sha256"]) == 64 for k in ("sft", "grpo"))
    assert "minimind.init_from.run_id" not in tags["pretrain"]
    assert tags["sft"]["minimind.init_from.run_id"] == ids["pretrain"]
    assert tags["grpo"]["minimind.init_from.run_id"] == ids["sft"]
    assert tags["eval"]["minimind.evaluated.run_id"] == ids["grpo"]
    assert "minimind.resumes" not in tags["pretrain"] and tags["sft"].get("minimind.resumes") == "1"
    assert all(r.info.status == "FINISHED" for r in kids.values())
    steps = sorted(m.step for m in client.get_metric_history(ids["sft"], "train/loss"))
    assert steps == list(range(1, SFT_STEPS + 1))  # the resumed SFT logged every step once
    assert {"eval/mc_eval/acc", "eval/sort_heldout/greedy_acc"} <= set(kids["eval"].data.metrics)
    mv = client.get_model_version("minimind-mini-demo", state["register"]["model_version"])
    assert mv.run_id == ids["grpo"] and mv.tags["minimind.pipeline.run_id"] == parent
    assert mv.tags["minimind.init_from.run_id"] == ids["sft"] and mv.tags["minimind.data.manifest_sha256"] == \
        tags["grpo"]["minimind.data.manifest_sha256"]
