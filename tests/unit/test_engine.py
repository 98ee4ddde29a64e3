"""The training engine on its own: no Ray, no process group, CPU (two ranks over plain gloo, DDP and FSDP side by
side: tests/unit/test_fsdp.py).

The data and model are the small ones of tests/fixtures/checkpoint_v1 (a 33k-parameter model on
prepared data of the demo corpus), so every test here takes a second or two.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minimind_ray.config import from_dict
from minimind_ray.engine.loop import Hooks, run
from minimind_ray.engine.state import TrainState
from minimind_ray.engine.step import train_step
from minimind_ray.store.checkpoint import open_checkpoint
from minimind_ray.store.pth import read_pth

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1"
PREPARED = str(FIXTURE / "prepared")
REPO = Path(__file__).resolve().parents[2]


def fixture_config(**train):
    """The config the fixture's run used, with its machine's paths dropped."""
    cfg = from_dict(open_checkpoint(FIXTURE / "checkpoint_step4").meta().config)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, sample_log_dir=None, **train))


class Recorder(Hooks):
    def __init__(self):
        self.losses, self.checkpoints = {}, []

    def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
        self.losses.update(per_step_loss)

    def on_checkpoint(self, step, metrics):
        self.checkpoints.append(step)


class MetricsByStep(Hooks):
    """Each step's metrics, by step (the RL stages' tests read their rewards and losses from it)."""

    def __init__(self):
        self.by_step = {}

    def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
        self.by_step[step] = metrics


def test_engine_and_store_import_no_ray():
    code = "import sys, minimind_ray.engine, minimind_ray.store.weights; assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_engine_trains_n_steps_without_ray():
    state = TrainState.build(fixture_config(max_steps=8), PREPARED)
    rec = Recorder()
    run(state, rec)
    assert state.step == 8 and sorted(rec.losses) == list(range(1, 9))
    assert rec.checkpoints == [4, 8]  # checkpoint.interval=4 and the last step
    assert rec.losses[8] < rec.losses[1], rec.losses


def test_save_and_restore_continue_bit_for_bit(tmp_path):
    cfg = fixture_config(max_steps=8)
    straight = TrainState.build(cfg, PREPARED)
    run(straight)

    class SaveAt4(Hooks):
        def on_checkpoint(self, step, metrics):
            if step == 4:
                first.save(tmp_path / "ck", mlflow_run_id="run-1", prepared_dir=PREPARED)
                raise KeyboardInterrupt  # stop here, as a crash would

    first = TrainState.build(cfg, PREPARED)
    with pytest.raises(KeyboardInterrupt):
        run(first, SaveAt4())
    first.stream.close()
    resumed = TrainState.build(cfg, PREPARED)
    meta = resumed.restore(open_checkpoint(tmp_path / "ck"))
    assert (meta.step, meta.mlflow_run_id, resumed.step) == (4, "run-1", 4)
    run(resumed)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_written_before_the_redesign_resumes():
    """tests/fixtures/checkpoint_v1 was written by the code before the engine/store redesign. Today's
    engine resumes it at step 4 and ends at step 8 with the weights that run ended with.

    Compared with a tolerance of 1e-6 rather than bit for bit: the fixture was made on another machine,
    and a CPU with other vector units may sum in another order (the weights are ~1e-2)."""
    state = TrainState.build(fixture_config(), PREPARED)
    meta = state.restore(open_checkpoint(FIXTURE / "checkpoint_step4"))
    assert (meta.step, meta.world_size, state.step, state.total_steps) == (4, 1, 4, 8)
    run(state)
    want = read_pth(str(FIXTURE / "model_step8.pth"))
    got = state.model.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0)


def test_train_step_is_the_step_a_bare_loop_calls():
    """bench/ and tests drive the engine's own step: the mean loss it reports is the global batch's."""
    state = TrainState.build(fixture_config(max_steps=2), PREPARED)
    batches = state.stream.next_step()
    out = train_step(state, batches, 1)
    state.stream.close()
    tokens = sum(int(b["targets"].ne(-100).sum()) for b in batches)
    assert float(out.weight) == tokens and state.step == 1
    assert 4.0 < float(out.loss_sum / out.weight) < 7.0  # ~ln(320) at init


# Two processes over plain gloo (as torchrun would start them) taking the same steps as one process: DDP and FSDP
# side by side in tests/unit/test_fsdp.py, which runs every two-rank scenario in one pair of processes.


def test_bf16_on_a_gpu_without_bf16_is_refused_naming_the_field():
    from minimind_ray.config import ConfigError
    from minimind_ray.engine.step import check_precision

    with pytest.raises(ConfigError, match=r"^train.precision: bf16 needs a GPU with bf16.*Tesla T4"):
        check_precision("bf16", "cuda", bf16_supported=False, device_name="Tesla T4")
    check_precision("auto", "cuda", bf16_supported=False)  # auto falls back to fp32 there
    check_precision("bf16", "cuda", bf16_supported=True)
    check_precision("bf16", "cpu", bf16_supported=True)  # CPU autocast


def test_the_lr_schedules_by_hand():
    """MiniMind's schedule and the cosine one, value by value (issue 34: engine/step.py's mutants)."""
    import math
    from types import SimpleNamespace

    from minimind_ray.engine.step import lr_lambda

    minimind = lr_lambda(SimpleNamespace(lr_schedule="minimind"), 10)
    assert [round(minimind(s), 6) for s in (0, 5, 10)] == [1.0, 0.55, 0.1]
    assert lr_lambda(SimpleNamespace(lr_schedule="minimind"), 0)(0) == 1.0  # no division by zero
    assert lr_lambda(SimpleNamespace(lr_schedule="minimind"), 1)(1) == pytest.approx(0.1)
    cosine = lr_lambda(SimpleNamespace(lr_schedule="cosine", warmup_steps=4, min_lr_ratio=0.2), 100)
    assert [cosine(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]  # linear warmup to the peak
    assert cosine(52) == pytest.approx(0.2 + 0.8 * 0.5)  # half-way through the decay
    assert cosine(100) == pytest.approx(0.2) and cosine(150) == pytest.approx(0.2)  # the floor, and held there
    assert cosine(30) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 26 / 96)))
    # a warmup longer than 10% of the run is cut to 10%; a run of fewer than 10 steps warms up for 1
    capped = lr_lambda(SimpleNamespace(lr_schedule="cosine", warmup_steps=1000, min_lr_ratio=0.0), 50)
    assert [capped(s) for s in range(6)][:5] == [0.2, 0.4, 0.6, 0.8, 1.0] and capped(5) == pytest.approx(1.0)
    short = lr_lambda(SimpleNamespace(lr_schedule="cosine", warmup_steps=1000, min_lr_ratio=0.0), 5)
    assert short(0) == 1.0 and short(1) == 1.0 and short(3) == pytest.approx(0.5)  # progress (3 - 1) / 4
    odd = lr_lambda(SimpleNamespace(lr_schedule="cosine", warmup_steps=1000, min_lr_ratio=0.0), 55)
    assert odd(0) == 0.2  # 10% of 55 steps: 5 whole steps
    two = lr_lambda(SimpleNamespace(lr_schedule="cosine", warmup_steps=1, min_lr_ratio=0.0), 2)
    assert (two(0), two(1), two(2)) == (1.0, 1.0, 0.0)  # one step of decay: to the floor at its end
    none = lr_lambda(SimpleNamespace(lr_schedule="cosine", warmup_steps=0, min_lr_ratio=0.0), 4)
    assert none(0) == 1.0 and none(2) == pytest.approx(0.5)


def test_precision_on_a_cpu_and_the_single_rank_units():
    from minimind_ray.engine.step import _global_units, autocast_for, bf16_compute

    cpu = torch.device("cpu")
    assert [bf16_compute(p, cpu) for p in ("bf16", "auto", "fp32")] == [True, False, False]
    with autocast_for("bf16", cpu)():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    with autocast_for("auto", cpu)():
        assert not torch.is_autocast_enabled("cpu")

    class Units:  # an objective's counting: loss units and metric units per micro-batch
        def weight(self, b):
            return b["n"]

        def metric_weight(self, b):
            return 2 * b["n"]

    w, mw = _global_units(Units(), [{"n": 3}, {"n": 4}], 1, cpu)
    assert (w.item(), mw.item(), w.dtype) == (7.0, 14.0, torch.float64)
    w, mw = _global_units(Units(), [{"n": 0}], 1, cpu)
    assert (w.item(), mw.item()) == (1.0, 0.0)  # no units: the mean divides by 1, not 0
