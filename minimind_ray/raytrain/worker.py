"""``train_loop_per_worker``: what every Ray Train worker runs. Build the engine's state, restore it
from the newest complete checkpoint, loop the engine, hand checkpoints and metrics over."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from minimind_ray.console import own_lines
from minimind_ray.engine.loop import Hooks, run
from minimind_ray.engine.state import TrainState
from minimind_ray.failures import STEP_ATTR, TRACEBACK_ATTR, reading
from minimind_ray.fsio import filesystem
from minimind_ray.raytrain.faults import FaultInjector, SampleLog
from minimind_ray.raytrain.oom import quiet_out_of_memory_tracebacks
from minimind_ray.raytrain.preemption import PreemptionCheck
from minimind_ray.raytrain.spec import WorkerSpec
from minimind_ray.store.checkpoint import StoredCheckpoint, choose_restore, newest_complete, open_checkpoint
from minimind_ray.store.config import validation_due
from minimind_ray.tracking.logger import RunLogger
from minimind_ray.tracking.names import metric_name


def pick_device(use_gpu: bool) -> torch.device:
    """This worker's GPU when the run uses GPUs (Ray maps its GPU ids through CUDA_VISIBLE_DEVICES), else CPU."""
    if use_gpu and torch.cuda.is_available():
        from ray.train.torch import get_device

        device = get_device()
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def restore_point(spec: WorkerSpec, rank: int, world: int) -> Tuple[Optional[StoredCheckpoint], bool]:
    """(Ray's registered checkpoint, or a newer complete one a hard crash kept Ray from registering
    (store.checkpoint.choose_restore); whether Ray registered it). Rank 0 decides; every rank opens the same one."""
    import ray.train

    path = registered = None
    if rank == 0:
        ray_ckpt = ray.train.get_checkpoint()
        chosen = choose_restore((ray_ckpt.path, ray_ckpt.filesystem) if ray_ckpt else None, spec.run_dir)
        path = chosen.path if chosen else None
        registered = ray_ckpt is not None and path is not None and Path(path).name == Path(ray_ckpt.path).name
    if world > 1:
        box = [path, registered]
        dist.broadcast_object_list(box, src=0)
        path, registered = box
    if path is None:
        return None, False
    return (chosen if rank == 0 else open_checkpoint(path, filesystem(spec.run_dir)[0])), registered


class RayHooks(Hooks):
    def __init__(self, spec: WorkerSpec, state: TrainState, run_id: Optional[str], faults: FaultInjector):
        self.spec, self.state, self.run_id, self.faults = spec, state, run_id, faults
        cfg, rank = spec.cfg, state.rank
        self.samples = SampleLog(cfg.train.sample_log_dir, rank, state.world, attempt=state.step)
        self.logger = None
        if rank == 0 and run_id and cfg.tracking.enabled:
            # no waiting for the server here: rank 0 alone would wait (MLflow's import, the store's first read: up to
            # tracking.timeout_s on a slow server) while the other ranks sit in the first step's collective, whose
            # train.collective_timeout_s would then fail a healthy group as hung
            self.logger = RunLogger(spec.tracking_uri, run_id, timeout_s=cfg.tracking.timeout_s,
                                    system_metrics=cfg.tracking.system_metrics, wait_for_server=False)
        self.preemption = PreemptionCheck(cfg, spec.run_dir, rank, state.total_steps, stop_asked=self._stop_asked,
                                          world=state.world)

    def _stop_asked(self) -> bool:
        """Has the driver's operator asked this run to stop (raytrain/interrupt.py)? Rank 0 asks the progress actor."""
        import ray

        sink = self.spec.progress_sink
        # a slow answer is no stop yet (the next check asks again): the other ranks wait in the broadcast meanwhile
        return sink is not None and bool(ray.get(sink.stop_requested.remote(self.spec.progress_run), timeout=2))

    # -- checkpoint on preemption (raytrain/preemption.py): ask Ray every few steps, checkpoint, hold
    def preemption_notice(self, step):
        return self.preemption.due(step)

    def on_preempted(self, step):
        if self.logger is not None:  # the notice's checkpoint already waited for the queue; send what is left
            self.logger.flush(timeout_s=self.spec.cfg.tracking.timeout_s)
        if self.preemption.stopping:  # the operator's stop: the loop ends, close() waits for the uploads
            return
        self.preemption.hold(step)  # returns never: Ray Train restarts the group from this step's checkpoint

    def before_step(self, step):
        self.faults.before_step(step)

    def on_batches(self, step, batches):
        self.samples.write(step, batches)
        self.faults.after_batches(step)

    def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
        if self.spec.report_every_eval and "eval_loss" in metrics and not is_checkpoint:
            self._report_eval(step, metrics)  # every rank: a report is a barrier (a sweep's trials, raytrain/sweep.py)
        if self.state.rank != 0:
            return
        if self.preemption.asks:  # what asking Ray for a drain notice costs, in ms per ask (bench/bench_preemption.py)
            metrics["perf/preemption_ask_ms"] = 1000 * self.preemption.ask_seconds / self.preemption.asks
        if self.spec.progress_sink is not None:  # fire-and-forget: the driver's console view
            self.spec.progress_sink.push.remote(self.spec.progress_run, {**metrics, "checkpoint": is_checkpoint})
        if self.logger is not None:  # grouped names (tracking/names.py): train/, eval/, rl/, perf/, sys/
            group = self.spec.stage.metric_group
            for s, loss in per_step_loss:
                self.logger.log_metrics({metric_name("loss", group): loss}, step=s)
            self.logger.log_metrics({metric_name(k, group): v for k, v in metrics.items() if k not in ("loss", "step")},
                                    step=step)

    def _report_eval(self, step, metrics):
        """An eval step between checkpoints: its score to Ray Train's report callbacks (Tune's ASHA), no checkpoint."""
        import ray.train

        ray.train.report({k: metrics[k] for k in ("step", "epoch", "loss", "eval_loss") if k in metrics})

    def on_checkpoint(self, step, metrics, validate: Optional[bool] = None):
        import ray.train
        from ray.train import Checkpoint

        if self.logger is not None and step == self.state.total_steps:
            # the last points get one request's time (tracking.timeout_s), like every checkpoint's flush: a down
            # server costs the run's end that, not RunLogger.close's default 30 s; what is not sent is counted
            metrics["tracking_summary"] = json.dumps(self.logger.close(timeout_s=self.spec.cfg.tracking.timeout_s))
            self.logger = None
        if self.logger is not None:  # points up to this checkpoint must not wait: a crash replays only later steps
            self.logger.flush(timeout_s=self.spec.cfg.tracking.timeout_s)
        # the only ray.train.report of the loop: it is a barrier, so it comes with a checkpoint
        # (a few keys: every metric already went to MLflow, and Ray logs what it is given)
        brief = {k: metrics[k] for k in ("step", "epoch", "loss", "eval_loss", "tracking_summary") if k in metrics}
        if validate is None:  # eval.tasks: Ray Train runs raytrain/validation.py on this checkpoint in a task of its own
            validate = validation_due(self.spec.cfg, step, self.state.total_steps)
        started = time.perf_counter()
        if self.spec.cfg.checkpoint.upload == "async":
            self._report_async(step, brief, validate)
        else:
            with tempfile.TemporaryDirectory(prefix="mmr-ckpt-") as tmp:
                self.state.save(tmp, self.run_id, self.spec.prepared_dir, reported=brief)
                self.faults.before_report(step)
                ray.train.report(brief, checkpoint=Checkpoint.from_directory(tmp), validation=validate)
        _REPORTED["step"] = step
        if self.logger is not None:  # what the checkpoint cost the loop (bench/bench_checkpoint_upload.py)
            self.logger.log_metrics({"perf/checkpoint_blocked_s": time.perf_counter() - started}, step=step)

    def _report_async(self, step, brief, validate):
        """checkpoint.upload=async: the files go to a staging folder of this node, which outlives this call; Ray
        Train's one upload thread copies them to storage and removes the folder once they are all there (an upload
        that fails leaves it, and fails the group: :func:`remove_staging` takes it then). The report itself is still
        the ranks' barrier (Ray agrees on the checkpoint's name first); what it no longer waits for is the upload, so
        a restart may find this checkpoint half uploaded, which COMPLETE.json's sizes refuse."""
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        root = staging_root(self.spec.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f"step{step}-rank{self.state.rank}-", dir=root)
        _STAGING.append(staging)
        self.state.save(staging, self.run_id, self.spec.prepared_dir, reported=brief)
        self.faults.before_report(step)
        ray.train.report(brief, checkpoint=Checkpoint.from_directory(staging), validation=validate,
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC, delete_local_checkpoint_after_upload=True)
        _STAGING[:] = [d for d in _STAGING if os.path.isdir(d)]  # the uploaded ones are gone

    def report_restored_final(self, meta):
        """The last step's checkpoint was saved, but a worker died before Ray Train registered it: this group
        restored it and has no step left to train. Hand it to Ray again with what was reported the first time
        (no validation: it ran, or was due, with the first report); else the run's result would be the checkpoint
        before, and the end of the run would delete this one as unregistered (soak run soak-01, issue 32)."""
        if self.state.rank == 0:
            print(f"[minimind-ray] step {meta.step} was the last; its checkpoint was not registered by Ray Train: "
                  f"reporting it again", flush=True)
        self.on_checkpoint(meta.step, {"step": meta.step, "epoch": meta.epoch, **meta.reported}, validate=False)

    def close(self):
        if self.logger is not None:
            self.logger.close()
        # the last async uploads: Ray waits for them once the train function returns; waiting here costs nothing more
        # and lets the run's staging folder go (an upload that fails is raised by Ray, which stops this worker)
        wait_for_uploads(3600)
        _STAGING.clear()
        try:
            staging_root(self.spec.run_dir).rmdir()
        except OSError:
            pass


def train_loop_per_worker(spec: WorkerSpec) -> None:
    import ray.train

    quiet_out_of_memory_tracebacks()  # an OOM is said in one line by the driver (raytrain/oom.py)
    own_lines()  # our log warnings as [minimind-ray] lines, which a quiet driver still shows (console.py)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = pick_device(spec.use_gpu)
    faults = FaultInjector(spec.cfg, spec.run_dir, rank, device)
    remove_staging(spec.run_dir)  # what an earlier group of this run left on this node (checkpoint.upload=async)
    _REPORTED["step"] = None
    try:
        _train(spec, rank, world, device, faults)
    except Exception as e:
        faults.record_failure(e)  # a chaos run's record of where this rank failed; a no-op otherwise
        # the checkpoint before this failure may still be on its way (checkpoint.upload=async): let it arrive, so a
        # failure costs at most one checkpoint interval. Removing this rank's folder mid-copy left Ray's thread
        # uploading a part of it, which the restart refused (CI, stop 52: rank 1 raised a step after a checkpoint,
        # and the group went back two intervals, or could not restore at all). The other ranks' uploads are waited
        # for in storage: the controller stops them as soon as this rank's error reaches it.
        if wait_for_uploads(UPLOAD_WAIT_ON_FAILURE_S) and _REPORTED["step"] is not None:
            wait_for_whole_checkpoint(spec.run_dir, _REPORTED["step"], PEERS_WAIT_ON_FAILURE_S)
        remove_staging()
        with contextlib.suppress(AttributeError, TypeError):  # what the controller compares and the driver logs
            setattr(e, STEP_ATTR, faults.step)  # (failures.signature, the run's error.log)
            setattr(e, TRACEBACK_ATTR, traceback.format_exc()[-20000:])
        raise


_STAGING: List[str] = []  # this worker's async checkpoints not yet uploaded (their staging folders)
_REPORTED = {"step": None}  # the step of this worker's last checkpoint handed to Ray Train
UPLOAD_WAIT_ON_FAILURE_S = 600  # a failing worker waits this long at most for its own checkpoints' uploads
PEERS_WAIT_ON_FAILURE_S = 60  # and this long for the other ranks' files of its last checkpoint


def wait_for_uploads(timeout_s: float) -> bool:
    """Wait until Ray Train's upload thread has copied this worker's async checkpoints to storage (it removes each
    staging folder once its files are all there); False if some are still on their way after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(os.path.isdir(d) for d in _STAGING):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def staging_root(run_dir: str) -> Path:
    """This node's folder of a run's async checkpoints not yet uploaded (checkpoint.upload=async)."""
    return Path(tempfile.gettempdir()) / f"mmr-staging-{hashlib.sha256(run_dir.encode()).hexdigest()[:12]}"


def wait_for_whole_checkpoint(run_dir: str, step: int, timeout_s: float) -> bool:
    """Wait until the run's checkpoint of ``step`` (or a newer one) is whole in storage: every rank's files listed in
    its COMPLETE.json, at their sizes. False after ``timeout_s`` (an upload that failed: the restart takes the one
    before)."""
    deadline = time.monotonic() + timeout_s
    while newest_complete(run_dir, newer_than=step - 1) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def remove_staging(run_dir: Optional[str] = None) -> None:
    """A failed worker's staging folders, or (``run_dir``, as a group starts) all a run's folders on this node: a
    worker whose group failed from an upload raised in Ray's thread, or was killed, never got to remove its own.
    No upload of the run is in flight then: a group starts after the one before has stopped, and no rank of it writes
    a checkpoint before every rank has started (the first step's collectives come first)."""
    while _STAGING:
        shutil.rmtree(_STAGING.pop(), ignore_errors=True)
    if run_dir:
        shutil.rmtree(staging_root(run_dir), ignore_errors=True)


def _train(spec: WorkerSpec, rank: int, world: int, device: torch.device, faults: FaultInjector) -> None:
    state = TrainState.build(spec.cfg, spec.prepared_dir, rank, world, device, stage=spec.stage)
    run_id = spec.mlflow_run_id
    stored, registered = restore_point(spec, rank, world)
    meta = None
    if stored is not None:
        with reading(f"checkpoint {stored.location} (the run's own, restored)"):  # a run whose settings changed under it
            meta = state.restore(stored)
        run_id = meta.mlflow_run_id or run_id
        if rank == 0:
            print(f"[minimind-ray] restored step {meta.step} (saved by {meta.world_size} workers, now {world}; "
                  f"accumulation {state.stream.accumulation_steps})", flush=True)
    faults.step = state.step
    hooks = RayHooks(spec, state, run_id, faults)
    if meta is not None and not registered and state.step >= state.total_steps:
        hooks.report_restored_final(meta)
    run(state, hooks)
    hooks.close()  # on success only: after a failure the restarted group replays, and nothing must wait
