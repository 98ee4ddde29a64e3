"""Hooks for recovery tests, chaos runs and benchmarks: a schedule of faults, each fired once per run,
and a log of the samples trained on.

Both are off unless the config asks for them (``train.faults``, or the one-entry form
``train.fail_at_step``/``fail_mode``/``fail_rank`` and ``train.hang_at_step``; ``train.sample_log_dir``).
They live here, out of the engine, and the worker plugs them in.

"Once per run" is recorded in the run's storage, not in process memory: before a fault fires, its
marker ``<run_dir>/.faults/<step>-<kind>-<rank>.json`` is written, so a restarted worker group (of any
size, on any node) passes that step again without firing it a second time. The Train controller also
writes ``detected-<time>.json`` there when it sees workers fail (``failure_callback``), which is how
``bench/bench_chaos.py`` times detection.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Dict, List, Optional

import pyarrow.fs as pafs
import torch

from minimind_ray.config import RunConfig
from minimind_ray.fault_schedule import FaultSpec, fault_schedule
from minimind_ray.fsio import filesystem, join, write_bytes_atomic

MARKERS = ".faults"


class FaultInjector:
    """Fires this rank's entries of the run's fault schedule, each once per run."""

    def __init__(self, cfg: RunConfig, run_dir: Optional[str], rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.marker_dir = join(run_dir, MARKERS) if run_dir else None
        self.pending: Dict[int, List[FaultSpec]] = {}
        for f in fault_schedule(cfg.train):
            if f.rank == rank:
                self.pending.setdefault(f.step, []).append(f)

    def _first_time(self, f: FaultSpec) -> bool:
        """Claim ``f`` in storage; False if an earlier attempt of this run already fired it."""
        if self.marker_dir is None:
            return True
        marker = join(self.marker_dir, f"{f.key}.json")
        fs, path = filesystem(marker)
        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            return False
        fs.create_dir(filesystem(self.marker_dir)[1], recursive=True)
        write_bytes_atomic(marker, json.dumps({"step": f.step, "kind": f.kind, "rank": f.rank,
                                               "seconds": f.seconds, "t": time.time()}).encode())
        return True

    def _due(self, step: int, kinds) -> List[FaultSpec]:
        return [f for f in self.pending.get(step, []) if f.kind in kinds and self._first_time(f)]

    def before_step(self, step: int) -> None:
        """raise / exit / sigkill / oom / slow: before the step reads its data."""
        for f in self._due(step, ("slow", "raise", "oom", "exit", "sigkill")):
            print(f"[fault-injection] rank {self.rank}: {f.kind} at step {step}", flush=True)
            if f.kind == "slow":  # a straggler: the others wait in the step's first collective, nobody fails
                time.sleep(f.seconds)
            elif f.kind == "raise":
                raise RuntimeError(f"injected failure at step {step} (train.faults)")
            elif f.kind == "oom":
                self._oom(step)
            elif f.kind == "exit":
                os._exit(13)
            else:
                os.kill(os.getpid(), signal.SIGKILL)

    def after_batches(self, step: int) -> None:
        """hang: after the data is read, before the step's first collective (the others block there
        until ``train.collective_timeout_s`` fails the worker group)."""
        for f in self._due(step, ("hang",)):
            print(f"[fault-injection] rank {self.rank}: hanging at step {step}", flush=True)
            while True:
                time.sleep(60)

    def _oom(self, step: int) -> None:
        """A real CUDA out-of-memory error on a GPU (an allocation no device holds); on a CPU the same
        exception type, raised at the same point."""
        if self.device.type == "cuda":
            try:
                torch.empty(1 << 50, dtype=torch.uint8, device=self.device)  # 1 PiB
            except torch.OutOfMemoryError as e:  # tagged: an injected OOM is retried, a real one stops the run
                raise torch.OutOfMemoryError(f"injected out-of-memory at step {step} (train.faults): {e}") from None
        raise torch.cuda.OutOfMemoryError(f"injected out-of-memory at step {step} (train.faults, simulated on CPU)")


def failure_callback(sink, run_dir: Optional[str]):
    """A Ray Train callback (it runs in the controller): tells the driver's console that workers failed,
    and records when, for the chaos benchmark. A worker out of memory ends the run instead of a restart
    (raytrain/oom.py: the same micro-batch would run out again)."""
    from ray.train import UserCallback

    from minimind_ray.raytrain.oom import stop_on_out_of_memory

    class FailureNotice(UserCallback):
        def after_exception(self, run_context, worker_exceptions):
            errors = {r: repr(e)[:500] for r, e in worker_exceptions.items()}
            try:
                stop_on_out_of_memory(worker_exceptions)
            except Exception:
                self._record(errors)
                raise
            sink.push.remote({"_error": errors})
            self._record(errors)

        def _record(self, errors):
            if run_dir:
                try:
                    write_bytes_atomic(join(join(run_dir, MARKERS), f"detected-{time.time():.3f}.json"),
                                       json.dumps({"t": time.time(), "errors": errors}).encode())
                except OSError:
                    pass  # a record for benchmarks: never worth failing the controller

    return FailureNotice()


def fired(run_dir: str) -> Dict[str, dict]:
    """The markers of a run: fault key -> what fired when; plus ``detected-*`` records."""
    fs, root = filesystem(join(run_dir, MARKERS))
    out = {}
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if info.base_name.endswith(".json"):
            with fs.open_input_stream(info.path) as f:
                out[info.base_name[:-5]] = json.loads(f.read())
    return out


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
