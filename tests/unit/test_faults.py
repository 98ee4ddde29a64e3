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


def test_oom_raises_the_cuda_out_of_memory_type_on_cpu(tmp_path):
    inj = FaultInjector(_cfg("train.faults=[2:oom:0]"), str(tmp_path / "run"), rank=0, device=torch.device("cpu"))
    with pytest.raises(torch.cuda.OutOfMemoryError, match="step 2"):
        inj.before_step(2)
