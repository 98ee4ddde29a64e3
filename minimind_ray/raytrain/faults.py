"""Hooks for recovery tests, chaos runs and benchmarks: a schedule of faults, each fired once per run,
and a log of the samples trained on.

Both are off unless the config asks for them (``train.faults``, or the one-entry form
``train.fail_at_step``/``fail_mode``/``fail_rank`` and ``train.hang_at_step``; ``train.sample_log_dir``).
They live here, out of the engine, and the worker plugs them in.

"Once per run" is recorded in the run's storage, not in process memory: before a fault fires, its
marker ``<run_dir>/.faults/<step>-<kind>-<rank>.json`` is written, so a restarted worker group (of any
size, on any node) passes that step again without firing it a second time.

Start faults (``start:<phase>:<rank>``) SIGKILL a worker process while Ray Train starts the group, at one of
three points only the start passes (:class:`StartFaults`): the actor's start (its train context arrives: a Ray
Train ``WorkerCallback``), the torch backend's set-up (:class:`FaultyTorchConfig`) and the hand-over of the train
function (:class:`LaunchFault`, unpickled inside ``run_train_fn``). The Train controller also
writes ``detected-<time>.json`` there when it sees workers fail (``failure_callback``), which is how
``tests/soak/test_chaos.py`` times detection.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pyarrow.fs as pafs
import torch

from minimind_ray.config import RunConfig  # the Ray layer is above the config: it runs what a RunConfig says
from minimind_ray.failures import FailurePolicy, RunStopped, not_placed
from minimind_ray.fault_schedule import FaultSpec, fault_schedule, start_faults
from minimind_ray.fsio import filesystem, is_uri, join, write_bytes_atomic
from minimind_ray.raytrain.oom import stop_on_out_of_memory
from minimind_ray.store.checkpoint import newest_complete

MARKERS = ".faults"


def claim(run_dir: Optional[str], f: FaultSpec) -> bool:
    """Claim ``f`` in the run's storage; False if an earlier attempt of this run already fired it."""
    if run_dir is None:
        return True
    marker_dir = join(run_dir, MARKERS)
    marker = join(marker_dir, f"{f.key}.json")
    fs, path = filesystem(marker)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        return False
    fs.create_dir(filesystem(marker_dir)[1], recursive=True)
    write_bytes_atomic(marker, json.dumps({"step": f.step, "kind": f.kind, "rank": f.rank,
                                           "seconds": f.seconds, "t": time.time()}).encode())
    return True


class FaultInjector:
    """Fires this rank's entries of the run's fault schedule, each once per run."""

    def __init__(self, cfg: RunConfig, run_dir: Optional[str], rank: int, device: torch.device):
        self.rank, self.device, self.run_dir = rank, device, run_dir
        schedule = fault_schedule(cfg.train)
        self.injecting = bool(schedule)  # a chaos run: failures are recorded (record_failure)
        self.step = 0  # the step this rank is in
        self.pending: Dict[int, List[FaultSpec]] = {}
        for f in schedule:
            if f.rank == rank and not f.at_start:
                self.pending.setdefault(f.step, []).append(f)

    def _due(self, step: int, kinds) -> List[FaultSpec]:
        return [f for f in self.pending.get(step, []) if f.kind in kinds and claim(self.run_dir, f)]

    def record_failure(self, error: BaseException) -> None:
        """In a run that injects faults: where this rank failed (its step, its innermost frames: which collective,
        which hook), as ``failed-<rank>-<time>.json`` beside the markers. A chaos run whose budget is exact can then
        say which failure it did not plan (tests/integration/test_training.py; Ray's worker log has the rest)."""
        if not self.injecting:
            return
        where = [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in traceback.extract_tb(error.__traceback__)]
        now = time.time()
        write_record(self.run_dir, f"failed-{self.rank}-{now:.3f}",
                     {"t": now, "rank": self.rank, "step": self.step, "error": repr(error)[:300], "where": where[-6:]})

    def before_step(self, step: int) -> None:
        """raise / exit / sigkill / oom / slow: before the step reads its data; bug: on every attempt."""
        self.step = step
        if any(f.kind == "bug" for f in self.pending.get(step, [])):  # not claimed: it recurs, as a bug does
            raise RuntimeError(f"simulated bug at step {step}: the 'bug' entry of the fault schedule, raised on every "
                               f"attempt")
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

    def before_report(self, step: int) -> None:
        """lost_report: armed here, fired by :class:`LostReport` once this rank's checkpoint upload is done."""
        _armed_reports.extend((f, self.run_dir) for f in self._due(step, ("lost_report",)))

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


_armed_reports: List[Tuple[FaultSpec, Optional[str]]] = []  # lost_report entries due at the report under way


def lost_report_callbacks(cfg: RunConfig) -> list:
    """The Ray Train callback that fires ``lost_report`` entries inside ``ray.train.report``, after the upload."""
    if not any(f.kind == "lost_report" for f in fault_schedule(cfg.train)):
        return []
    import contextlib

    from ray.train.v2._internal.execution.callback import TrainContextCallback

    class LostReport(TrainContextCallback):
        @contextlib.contextmanager
        def on_checkpoint_transfer(self):
            yield  # this rank's files are in storage now; its report is not yet queued for the controller
            # lazy: raytrain.faults imports this module
            from minimind_ray.raytrain import faults  # this process's module (this class is pickled by value)

            faults.lose_the_report()

    return [LostReport()]


def lose_the_report() -> None:
    """Wait until the checkpoint is complete in storage (every rank's files: the restart can restore it), then die
    before this rank's report is queued, so Ray Train never registers the checkpoint."""
    if not _armed_reports:
        return
    f, run_dir = _armed_reports.pop()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = newest_complete(run_dir, deep=True) if run_dir else None
        if found is not None and found.step == f.step:
            break
        time.sleep(0.05)
    print(f"[fault-injection] rank {f.rank}: sigkill after the step-{f.step} checkpoint's upload, before its report",
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- faults while the worker group starts


@dataclass(frozen=True)
class StartFaults:
    """The run's ``start:<phase>:<rank>`` entries; :meth:`fire` is called in a worker process at each phase."""

    run_dir: str
    faults: Tuple[FaultSpec, ...]

    @classmethod
    def of(cls, cfg: RunConfig, run_dir: str) -> Optional["StartFaults"]:
        faults = tuple(start_faults(cfg.train))
        return cls(run_dir, faults) if faults else None

    def has(self, phase: str) -> bool:
        return any(f.kind == phase for f in self.faults)

    def fire(self, phase: str, rank: int) -> None:
        """SIGKILL this worker process if ``phase`` has an entry for ``rank`` that this run has not fired yet."""
        for f in self.faults:
            if f.kind == phase and f.rank == rank and claim(self.run_dir, f):
                print(f"[fault-injection] rank {rank}: sigkill while the worker group starts ({phase})", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def start_fault_callbacks(faults: Optional[StartFaults]) -> list:
    """The Ray Train callback that fires the ``actor`` phase in each worker as its train context arrives."""
    if faults is None or not faults.has("actor"):
        return []
    import ray.train
    from ray.train.v2._internal.execution.callback import WorkerCallback

    class ActorStartFault(WorkerCallback):
        def after_init_train_context(self):
            faults.fire("actor", ray.train.get_context().get_world_rank())

    return [ActorStartFault()]


def torch_config(faults: Optional[StartFaults], **kwargs):
    """Ray Train's TorchConfig, or with a ``backend`` start fault a subclass whose backend fires it on every worker
    before the process group is set up (where the issue-32 kill landed: after Ray built the group's state)."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    if faults is None or not faults.has("backend"):
        return TorchConfig(**kwargs)

    class FaultyBackend(_TorchBackend):
        def on_start(self, worker_group, backend_config):
            ranks = range(len(worker_group))
            # every rank at once, as the real set-up does; the rank with the entry dies inside this call
            import ray
            ray.get([worker_group.execute_single_async(r, faults.fire, "backend", r) for r in ranks])
            super().on_start(worker_group, backend_config)

    class FaultyTorchConfig(TorchConfig):
        @property
        def backend_cls(self):
            return FaultyBackend

    return FaultyTorchConfig(**kwargs)


def _fire_at_launch(faults: StartFaults):
    """Unpickled where Ray Train hands the train function to a worker (run_train_fn); a no-op anywhere else."""
    import ray.train

    try:
        rank = ray.train.get_context().get_world_rank()
    except Exception:  # not inside a Ray Train worker
        return None
    faults.fire("launch", rank)
    return None


class LaunchFault:
    """Carried in the WorkerSpec: unpickling it fires the ``launch`` phase."""

    def __init__(self, faults: StartFaults):
        self.faults = faults

    def __reduce__(self):
        return _fire_at_launch, (self.faults,)


def failure_callback(sink, progress_run: str, run_dir: Optional[str], retry_mistakes: bool = False):
    """A Ray Train callback (it runs in the controller): tells the driver's console that workers failed,
    and records when, for the chaos benchmark. A failure that would recur ends the run instead of a restart: a worker
    out of memory (raytrain/oom.py: the same micro-batch would run out again), the user's mistake, or an error that
    failed the previous attempt the same way (failures.py)."""
    from ray.train import ControllerError, UserCallback

    class FailureNotice(UserCallback):
        def __init__(self):
            self.policy = FailurePolicy(retry_mistakes)  # lives as long as this fit's controller

        def after_exception(self, run_context, worker_exceptions):
            errors = {r: repr(e)[:500] for r, e in worker_exceptions.items()}
            try:
                stop_on_out_of_memory(worker_exceptions)
                stop_when_not_placed(worker_exceptions)
                try:
                    self.policy.decide(worker_exceptions)
                except RunStopped as stop:  # Ray Train retries worker-group errors, never a controller error
                    raise ControllerError(stop) from None
            except Exception:
                self._record(errors)
                raise
            sink.push.remote(progress_run, {"_error": errors})
            self._record(errors)

        def _record(self, errors):
            now = time.time()
            write_record(run_dir, f"detected-{now:.3f}", {"t": now, "errors": errors})

    return FailureNotice()


def stop_when_not_placed(worker_exceptions) -> None:
    """In the controller: end the run (no restart) when a worker could not place what its stage places beside it
    (failures.py:NotPlaced, RL's rollout actors): a restart would wait as long for the same resources."""
    from ray.train import ControllerError

    for error in worker_exceptions.values():
        found = not_placed(error)
        if found:
            raise ControllerError(RuntimeError(found))


def write_record(run_dir: Optional[str], name: str, record: dict) -> None:
    """``<run_dir>/.faults/<name>.json`` (no run directory: nothing): a record for people and benchmarks, never
    worth failing the rank or the controller that writes it."""
    if not run_dir:
        return
    try:
        write_bytes_atomic(join(join(run_dir, MARKERS), f"{name}.json"), json.dumps(record).encode())
    except OSError:
        pass


def fired(run_dir: str) -> Dict[str, dict]:
    """The markers of a run: fault key -> what fired when; plus ``detected-*`` records (the controller's) and
    ``failed-*`` ones (a rank's, :meth:`FaultInjector.record_failure`)."""
    fs, root = filesystem(join(run_dir, MARKERS))
    out = {}
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if info.base_name.endswith(".json"):
            with fs.open_input_stream(info.path) as f:
                out[info.base_name[:-5]] = json.loads(f.read())
    return out


def worker_failures_since(run_dir: str, since: float) -> int:
    """How many worker-group failures the Train controller recorded (``failure_callback``) at or after ``since``."""
    return sum(1 for k, rec in fired(run_dir).items() if k.startswith("detected-") and rec.get("t", 0) >= since)


class SampleLog:
    """Debug record, per step and rank, of the sample ids trained on and when the step's data arrived.

    ``attempt`` is the step this worker group started from (0, or the restored checkpoint's
    step), so replays after a restart can be told apart. Used by the exactly-once tests and
    by bench/bench_train.py for recovery and checkpoint timings."""

    def __init__(self, directory: Optional[str], rank: int, world: int, attempt: int):
        self.f, self.attempt, self.uri = None, attempt, None
        if directory and is_uri(directory):  # a bucket has no append: one object per line (a cluster with no shared
            self.uri = join(directory, f"rank{rank}")  # disk, tests/integration/test_node_faults.py)
        elif directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.f = open(Path(directory) / f"rank{rank}.jsonl", "a")
        self.rank, self.world = rank, world

    def write(self, step: int, batches: List[Dict[str, torch.Tensor]]) -> None:
        if self.f is None and self.uri is None:
            return
        ids = torch.cat([b["sample_ids"] for b in batches]).tolist()
        line = json.dumps({"step": step, "rank": self.rank, "world": self.world,
                           "attempt": self.attempt, "t": time.time(), "ids": ids})
        if self.uri is not None:
            write_bytes_atomic(join(self.uri, f"{time.time_ns()}-{self.attempt}-{step}.json"), line.encode())
            return
        self.f.write(line + "\n")
        self.f.flush()


@dataclass
class FaultWiring:
    """Everything of the fault machinery a run's trainer carries, decided once: the start faults' launch hook (in the
    WorkerSpec), the torch backend (a faulty one with a backend start fault), and the controller's callbacks (the
    failure policy and the console's notice, the start and lost-report faults)."""

    launch: Optional[LaunchFault]
    torch_config: object
    callbacks: list


def fault_wiring(cfg: RunConfig, run_dir: str, backend: str, sink, progress_run: str) -> FaultWiring:
    starts = StartFaults.of(cfg, run_dir)  # train.faults' start:<phase>:<rank> entries
    return FaultWiring(
        launch=LaunchFault(starts) if starts and starts.has("launch") else None,
        torch_config=torch_config(starts, backend=backend, timeout_s=int(cfg.train.collective_timeout_s)),
        callbacks=[failure_callback(sink, progress_run, run_dir, cfg.cluster.retry_mistakes),
                   *start_fault_callbacks(starts), *lost_report_callbacks(cfg)])
