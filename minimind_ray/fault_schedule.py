"""The fault schedule of a run (``train.faults``): what each entry means, and its checks before Ray starts.

The injector that fires the entries lives with the Ray workers (minimind_ray/raytrain/faults.py);
this module is plain data, so that config validation can use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from minimind_ray.config_checks import ConfigError, need


FAULT_KINDS = ("raise", "exit", "sigkill", "hang", "oom", "slow")


@dataclass(frozen=True)
class FaultSpec:
    """One entry of ``train.faults``: at ``step``, ``rank`` does ``kind`` (``slow``: sleeps ``seconds``)."""

    step: int
    kind: str
    rank: int
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.step}-{self.kind}-{self.rank}"


def parse_fault(entry: str) -> FaultSpec:
    """'step:kind:rank' or 'step:slow:rank:seconds' -> FaultSpec; ValueError saying what is wrong."""
    parts = str(entry).split(":")
    try:
        if len(parts) not in (3, 4) or (parts[1] == "slow") != (len(parts) == 4):
            raise ValueError
        spec = FaultSpec(int(parts[0]), parts[1], int(parts[2]), float(parts[3]) if len(parts) == 4 else 0.0)
    except ValueError:
        raise ValueError(f"{entry!r} is not 'step:kind:rank' (or 'step:slow:rank:seconds')") from None
    if spec.kind not in FAULT_KINDS:
        raise ValueError(f"{entry!r}: unknown kind {spec.kind!r}; one of {FAULT_KINDS}")
    return spec


def fault_schedule(t) -> List[FaultSpec]:
    """``train.faults`` plus the one-entry forms ``fail_at_step``/``fail_mode``/``fail_rank`` and
    ``hang_at_step`` (on ``fail_rank``)."""
    faults = [parse_fault(e) for e in t.faults]
    if t.fail_at_step is not None:
        faults.append(FaultSpec(t.fail_at_step, t.fail_mode, t.fail_rank))
    if t.hang_at_step is not None:
        faults.append(FaultSpec(t.hang_at_step, "hang", t.fail_rank))
    return faults


def validate_faults(cfg) -> None:
    """The fault schedule fits the run: known kinds, steps in range, ranks below the largest world size,
    stragglers shorter than the collective timeout (a longer sleep is a hang, not a slow rank)."""
    t = cfg.train
    try:
        faults = fault_schedule(t)
    except ValueError as e:
        raise ConfigError(f"train.faults: {e}") from None
    for f in faults:
        need(f.step >= 1 and (t.max_steps is None or f.step <= t.max_steps), "train.faults",
              f"step {f.step} of {f.key} is outside [1, train.max_steps={t.max_steps}]")
        need(f.rank < cfg.cluster.num_workers, "train.faults",
              f"rank {f.rank} of {f.key} does not exist with cluster.num_workers={cfg.cluster.num_workers}")
        if f.kind == "slow":
            need(0 < f.seconds < t.collective_timeout_s, "train.faults",
                  f"{f.key}: a straggler's seconds must be in (0, train.collective_timeout_s={t.collective_timeout_s:g})")
    keys = [f.key for f in faults]
    need(len(keys) == len(set(keys)), "train.faults", f"an entry is given twice: {sorted(keys)}")
