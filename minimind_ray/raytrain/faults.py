"""Hooks for recovery tests and benchmarks: a fault injected once, and a log of the samples trained on.

Both are off unless the config asks for them (``train.fail_at_step``/``hang_at_step``,
``train.sample_log_dir``); they live here, out of the engine, and the worker plugs them in."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from minimind_ray.config import RunConfig
from minimind_ray.fsio import is_uri


class FaultInjector:
    """Fails once at a configured step (``train.fail_at_step``), so recovery is testable.

    "Once" is remembered in a marker file under the run directory: the restarted
    worker group passes the same step again and must not fail a second time."""

    def __init__(self, cfg: RunConfig, run_dir: Optional[str], rank: int):
        self.rank, self.cfg = rank, cfg.train
        self.marker_dir = Path(run_dir) if run_dir and not is_uri(run_dir) else None

    def _first_time(self, what: str, step: int) -> bool:
        if self.marker_dir is None:
            return True
        marker = self.marker_dir / f".fault_{what}_{step}"
        if marker.exists():
            return False
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(time.time()))
        return True

    def maybe_fail(self, step: int) -> None:
        t = self.cfg
        if t.fail_at_step != step or self.rank != t.fail_rank or not self._first_time("fail", step):
            return
        print(f"[fault-injection] rank {self.rank}: {t.fail_mode} at step {step}", flush=True)
        if t.fail_mode == "raise":
            raise RuntimeError(f"injected failure at step {step} (train.fail_at_step)")
        if t.fail_mode == "exit":
            os._exit(13)
        os.kill(os.getpid(), signal.SIGKILL)

    def maybe_hang(self, step: int) -> None:
        t = self.cfg
        if t.hang_at_step == step and self.rank == t.fail_rank and self._first_time("hang", step):
            print(f"[fault-injection] rank {self.rank}: hanging at step {step}", flush=True)
            while True:  # the others block in the step's first collective until its timeout fires
                time.sleep(60)


class SampleLog:
    """Debug record, per step and rank, of the sample ids trained on and when the step's data arrived.

    ``attempt`` is the step this worker group started from (0, or the restored checkpoint's
    step), so replays after a restart can be told apart. Used by the exactly-once tests and
    by bench/bench_train.py for recovery and checkpoint timings."""

    def __init__(self, directory: Optional[str], rank: int, world: int, attempt: int):
        self.f, self.attempt = None, attempt
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.f = open(Path(directory) / f"rank{rank}.jsonl", "a")
        self.rank, self.world = rank, world

    def write(self, step: int, batches: List[Dict[str, torch.Tensor]]) -> None:
        if self.f is None:
            return
        ids = torch.cat([b["sample_ids"] for b in batches]).tolist()
        self.f.write(json.dumps({"step": step, "rank": self.rank, "world": self.world,
                                 "attempt": self.attempt, "t": time.time(), "ids": ids}) + "\n")
        self.f.flush()
