"""The fault schedule (issue 16): parsed and checked before Ray starts, each entry fired once per run,
recorded in the run's storage (so a restarted group of any size, on any node, does not fire it again)."""
from __future__ import annotations

import pytest
import torch

from minimind_ray.config import ConfigError, load_config
from minimind_ray.fault_schedule import FaultSpec, fault_schedule
from minimind_ray.raytrain.faults import FaultInjector, fired


def _cfg(*overrides):
    return load_config("pipelines/configs/tiny.yaml", ["train.max_steps=20", "train.collective_timeout_s=30", *overrides])


def test_schedule_parses_and_keeps_the_one_entry_forms():
    cfg = _cfg("train.faults=[3:raise:0,5:slow:1:2.5,7:oom:1]", "train.fail_at_step=9", "train.fail_mode=sigkill",
               "train.fail_rank=1", "train.hang_at_step=11")
    assert fault_schedule(cfg.train) == [FaultSpec(3, "raise", 0), FaultSpec(5, "slow", 1, 2.5), FaultSpec(7, "oom", 1),
                                         FaultSpec(9, "sigkill", 1), FaultSpec(11, "hang", 1)]


@pytest.mark.parametrize("entry,why", [
    ("3:explode:0", "unknown kind"), ("3:raise", "is not 'step:kind:rank'"), ("x:raise:0", "is not"),
    ("30:raise:0", "outside"), ("0:raise:0", "outside"), ("3:raise:2", "rank 2"), ("3:slow:0", "is not"),
    ("3:slow:0:45", "straggler"), ("3:raise:0:1", "is not"),
])
def test_a_bad_entry_is_a_config_error_naming_train_faults(entry, why):
    with pytest.raises(ConfigError, match=rf"^train.faults: .*{why}"):
        _cfg(f"train.faults=[{entry}]")


def test_the_same_entry_twice_is_refused():
    with pytest.raises(ConfigError, match="given twice"):
        _cfg("train.faults=[3:raise:0]", "train.fail_at_step=3")


@pytest.mark.parametrize("uri", [False, True])
def test_each_entry_fires_once_per_run_across_restarts_and_world_sizes(tmp_path, uri):
    run_dir = f"file://{tmp_path}/run" if uri else str(tmp_path / "run")
    cfg = _cfg("train.faults=[4:raise:1,6:slow:0:0.01]")
    cpu = torch.device("cpu")
    rank1 = FaultInjector(cfg, run_dir, rank=1, device=cpu)
    rank1.before_step(3)  # nothing due
    with pytest.raises(RuntimeError, match="injected failure at step 4"):
        rank1.before_step(4)
    # the restarted group (here of one worker: rank 1 is gone, rank 0 takes its place) passes step 4 again
    FaultInjector(cfg, run_dir, rank=1, device=cpu).before_step(4)
    FaultInjector(cfg, run_dir, rank=0, device=cpu).before_step(4)
    FaultInjector(cfg, run_dir, rank=0, device=cpu).before_step(6)
    marks = fired(run_dir)
    assert set(marks) == {"4-raise-1", "6-slow-0"} and marks["4-raise-1"]["step"] == 4


def test_a_chaos_run_records_where_a_rank_failed_and_a_plain_run_records_nothing(tmp_path):
    def collective():
        raise RuntimeError("Timed out waiting 10000ms for send operation to complete")

    cpu = torch.device("cpu")
    chaos = FaultInjector(_cfg("train.faults=[4:raise:0]"), str(tmp_path / "run"), rank=1, device=cpu)
    chaos.before_step(7)
    try:
        collective()
    except RuntimeError as e:
        chaos.record_failure(e)
    (key, record), = fired(str(tmp_path / "run")).items()
    assert key.startswith("failed-1-") and record["rank"] == 1 and record["step"] == 7
    assert "Timed out waiting" in record["error"] and record["where"][-1].startswith("test_faults.py:")
    assert record["where"][-1].endswith("in collective")  # the innermost frame last

    plain = FaultInjector(_cfg(), str(tmp_path / "plain"), rank=0, device=cpu)
    plain.record_failure(RuntimeError("x"))
    assert fired(str(tmp_path / "plain")) == {}


def test_oom_raises_the_cuda_out_of_memory_type_on_cpu(tmp_path):
    inj = FaultInjector(_cfg("train.faults=[2:oom:0]"), str(tmp_path / "run"), rank=0, device=torch.device("cpu"))
    with pytest.raises(torch.cuda.OutOfMemoryError, match="step 2"):
        inj.before_step(2)


def test_start_entries_parse_and_are_checked():
    cfg = _cfg("train.faults=[start:actor:0,start:backend:1,start:launch:1,3:raise:0]")
    assert [f.key for f in fault_schedule(cfg.train)] == ["start-actor-0", "start-backend-1", "start-launch-1",
                                                          "3-raise-0"]
    for bad, why in (("start:warmup:0", "phase in"), ("start:actor", "start:phase:rank"), ("start:actor:2", "rank 2")):
        with pytest.raises(ConfigError, match=rf"^train.faults: .*{why}"):
            _cfg(f"train.faults=[{bad}]")


def test_a_start_fault_is_not_fired_by_the_step_injector(tmp_path):
    """A start entry fires only where the group starts (raytrain/faults.py:StartFaults), never at a step."""
    from minimind_ray.raytrain.faults import StartFaults

    cfg = _cfg("train.faults=[start:launch:0]")
    FaultInjector(cfg, str(tmp_path / "run"), rank=0, device=torch.device("cpu")).before_step(1)
    faults = StartFaults.of(cfg, str(tmp_path / "run"))
    assert faults.has("launch") and not faults.has("actor") and fired(str(tmp_path / "run")) == {}
    faults.fire("launch", rank=1)  # another rank's entry: nothing happens
    assert StartFaults.of(_cfg(), str(tmp_path)) is None


class _Trainer:
    """Stands in for a TorchTrainer: its fit raises the errors Ray Train 2.58 raises when a group does not start
    (the real exception classes), or returns; records the max_failures each attempt was given."""

    def __init__(self, outcomes, given):
        self.outcomes, self.given = outcomes, given

    def __call__(self, failures_left):
        self.given.append(failures_left)
        return self

    def fit(self):
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def _start_errors():
    from ray.exceptions import ActorDiedError
    from ray.train import ControllerError
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError, WorkerGroupStartupTimeoutError

    return (ControllerError(WorkerGroupStartupFailedError("At least one of the worker actors failed to initialize.")),
            ControllerError(WorkerGroupStartupTimeoutError(num_workers=2)), ControllerError(ActorDiedError()))


def test_each_start_failure_costs_one_of_max_failures_with_the_worker_failures_before_it(tmp_path, capsys):
    """raytrain/restarts.py:fit: the run is fitted again after a start failure, with what is left of the budget:
    worker failures Ray Train counted in the failed fit (its controller's detected-* records) spend it too."""
    import json

    from minimind_ray.fsio import write_bytes_atomic
    from minimind_ray.raytrain.restarts import fit

    run_dir = tmp_path / "run"
    (run_dir / ".faults").mkdir(parents=True)
    died, timed_out, launch = _start_errors()

    class RecordsAWorkerFailure(_Trainer):
        def fit(self):
            if len(self.given) == 2:  # the second attempt: a worker fails while training, then the restart fails
                write_bytes_atomic(str(run_dir / ".faults" / "detected-1.json"), json.dumps({"t": 4e9}).encode())
            return super().fit()

    given = []
    result = fit(RecordsAWorkerFailure([died, launch, "trained"], given), 4, str(run_dir), "r")
    assert result == "trained" and given == [4, 3, 1]
    assert [line.split("(")[-1] for line in capsys.readouterr().out.splitlines()] == [
        "failure 1 of cluster.max_failures=4)", "failure 3 of cluster.max_failures=4)"]


def test_a_spent_budget_ends_the_run_with_one_line_naming_max_failures(tmp_path, monkeypatch):
    from minimind_ray.raytrain.restarts import RestartsSpent, fit

    # what the controller waited (cluster.resource_timeout_s, as Ray Train read it there) is in Ray's message
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "7.5")
    died, timed_out, _ = _start_errors()
    given = []
    with pytest.raises(RestartsSpent, match=r"^cluster.max_failures=1 spent: the worker group did not start \(2 "
                                            r"worker\(s\) could not be placed within cluster.resource_timeout_s "
                                            r"\(7.5 s\)\) after 1 restart"):
        fit(_Trainer([died, timed_out, "never"], given), 1, str(tmp_path), "r")
    assert given == [1, 0]


def test_an_elastic_run_going_on_smaller_spends_nothing_but_a_timeout_at_its_smallest_does(tmp_path):
    """A timeout at 2 workers with cluster.min_workers=1 is Ray's elastic policy meeting a lost node: fitted again,
    free (at most FREE_SHRINKS times in a row); at 1 worker, or in a fixed-size run, it is a failure."""
    from ray.train import ControllerError
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    from minimind_ray.raytrain.restarts import FREE_SHRINKS, RestartsSpent, fit

    at = lambda n: ControllerError(WorkerGroupStartupTimeoutError(num_workers=n))  # noqa: E731
    given = []
    assert fit(_Trainer([at(2), at(2), at(1), "trained"], given), 1, str(tmp_path), "r", min_workers=1) == "trained"
    assert given == [1, 1, 1, 0]
    with pytest.raises(RestartsSpent):
        fit(_Trainer([at(2)] * (FREE_SHRINKS + 2), []), 0, str(tmp_path), "r", min_workers=1)
    with pytest.raises(RestartsSpent):  # fixed size: the same timeout is a failure
        fit(_Trainer([at(2), "trained"], []), 0, str(tmp_path), "r")


def test_other_errors_pass_through_unchanged(tmp_path):
    from ray.train import ControllerError

    from minimind_ray.raytrain.restarts import fit

    for error in (ControllerError(ValueError("a bug in a callback")), RuntimeError("not Ray's")):
        with pytest.raises(type(error)) as seen:
            fit(_Trainer([error], []), 3, str(tmp_path), "r")
        assert seen.value is error
