"""The training core on a real local Ray (Train V2, gloo, CPU), tiny preset.

One uninterrupted 2-worker run is the baseline; every other run is compared with it:
  * 1 worker at the same global batch (a resumed run's last 15 steps): the same losses step for step (tolerance
    below), and bit for bit what the engine trains in this process with no Ray;
  * an injected exception, and a SIGKILL of a worker process: the same final weights, bit for bit;
  * a driver-level resume after a failed run, with a different worker count: the same data
    position and global batch, weights equal to a tight tolerance;
and in every case each sample is trained on exactly once.

Why a tolerance across worker counts: 1 worker sums the micro-batch gradients in one
process, 2 workers sum halves and all-reduce them, so float additions happen in a
different order (about 1e-7 relative per step, growing slowly through Adam).
Between runs with the same worker count the order is identical, so equality is exact.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from minimind_ray.config import from_dict
from minimind_ray.config import load_config
from minimind_ray.store.checkpoint import MODEL

from .helpers import (CKPT_EVERY, STEPS, assert_exactly_once, final_weights, loss_history, new_shared,
                      run_tiny, sample_record)

pytestmark = pytest.mark.integration

LOSS_ATOL_ACROSS_WORLD_SIZES = 2e-4
WEIGHT_ATOL_ACROSS_WORLD_SIZES = 1e-4


def assert_same_run_across_world_sizes(losses, losses_ref, weights, weights_ref):
    """Same steps, losses and final weights as the reference, to the cross-world-size tolerances."""
    assert [s for s, _ in losses] == [s for s, _ in losses_ref] == list(range(1, STEPS + 1))
    for (s, a), (_, b) in zip(losses, losses_ref):
        assert abs(a - b) <= LOSS_ATOL_ACROSS_WORLD_SIZES, f"step {s}: {a} vs reference {b}"
    for k in weights_ref:
        torch.testing.assert_close(weights[k], weights_ref[k], atol=WEIGHT_ATOL_ACROSS_WORLD_SIZES, rtol=0)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return new_shared(tmp_path_factory, "training")


@pytest.fixture(scope="module")
def baseline(tiny_baseline):
    return tiny_baseline[1:]  # (result, final weights, per-step losses)


def test_baseline_runs_with_checkpoints_and_exactly_once(tiny_baseline):
    shared, res, weights, losses = tiny_baseline
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    assert losses[-1][1] < losses[0][1], "loss did not fall"
    ckpts = sorted(p for p in Path(res.run_dir).glob("checkpoint_*") if p.is_dir())
    assert ckpts and all((c / "COMPLETE.json").exists() for c in ckpts)
    per_step, attempts = sample_record(shared, "baseline-2w")
    assert_exactly_once(per_step)
    assert attempts == {0}


@pytest.fixture(scope="module")
def resumed_on_one_worker(baseline, shared):
    """A 2-worker run that fails at step 6 (no retries), then the same command on 1 worker: it resumes from the
    step-5 checkpoint. (The 1-worker side of the world-size checks: a separate 1-worker run from step 0 was one
    Ray Train run more for what this one's 15 steps on 1 worker show.)"""
    from minimind_ray.raytrain import progress
    from minimind_ray.raytrain.restarts import RestartsSpent

    name = "resume-2w-to-1w"
    # Ray Train's page of tracebacks is one line (issue 47), the tracebacks in the run's error.log
    with pytest.raises(RestartsSpent, match=r"^cluster.max_failures=0 spent; the last failure was rank \d: RuntimeError: "
                                            r"injected failure at step 6 \(train.faults\)\. The run is kept"):
        run_tiny(shared, name, "train.fail_at_step=6", "cluster.max_failures=0")
    assert "Traceback" in (shared["base"] / "runs" / name / "error.log").read_text()
    sinks = [h._actor_id for h in progress._SINK.values()]
    res = run_tiny(shared, name, "cluster.num_workers=1")  # same name + storage: resumes
    # the driver's console view: one ProgressSink actor serves both runs of this process (an actor is a process)
    assert [h._actor_id for h in progress._SINK.values()] == sinks and len(sinks) == 1
    return res


def test_driver_resume_with_a_different_worker_count(baseline, resumed_on_one_worker, shared):
    """The same data position and global batch on 1 worker: each sample once, and the 2-worker run's losses and
    weights to the cross-world-size tolerances."""
    _, w_ref, losses_ref = baseline
    res = resumed_on_one_worker
    per_step, attempts = sample_record(shared, "resume-2w-to-1w")
    assert attempts == {0, CKPT_EVERY}
    assert_exactly_once(per_step)
    # each step once in the resumed MLflow run, with the uninterrupted run's values
    assert_same_run_across_world_sizes(loss_history(shared, res.mlflow_run_id), losses_ref, final_weights(res), w_ref)


def test_one_worker_equals_plain_single_process_training(resumed_on_one_worker):
    """world_size=1 on Ray Train is plain PyTorch: the engine's own loop with no Ray and no process group, restored
    from the 1-worker run's oldest kept checkpoint, ends on bit-identical weights (same data order, same ops, one
    thread like the worker)."""
    from minimind_ray.engine.loop import run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.store.checkpoint import checkpoints_in, open_checkpoint

    res = resumed_on_one_worker
    step, oldest = min(checkpoints_in(res.run_dir))
    stored = open_checkpoint(oldest)
    meta = stored.meta()
    assert meta.config["cluster"]["num_workers"] == 1 and CKPT_EVERY < step < STEPS, (step, meta.config["cluster"])
    threads = torch.get_num_threads()
    try:
        state = TrainState.build(from_dict(meta.config), meta.prepared_dir)  # sets the worker's thread count
        state.restore(stored)
        run(state)
    finally:
        torch.set_num_threads(threads)
    w_ray = final_weights(res)
    plain = state.model.state_dict()
    assert state.step == STEPS
    assert all(torch.equal(w_ray[k], plain[k]) for k in w_ray)


def test_checkpoint_loads_into_a_bare_model_with_strict_keys(baseline):
    from minimind_ray.model.minimind import build_model
    from minimind_ray.store.pth import load_pth

    res, _, _ = baseline
    cfg = load_config("pipelines/configs/tiny.yaml")
    model = build_model(cfg.model)
    load_pth(model, str(Path(res.checkpoint_dir) / MODEL), strict=True)


def test_a_request_the_cluster_cannot_hold_fails_fast(ray_session, shared):
    import time

    from minimind_ray.raytrain.resources import ClusterTooSmall

    t0 = time.monotonic()
    with pytest.raises(ClusterTooSmall, match="GPU"):
        run_tiny(shared, "too-big", "cluster.num_workers=4", "cluster.use_gpu=true", "cluster.resource_timeout_s=2")
    assert time.monotonic() - t0 < 60


def test_rollout_actors_the_cluster_cannot_place_fail_fast_naming_the_field(ray_session, tmp_path):
    """Workers that fit with rollout actors beside them that do not (the session's Ray has 4 CPUs: 2 workers, 3
    actors of 1 CPU) is an error naming train.rollout.actors, not an actor left pending forever."""
    from minimind_ray.config import load_config, resolve_run
    from minimind_ray.model.minimind import build_model
    from minimind_ray.raytrain.resources import ClusterTooSmall, check_resources
    from minimind_ray.store.pth import save_pth

    base = tmp_path / "base.pth"
    save_pth(build_model(load_config(None, ["data.train_path=[demo]", "model.preset=tiny"]).model, seed=0), str(base))
    grpo = lambda *extra: resolve_run(None, [  # noqa: E731
        "data.train_path=[demo]", "model.preset=tiny", "train.stage=grpo", "data.format=prompt",
        f"train.init_from={base}", "cluster.num_workers=2", "cluster.resource_timeout_s=0.5", "train.grpo.rollout=actors",
        *extra])
    fits, too_many = grpo("train.grpo.rollout_actors=2"), grpo("train.grpo.rollout_actors=3")
    check_resources(fits.cfg, fits.stage, use_gpu=False)  # 2 + 2 CPUs: fits
    with pytest.raises(ClusterTooSmall, match=r"^train\.rollout\.actors: .* 3 rollout actor\(s\)"):
        check_resources(too_many.cfg, too_many.stage, use_gpu=False)


def test_an_error_that_recurs_the_same_way_ends_the_run_after_two_attempts(ray_session, shared):
    """Issue 47: an exception that is neither a fault nor the user's input (a bug) is retried once; when the next
    attempt fails the same way (type, message, step) the run ends, in one line, its traceback in error.log. The 'bug'
    entry raises at step 3 on every attempt: the first attempt checkpoints step 2, the second restores it and fails at
    step 3 again."""
    from minimind_ray.failures import ERROR, RunStopped
    from minimind_ray.raytrain.faults import worker_failures_since

    with pytest.raises(RunStopped) as stop:
        run_tiny(shared, "recurring-bug", "train.faults=[3:bug:1]", steps=4, ckpt_every=2)
    run_dir = shared["base"] / "runs" / "recurring-bug"
    v = stop.value.verdict
    assert (v.kind, v.rank, v.signature[2]) == (ERROR, 1, 3)
    assert str(stop.value) == (f"rank 1 failed the same way twice at step 3: RuntimeError: simulated bug at step 3: the "
                               f"'bug' entry of the fault schedule, raised on every attempt (not retried again; "
                               f"traceback: {run_dir / 'error.log'})")
    assert worker_failures_since(str(run_dir), 0) == 2
    assert "in before_step" in (run_dir / "error.log").read_text()


def chaos_story(run_dir) -> str:
    """A chaos run's markers in time order: each fault fired, each rank's failure (its step and innermost frames:
    raytrain/faults.py:FaultInjector.record_failure) and each failure the controller detected."""
    from minimind_ray.raytrain.faults import fired

    marks = sorted(fired(str(run_dir)).items(), key=lambda kv: kv[1].get("t", 0))
    t0 = marks[0][1].get("t", 0) if marks else 0
    lines = []
    for key, r in marks:
        if key.startswith("failed-"):
            what = f"step {r['step']}: {r['error'][:120]} at {' < '.join(reversed(r['where']))}"
        else:
            what = str(r.get("errors", ""))[:160]
        lines.append(f"  +{r.get('t', 0) - t0:6.1f} s {key} {what}")
    return "\n".join(lines)


def unplanned_detections(marks: dict, planned: tuple) -> list:
    """The controller's detections (``detected-*`` markers) that no planned fault explains: each fault's
    detection is the first one after it fired."""
    detections = sorted((r["t"], k) for k, r in marks.items() if k.startswith("detected-"))
    explained = set()
    for fault in planned:
        after = [k for t, k in detections if t >= marks[fault]["t"] and k not in explained]
        if after:
            explained.add(after[0])
    return [(k, marks[k]) for _, k in detections if k not in explained]


# The hang the start faults guard against never ends (every later start waited for leaked CPUs), so the limit is
# generous: 142 s here beside test_node_faults' 3-node cluster on a quick day, and a CI machine on a slow day (the
# whole suite 2x slower) ran out of 420 s with the run still restarting.
@pytest.mark.timeout(900)
def test_a_schedule_of_mixed_faults_recovers_bit_for_bit(baseline, shared, capfd):
    """Issues 16 and 32: one run meets every kind of fault, each once, in this order.

    While Ray Train starts the worker group, a worker process is SIGKILLed at each point of the start: in the worker
    actor's start (its train context arriving), inside the torch backend's set-up (Ray Train 2.58 had built the
    group's state there and leaked its placement group: every later start timed out, without end), and as the train
    function is handed over (a bare ActorDiedError that ended the run). Then an exception on rank 0 at step 3 (before
    the first checkpoint: back to step 0), a SIGKILL of rank 1 at step 6 (back to 4, even when the hard kill kept Ray
    from registering the step-4 checkpoint), rank 1 hanging at step 9 (rank 0's collective times out after 10 s: back
    to 8), and rank 1 dying after the last checkpoint's upload but before Ray Train got its report (lost_report; the
    chaos soak's soak-01): the run must still end on that checkpoint.

    Each costs one restart counted against cluster.max_failures (8 here: the 7 faults and one spare for a collective
    timeout of a healthy group on a loaded machine; nothing else unplanned may fail); no placement group is left
    behind; the weights equal the uninterrupted baseline bit for bit, every sample is trained once, each fault cost
    at most one checkpoint interval, storage holds only what Ray keeps, and one MLflow run has every step once."""
    import ray

    from minimind_ray.raytrain.faults import fired

    _, w_ref, losses_ref = baseline
    name = "chaos"
    before = set(ray.util.placement_group_table())
    try:
        res = run_tiny(shared, name, "train.faults=[start:actor:0,start:backend:1,start:launch:1,3:raise:0,"
                                     "6:sigkill:1,9:hang:1,12:lost_report:1]", "train.collective_timeout_s=10",
                       "cluster.max_failures=8")
    except Exception as e:  # the budget is the 7 faults and one spare: say what failed where, in order
        raise AssertionError(f"the run failed: {str(e)[:300]}\n{chaos_story(shared['base'] / 'runs' / name)}") from e
    # what held the CPUs in the hang: the placement group of a group whose start failed. None is left.
    left = {pg: t["state"] for pg, t in ray.util.placement_group_table().items() if pg not in before}
    assert len(left) >= 7 and set(left.values()) == {"REMOVED"}, left
    # Ray Train's actors for its 8 worker groups, less Ray Data's DatasetManager (raytrain/trainer.py)
    classes = {a["ActorClassName"] for a in ray._private.state.actors().values()}
    assert "TrainController" in classes and "DatasetManager" not in classes, classes
    w = final_weights(res)
    assert all(torch.equal(w[k], w_ref[k]) for k in w_ref), "weights differ from the uninterrupted run"
    per_step, attempts = sample_record(shared, name)
    assert_exactly_once(per_step)
    assert attempts == {0, 4, 8}  # the restarts at the start trained nothing before the step-3 failure
    marks = fired(res.run_dir)
    assert {"start-actor-0", "start-backend-1", "start-launch-1", "3-raise-0", "6-sigkill-1", "9-hang-1",
            "12-lost_report-1"} <= set(marks)
    assert len([k for k in marks if k.startswith("detected-")]) >= 4  # the controller saw every worker failure
    unplanned = unplanned_detections(marks, ("3-raise-0", "6-sigkill-1", "9-hang-1", "12-lost_report-1"))
    # the spare: a healthy rank that a loaded machine held past the 10 s collective timeout (CI of stops 44 and 45,
    # beside another test file on 2 cores); anything else unplanned fails, and the spare is said in a warning
    assert len(unplanned) <= 1 and all("Timed out waiting" in e for _, r in unplanned for e in r["errors"].values()), \
        chaos_story(res.run_dir)
    if unplanned:
        warnings.warn(f"mixed faults: a collective timed out in a healthy group:\n{chaos_story(res.run_dir)}")
    out = capfd.readouterr().out
    restarts = re.findall(r"\[chaos\] the worker group did not start: (.*); starting it again "
                          r"\(failure (\d) of cluster.max_failures=8\)", out)
    assert [n for _, n in restarts] == ["1", "2", "3"], out[-3000:]
    assert "received the train function" in restarts[2][0]
    # the last checkpoint reached storage but never Ray Train's registry: the restarted group restored it, had no
    # step left, and reported it again (else the run's result and export were step 8's, and step 12's was deleted)
    assert "step 12 was the last; its checkpoint was not registered by Ray Train: reporting it again" in out
    assert res.metrics.get("step") == 12 and "loss" in res.metrics
    # storage holds what Ray keeps (num_to_keep), no unregistered leftovers of the killed attempts
    kept = {Path(c["path"]).name for c in json.loads((Path(res.run_dir) / "export" / "checkpoints.json").read_text())}
    assert {p.name for p in Path(res.run_dir).glob("checkpoint_*") if p.is_dir()} == kept and len(kept) == 2
    # one MLflow run, each step logged once, with the uninterrupted run's values
    losses = loss_history(shared, res.mlflow_run_id)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    assert losses == losses_ref