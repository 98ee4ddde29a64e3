"""Checkpoint on preemption without Ray: the engine's loop turns a notice into a logged, checkpointed step and stops
there, and a restart from that checkpoint ends bit-identical to a run never interrupted; the rank-side check asks
only at its cadence, never at the last step, and a hold that outlives the deadline raises after writing its record.
The same on a real cluster (a drain of a node): tests/integration/test_node_faults.py."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from minimind_ray.engine.loop import Hooks, run
from minimind_ray.engine.state import TrainState
from minimind_ray.raytrain.preemption import HOLD_GRACE_S, PreemptionCheck, check_interval
from minimind_ray.store.checkpoint import open_checkpoint

from .test_engine import PREPARED, fixture_config


class NoticeAt(Hooks):
    """A notice after step ``at``: what the loop then logs, checkpoints and calls."""

    def __init__(self, state, at, out):
        self.state, self.at, self.out = state, at, out
        self.asked, self.losses, self.checkpoints, self.preempted = [], {}, [], []

    def preemption_notice(self, step):
        self.asked.append(step)
        return step == self.at

    def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
        self.losses.update(per_step_loss)

    def on_checkpoint(self, step, metrics):
        self.checkpoints.append(step)
        self.state.save(self.out, mlflow_run_id=None, prepared_dir=PREPARED)

    def on_preempted(self, step):
        self.preempted.append(step)


def test_a_notice_checkpoints_its_step_and_a_restart_loses_no_step(tmp_path):
    cfg = fixture_config(max_steps=8)
    assert 3 % cfg.train.log_interval and 3 % cfg.checkpoint.interval  # step 3 is neither a log nor a checkpoint step
    straight = TrainState.build(cfg, PREPARED)
    run(straight)

    first = TrainState.build(cfg, PREPARED)
    hooks = NoticeAt(first, 3, tmp_path / "ck")
    run(first, hooks)
    assert (first.step, hooks.asked, hooks.checkpoints, hooks.preempted) == (3, [1, 2, 3], [3], [3])
    assert sorted(hooks.losses) == [1, 2, 3]  # the steps since the last log step are logged before the stop

    resumed = TrainState.build(cfg, PREPARED)
    assert resumed.restore(open_checkpoint(tmp_path / "ck")).step == 3
    rest = NoticeAt(resumed, None, tmp_path / "ck2")
    run(resumed, rest)
    assert sorted(rest.losses) == list(range(4, 9))  # every step once over the two attempts
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "the run restored from the notice's checkpoint differs"


def _cfg(every=None, log_interval=5):
    return SimpleNamespace(checkpoint=SimpleNamespace(preemption_check_interval=every),
                           train=SimpleNamespace(log_interval=log_interval))


def test_the_check_asks_at_its_cadence_and_never_at_the_last_step():
    asked = []
    check = PreemptionCheck(_cfg(every=None, log_interval=5), None, 0, total_steps=20,
                            ask=lambda: asked.append(1))
    due = [s for s in range(1, 21) if check.due(s)]
    assert (due, len(asked), check.asks) == ([], 3, 3)  # steps 5, 10, 15: the log interval; 20 is the last
    assert check_interval(_cfg(every=0)) == 0 and check_interval(_cfg(every=3)) == 3
    off = PreemptionCheck(_cfg(every=0), None, 0, 20, ask=lambda: pytest.fail("asked with the check off"))
    assert not any(off.due(s) for s in range(1, 21))


def test_a_hold_that_outlives_the_deadline_raises_after_writing_its_record(tmp_path):
    import time

    info = SimpleNamespace(deadline_ms=int((time.time() - HOLD_GRACE_S - 1) * 1000), preempted_node_ids=["n2"],
                           preempted_ranks=[1])
    check = PreemptionCheck(_cfg(every=2), str(tmp_path), 0, total_steps=10, ask=lambda: info)
    assert not check.due(1) and check.due(2) and check.info is info
    with pytest.raises(RuntimeError, match="did not restart the worker group"):
        check.hold(2, sleep=lambda s: pytest.fail("slept past the deadline's grace"))
    record = json.loads((tmp_path / ".preemption" / "step-2.json").read_text())
    assert (record["step"], record["nodes"], record["ranks"], record["asks"]) == (2, ["n2"], [1], 1)


def test_the_field_is_validated():
    from minimind_ray.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="checkpoint.preemption_check_interval"):
        load_config("pipelines/configs/tiny.yaml", ["checkpoint.preemption_check_interval=-1"])
    assert dataclasses.is_dataclass(load_config("pipelines/configs/tiny.yaml").checkpoint)


def test_the_operators_stop_is_a_notice_at_the_next_step_checked_even_with_drain_checks_off():
    """Ctrl-C on the driver (raytrain/interrupt.py) reaches rank 0 as ``stop_asked``: the check takes the notice's
    path at the next step it checks (the log interval when drain checks are off), and does not hold after it."""
    asked = []
    stop = {"now": False}

    def stop_asked():
        asked.append(1)
        return stop["now"]

    check = PreemptionCheck(_cfg(every=0, log_interval=5), None, 0, total_steps=20,
                            ask=lambda: pytest.fail("asked Ray with the drain check off"), stop_asked=stop_asked)
    assert not any(check.due(s) for s in range(1, 10)) and len(asked) == 1  # step 5 only
    stop["now"] = True
    assert not check.due(14) and check.due(15) and check.stopping and check.info is None
    assert not check.due(16) and len(asked) == 2  # one stop per attempt, no ask after it
