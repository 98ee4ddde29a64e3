"""The fault schedule of a run (``train.faults``): what each entry means, and its checks before Ray starts.

The injector that fires the entries lives with the Ray workers (minimind_ray/raytrain/faults.py);
this module is plain data, so that config validation can use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from minimind_ray.config_checks import ConfigError, need


FAULT_KINDS = ("raise", "exit", "sigkill", "hang", "oom", "slow", "lost_report", "bug")
# bug: at that step the rank raises the same plain exception on every attempt (never marked as fired), as a bug in the
# code would; not a fault: the retry rule (failures.py) ends the run when the next attempt fails the same way
# lost_report: at a checkpoint step, the rank's process dies once the checkpoint is complete in storage but before its
# report reaches Ray Train, so Ray never registers that checkpoint (what a hard crash can do at any checkpoint)
# Where in the worker group's start a 'start:<phase>:<rank>' entry SIGKILLs a worker process, in the order Ray Train
# starts a group: the worker actor's own start (before ranks exist: the first worker process to start dies), the torch
# backend's set-up (process group env vars and rendezvous), the hand-over of the train function (run_train_fn).
START_PHASES = ("actor", "backend", "launch")


@dataclass(frozen=True)
class FaultSpec:
    """One entry of ``train.faults``: at ``step``, ``rank`` does ``kind`` (``slow``: sleeps ``seconds``).
    A start fault has step 0 and its phase as the kind: that rank's process is SIGKILLed there."""

    step: int
    kind: str
    rank: int
    seconds: float = 0.0

    @property
    def at_start(self) -> bool:
        return self.step == 0 and self.kind in START_PHASES

    @property
    def key(self) -> str:
        return f"start-{self.kind}-{self.rank}" if self.at_start else f"{self.step}-{self.kind}-{self.rank}"


def parse_fault(entry: str) -> FaultSpec:
    """'step:kind:rank', 'step:slow:rank:seconds' or 'start:phase:rank' -> FaultSpec; ValueError saying what is wrong."""
    parts = str(entry).split(":")
    if parts[0] == "start":
        if len(parts) != 3 or parts[1] not in START_PHASES or not parts[2].isdigit():
            raise ValueError(f"{entry!r} is not 'start:phase:rank' with a phase in {START_PHASES}")
        return FaultSpec(0, parts[1], int(parts[2]))
    try:
        if len(parts) not in (3, 4) or (parts[1] == "slow") != (len(parts) == 4):
            raise ValueError
        spec = FaultSpec(int(parts[0]), parts[1], int(parts[2]), float(parts[3]) if len(parts) == 4 else 0.0)
    except ValueError:
        raise ValueError(f"{entry!r} is not 'step:kind:rank' (or 'step:slow:rank:seconds', 'start:phase:rank')") from None
    if spec.kind not in FAULT_KINDS:
        raise ValueError(f"{entry!r}: unknown kind {spec.kind!r}; one of {FAULT_KINDS}")
    return spec


def start_faults(t) -> List[FaultSpec]:
    """The entries that fire while the worker group starts."""
    return [f for f in fault_schedule(t) if f.at_start]


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
        need(f.at_start or f.step >= 1 and (t.max_steps is None or f.step <= t.max_steps), "train.faults",
              f"step {f.step} of {f.key} is outside [1, train.max_steps={t.max_steps}]")
        need(f.rank < cfg.cluster.num_workers, "train.faults",
              f"rank {f.rank} of {f.key} does not exist with cluster.num_workers={cfg.cluster.num_workers}")
        if f.kind == "lost_report":
            ckpt = cfg.checkpoint.interval
            need(f.step % ckpt == 0 or f.step == t.max_steps, "train.faults",
                 f"{f.key}: step {f.step} saves no checkpoint (checkpoint.interval={ckpt}, train.max_steps={t.max_steps})")
        if f.kind == "slow":
            need(0 < f.seconds < t.collective_timeout_s, "train.faults",
                  f"{f.key}: a straggler's seconds must be in (0, train.collective_timeout_s={t.collective_timeout_s:g})")
    keys = [f.key for f in faults]
    need(len(keys) == len(set(keys)), "train.faults", f"an entry is given twice: {sorted(keys)}")
