"""Checkpoint on preemption: a drain notice becomes a checkpoint of the step it arrived at, and no step is lost.

Ray 2.58 carries the notice to the workers: a ``PreemptionWatcher`` actor of the Train controller polls the GCS
for draining nodes (every ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S``, 5 s by default) and marks every worker of
the group; ``ray.train.get_preemption_info()`` then answers ``PreemptionInfo(deadline_ms, preempted_node_to_ranks)``
on every rank (a broadcast of rank 0's answer, so every rank must ask at the same step). The controller itself
enters its PreemptingState, waits until the deadline (120 s when the drain gave none), raises a
``PreemptionError`` (charged to ``FailureConfig.max_preemption_failures``, unlimited by default) and restarts the
worker group from the newest checkpoint, on the nodes that are not draining (``ray/train/v2/_internal/execution/
controller/controller.py``, ``_handle_preempting_state``).

What this adds (``RayHooks.preemption_notice`` / ``on_preempted``, called by the engine's loop):

- every ``checkpoint.preemption_check_interval`` steps (default: every ``train.log_interval``) each rank asks;
  the answer is the same everywhere, so every rank takes the same branch;
- on a notice, the loop logs and checkpoints that step (``ray.train.report`` with the checkpoint), then every
  rank *holds*: it trains no further step, so the restart, which restores that checkpoint, loses none. The hold
  ends when the controller tears the group down at the deadline; should it not (a bug, or a cancelled drain),
  the hold gives up ``HOLD_GRACE_S`` after the deadline with an error, and the ordinary failure path restarts
  the group from the same checkpoint.

A worker must not simply return after the notice: a group whose ranks all return is a *finished* run to the
controller, even in PreemptingState. Who sends the drain: ``cluster/spot/notice_watcher.py`` (AWS/GCE VMs) and
the KubeRay ``preStop`` hook (``cluster/kuberay/prestop-drain.sh``); docs/reliability.md has the deadlines.
"""
from __future__ import annotations

import json
import time
from typing import Optional

from minimind_ray.fsio import filesystem, join, write_bytes_atomic

MARKERS = ".preemption"  # <run_dir>/.preemption/step-<n>.json: what rank 0 saw and did, for people and benchmarks
NO_DEADLINE_S = 120.0  # Ray Train's DEFAULT_PREEMPTION_DEADLINE_S: how long its controller waits without a deadline
HOLD_GRACE_S = 60.0  # how long past the deadline a held rank waits for the restart before it raises


def check_interval(cfg) -> int:
    """Optimizer steps between asks (0 = never): ``checkpoint.preemption_check_interval``, else the log interval."""
    every = cfg.checkpoint.preemption_check_interval
    return cfg.train.log_interval if every is None else every


class PreemptionCheck:
    """One rank's side: when to ask Ray, what it answered, and the hold after the notice's checkpoint."""

    def __init__(self, cfg, run_dir: Optional[str], rank: int, total_steps: int, ask=None, stop_asked=None,
                 world: int = 1):
        self.every, self.run_dir, self.rank, self.total_steps = check_interval(cfg), run_dir, rank, total_steps
        self.ask = ask  # None: ray.train.get_preemption_info (a unit test passes its own)
        # the operator's stop (raytrain/interrupt.py): rank 0 asks ``stop_asked`` where it asks for a drain notice (at
        # every log step when preemption_check_interval=0), and every rank takes its answer
        self.stop_every, self.stop_asked, self.world = self.every or cfg.train.log_interval, stop_asked, world
        self.stopping = False  # True once the operator's stop arrived: the notice's checkpoint, then the loop ends
        self.info = None  # ray.train.PreemptionInfo, once a notice arrived
        self.noticed_at: Optional[float] = None
        self.asks, self.ask_seconds = 0, 0.0  # what the checks cost (bench/bench_preemption.py reads the mean)

    def due(self, step: int) -> bool:
        """Whether a node of this run is being drained, asked on every ``every``-th step (the same on every rank).
        The last step is never held: it checkpoints anyway and the run ends. The operator's stop is a notice too."""
        if step >= self.total_steps or self.info is not None or self.stopping:
            return False
        if self.stop_every and step % self.stop_every == 0 and self._operator_stop(step):
            return True
        if not self.every or step % self.every:
            return False
        if self.ask is None:
            import ray.train

            self.ask = ray.train.get_preemption_info
        t0 = time.perf_counter()
        info = self.ask()
        self.ask_seconds += time.perf_counter() - t0
        self.asks += 1
        if info is None:
            return False
        self.info, self.noticed_at = info, time.time()
        if self.rank == 0:
            left = f"{info.deadline_ms / 1000 - self.noticed_at:.0f} s before its deadline" if info.deadline_ms \
                else "no deadline given"
            print(f"[minimind-ray] drain notice at step {step} for nodes {info.preempted_node_ids} (ranks "
                  f"{info.preempted_ranks}, {left}): checkpointing step {step}", flush=True)
        return True

    def _operator_stop(self, step: int) -> bool:
        """Rank 0's answer of the progress actor (has the driver been interrupted?), the same on every rank."""
        if self.stop_asked is None:
            return False
        stop = False
        if self.rank == 0:
            try:
                stop = bool(self.stop_asked())
            except Exception:  # the driver's actor away (the driver gone): Ray Train ends the group anyway
                stop = False
        if self.world > 1:
            import torch.distributed as dist

            box = [stop]
            dist.broadcast_object_list(box, src=0)
            stop = bool(box[0])
        if stop:
            self.stopping = True
            if self.rank == 0:
                print(f"[minimind-ray] the operator's stop at step {step}: checkpointing step {step}, then ending",
                      flush=True)
        return stop

    def deadline(self) -> float:
        """When the controller restarts the group (epoch seconds)."""
        if self.info is not None and self.info.deadline_ms:
            return self.info.deadline_ms / 1000
        return (self.noticed_at or time.time()) + NO_DEADLINE_S

    def hold(self, step: int, sleep=time.sleep) -> None:
        """After the notice's checkpoint: train no further step until Ray Train restarts the group (it kills this
        process). Raises if that has not happened ``HOLD_GRACE_S`` after the deadline."""
        if self.rank == 0:
            self._mark(step)
        until = self.deadline() + HOLD_GRACE_S
        while time.time() < until:
            sleep(min(1.0, max(0.01, until - time.time())))
        raise RuntimeError(f"preempted at step {step}: the checkpoint of step {step} is saved, but Ray Train did not "
                           f"restart the worker group within {HOLD_GRACE_S:.0f} s of the drain's deadline; restarting "
                           f"from that checkpoint")

    def _mark(self, step: int) -> None:
        """``<run_dir>/.preemption/step-<step>.json``: the notice and when the checkpoint was saved."""
        if not self.run_dir:
            return
        info = self.info
        record = {"step": step, "noticed_at": self.noticed_at, "checkpointed_at": time.time(),
                  "deadline_ms": info.deadline_ms if info else None,
                  "nodes": info.preempted_node_ids if info else [], "ranks": info.preempted_ranks if info else [],
                  "asks": self.asks, "ask_seconds": self.ask_seconds}
        marker_dir = join(self.run_dir, MARKERS)
        try:
            fs, path = filesystem(marker_dir)
            fs.create_dir(path, recursive=True)
            write_bytes_atomic(join(marker_dir, f"step-{step}.json"), json.dumps(record).encode())
        except OSError as e:  # a record for people; the checkpoint is what matters and it is saved
            print(f"[minimind-ray] could not write the preemption record: {e}", flush=True)
