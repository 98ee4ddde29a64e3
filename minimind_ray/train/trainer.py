"""Driver side of a training run: Ray, data, MLflow run, TorchTrainer, exports.

``run(cfg)`` is what every pipeline and CLI verb calls::

    connect to Ray (cluster.address / RAY_ADDRESS / a local one)
    tokenizer + prepared data (raw jsonl is tokenized once, with Ray Data)
    fail fast if the cluster cannot hold the worker group
    MLflow: create the run, or reopen it when this run name resumes
    TorchTrainer(train_loop_per_worker).fit()   workers restore from the latest checkpoint themselves
    final checkpoint -> MiniMind .pth + safetensors (+ LoRA weights) -> MLflow artifacts + registry
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from minimind_ray.config import ConfigError, RunConfig, to_dict, worker_threads

REPO_ROOT = Path(__file__).resolve().parents[2]


class ClusterTooSmall(RuntimeError):
    """The cluster cannot place the requested worker group."""


@dataclass
class RunResult:
    name: str
    run_dir: str
    checkpoint_dir: Optional[str]
    mlflow_run_id: Optional[str]
    tracking_uri: Optional[str]
    exports: Dict[str, str] = field(default_factory=dict)
    metrics: Dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- Ray and resources


def in_ray_job() -> bool:
    """True in the driver of a `ray job submit` (Ray sets this variable there, not RAY_JOB_ID)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def warn_relative_paths(cfg: RunConfig) -> None:
    """Under `ray job submit` the cwd is a temporary copy of the working dir: relative outputs vanish with it."""
    rel = [f for f, v in (("checkpoint.storage_path", cfg.checkpoint.storage_path),
                          ("data.cache_dir", cfg.data.cache_dir)) if "://" not in v and not os.path.isabs(v)]
    if cfg.tracking.enabled and not (cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")):
        rel.append("tracking.uri")
    if rel:
        print(f"[minimind-ray] WARNING: {', '.join(rel)} resolve inside the job's temporary working dir "
              f"({os.getcwd()}); pass absolute paths or URIs to keep the results", flush=True)


def connect_ray(cfg: RunConfig):
    """Join cluster.address / RAY_ADDRESS, or start a local Ray sized for this run."""
    import ray

    if ray.is_initialized():
        return ray
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {
        "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false",
        # the Train controller polls workers at this interval; a checkpoint report waits for that poll
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"),
        # a worker group that cannot be placed (e.g. after a node loss) is retried, smaller when elastic
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",
                                                                 str(int(cfg.cluster.resource_timeout_s))),
    }}
    if in_ray_job():
        ray.init()  # the job's own runtime env already applies; passing another one would conflict
    elif address:
        ray.init(address=address, runtime_env=env)
    else:
        # Logical CPUs: the workers plus room for Ray Data (it starves when workers take every CPU).
        need = math.ceil(cfg.cluster.num_workers * cfg.cluster.cpus_per_worker) + 1
        # The dashboard (127.0.0.1 only) also serves the state API that Ray Train's placement-group
        # cleaner polls; without it the cleaner logs a warning every few seconds.
        ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=True, dashboard_host="127.0.0.1",
                 runtime_env=env)
    return ray


def worker_resources(cfg: RunConfig, use_gpu: bool) -> Dict[str, float]:
    res = {"CPU": cfg.cluster.cpus_per_worker}
    if use_gpu:
        res["GPU"] = 1
    if cfg.cluster.worker_resource:
        res[cfg.cluster.worker_resource] = 1
    return res


def check_resources(cfg: RunConfig, use_gpu: bool) -> None:
    """Wait up to cluster.resource_timeout_s for the worker group to fit, then fail with what is missing.

    Ray Train V2 would otherwise wait for resources forever; this turns a request the
    cluster cannot hold (4 GPU workers on a CPU cluster) into an error in seconds."""
    import ray

    need_workers = cfg.cluster.min_workers or cfg.cluster.num_workers
    per = worker_resources(cfg, use_gpu)
    deadline = time.monotonic() + cfg.cluster.resource_timeout_s
    while True:
        total = ray.cluster_resources()
        short = {k: (v * need_workers, total.get(k, 0.0)) for k, v in per.items() if total.get(k, 0.0) < v * need_workers}
        if not short:
            return
        if time.monotonic() >= deadline:
            detail = ", ".join(f"{k}: need {n:g}, cluster has {h:g}" for k, (n, h) in short.items())
            raise ClusterTooSmall(
                f"the cluster cannot hold {need_workers} worker(s) of {per} ({detail}); waited "
                f"{cfg.cluster.resource_timeout_s:g}s (cluster.resource_timeout_s). Lower cluster.num_workers, "
                f"set cluster.use_gpu=false, or add nodes.")
        time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))


# --------------------------------------------------------------------------- progress


def make_progress_sink():
    """A tiny actor that rank 0 pushes metrics to (fire-and-forget) and the driver drains.

    Progress does not go through ``ray.train.report``: that call is a barrier across
    workers polled by the controller (up to RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by
    default), so the loop reports to Ray Train only when it has a checkpoint to hand over."""
    import ray

    @ray.remote(num_cpus=0)
    class ProgressSink:
        def __init__(self):
            self.items = []

        def push(self, m):
            self.items.append(m)
            del self.items[:-1000]

        def drain(self):
            out, self.items = self.items, []
            return out

    return ProgressSink.remote()


def _make_failure_callback(sink):
    from ray.train import UserCallback

    class FailureNotice(UserCallback):
        """Runs in the Train controller: tells the driver's console that workers failed."""

        def after_exception(self, run_context, worker_exceptions):
            sink.push.remote({"_error": {r: repr(e)[:500] for r, e in worker_exceptions.items()}})

    return FailureNotice()


class ProgressPrinter(threading.Thread):
    """Driver-side view of training: a tqdm bar on a terminal, plain lines in a job log."""

    def __init__(self, sink, name: str):
        super().__init__(daemon=True)
        self.sink, self.name, self.stop = sink, name, threading.Event()
        self.tty = sys.stderr.isatty()
        self.bar = None
        self.t0 = time.monotonic()
        self.first_step: Optional[int] = None

    def run(self):
        while not self.stop.wait(0.5):
            self.drain()

    def drain(self):
        import ray

        try:
            items = ray.get(self.sink.drain.remote(), timeout=10)
        except Exception:
            return
        for m in items:
            self.show(m)

    def show(self, m: Dict[str, Any]):
        if "_error" in m:
            print(f"[{self.name}] worker failure: {m['_error']} (restarting from the latest checkpoint if "
                  f"cluster.max_failures allows)", flush=True)
            self.first_step, self.t0 = None, time.monotonic()
            return
        step, total = int(m["step"]), int(m.get("total_steps", 0) or 0)
        if self.first_step is None:
            self.first_step, self.t0 = step, time.monotonic()
            eta = float("nan")
        else:
            rate = (step - self.first_step) / max(time.monotonic() - self.t0, 1e-9)
            eta = (total - step) / rate if rate > 0 else float("nan")
        desc = f"ep {m.get('epoch', 0)} loss {m.get('loss', float('nan')):.4f} tok/s {m.get('tokens_per_s', 0):,.0f}"
        if "eval_loss" in m:
            desc += f" eval {m['eval_loss']:.4f}"
        if self.tty:
            from tqdm import tqdm

            if self.bar is None:
                self.bar = tqdm(total=total, desc=self.name, unit="step")
            self.bar.n = step
            self.bar.set_postfix_str(desc)
            self.bar.refresh()
        else:
            eta_s = "?" if math.isnan(eta) else time.strftime("%H:%M:%S", time.gmtime(eta))
            ck = " [checkpoint]" if m.get("checkpoint") else ""
            print(f"[{self.name}] step {step}/{total} {desc} ETA {eta_s}{ck}", flush=True)

    def close(self):
        self.stop.set()
        self.join(timeout=5)
        self.drain()
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- run


def default_run_name(cfg: RunConfig) -> str:
    return f"{cfg.train.stage}-{time.strftime('%Y%m%d-%H%M%S')}"


def _storage(cfg: RunConfig) -> str:
    sp = cfg.checkpoint.storage_path
    return sp if "://" in sp else str(Path(sp).expanduser().resolve())


def _finish(cfg: RunConfig, result, name, run_dir, storage, run_id, uri, tokenizer, prepared_dir) -> RunResult:
    """Exports of the final checkpoint (fetched first when storage is a URI), then MLflow artifacts."""
    import tempfile

    from minimind_ray import tracking
    from minimind_ray.export import export_run_checkpoint

    ck = result.checkpoint
    ckpt_dir = None if ck is None else (ck.path if "://" not in storage else f"{run_dir}/{Path(ck.path).name}")
    out = RunResult(name=name, run_dir=run_dir, checkpoint_dir=ckpt_dir, mlflow_run_id=run_id, tracking_uri=uri,
                    metrics=dict(result.metrics or {}))
    if ck is None:
        return out
    local = Path(ck.path) if "://" not in storage else Path(ck.to_directory(tempfile.mkdtemp(prefix="mmr-final-")))
    export_dir = Path(run_dir) / "export" if "://" not in storage else local.parent / "export"
    out.exports = export_run_checkpoint(cfg, local, export_dir)
    if cfg.checkpoint.num_to_keep:  # what Ray keeps is what num_to_keep asked for; drop what it never registered
        from minimind_ray.train.checkpoint import prune_untracked

        removed = prune_untracked(run_dir, {Path(c.path).name for c, _ in (result.best_checkpoints or [])})
        if removed:
            print(f"[{name}] removed checkpoints Ray did not keep (unregistered or cut short by a crash): {removed}",
                  flush=True)
    index = export_dir / "checkpoints.json"  # where every kept checkpoint is, by step: MLflow points at storage
    index.write_text(json.dumps([{"path": f"{run_dir}/{Path(c.path).name}", **{k: m.get(k) for k in ("step", "loss")}}
                                 for c, m in (result.best_checkpoints or [])], indent=1))
    if run_id:
        extra = {str(index): "checkpoints"}
        if "lora" in out.exports:
            extra[out.exports["lora"]] = "model/lora"
        final = tracking.log_final_artifacts(
            uri, run_id, pth_path=out.exports.get("pth"), safetensors_path=out.exports.get("safetensors"),
            tokenizer_dir=tokenizer.path, manifest_path=str(Path(prepared_dir) / "manifest.json"),
            registered_model=cfg.tracking.registered_model or f"minimind-{cfg.train.stage}", extra=extra)
        out.metrics["model_version"] = final.get("model_version")
        if final.get("errors"):
            print(f"[{name}] tracking: not everything was logged: {final['errors']}", flush=True)
    return out


def run(cfg: RunConfig) -> RunResult:
    """Train one stage end to end; resumes when a run of this name exists in storage."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.v2.api.config import LoggingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from minimind_ray import tracking
    from minimind_ray.data.prepare import ensure_prepared
    from minimind_ray.tokenizer import resolve_tokenizer
    from minimind_ray.train.loop import train_loop_per_worker

    name = cfg.name or default_run_name(cfg)
    cfg.name = name
    connect_ray(cfg)
    if in_ray_job():
        warn_relative_paths(cfg)
    storage = _storage(cfg)
    run_dir = f"{storage.rstrip('/')}/{name}"

    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = bool(gpus) if cfg.cluster.use_gpu is None else cfg.cluster.use_gpu
    cfg.cluster.use_gpu = use_gpu
    check_resources(cfg, use_gpu)  # before any data work: a request that cannot fit fails in seconds

    tokenizer = resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, cfg.model.generation)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} < tokenizer vocabulary {tokenizer.vocab_size}")
    prepared_dir = ensure_prepared(cfg.data, tokenizer)
    backend = cfg.cluster.backend if cfg.cluster.backend != "auto" else ("nccl" if use_gpu else "gloo")

    uri = run_id = None
    if cfg.tracking.enabled:
        uri = tracking.resolve_tracking_uri(cfg.tracking)
        try:
            run_id = tracking.start_run(cfg, name, run_dir, tags={
                "world_size": str(cfg.cluster.num_workers), "device_type": "cuda" if use_gpu else "cpu",
                "backend": backend})
        except Exception as e:  # a down tracking server must not stop training
            print(f"[{name}] WARNING: MLflow at {uri} unavailable ({type(e).__name__}: {e}); training untracked",
                  flush=True)

    threads = worker_threads(cfg)
    num_workers = (cfg.cluster.min_workers, cfg.cluster.num_workers) if cfg.cluster.min_workers else cfg.cluster.num_workers
    sink = make_progress_sink()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": to_dict(cfg), "prepared_dir": prepared_dir, "mlflow_run_id": run_id,
                           "tracking_uri": uri, "run_dir": run_dir, "progress_sink": sink},
        torch_config=TorchConfig(backend=backend, timeout_s=int(cfg.train.collective_timeout_s)),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker=worker_resources(cfg, use_gpu),
                                     **({"elastic_resize_monitor_interval_s": 10.0} if cfg.cluster.min_workers else {})),
        run_config=RayRunConfig(
            name=name, storage_path=storage,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
            failure_config=FailureConfig(max_failures=cfg.cluster.max_failures),
            callbacks=[_make_failure_callback(sink)],
            logging_config=LoggingConfig(log_level="WARNING"),  # progress comes from ProgressPrinter
            worker_runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                                             "TOKENIZERS_PARALLELISM": "false",
                                             "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}},  # else prints show twice
        ),
    )
    printer = ProgressPrinter(sink, name)
    printer.start()
    try:
        result = trainer.fit()
    except BaseException as e:
        printer.close()
        if run_id:
            tracking.finish_run(uri, run_id, "FAILED", error=f"{type(e).__name__}: {e}")
        raise
    printer.close()
    try:
        out = _finish(cfg, result, name, run_dir, storage, run_id, uri, tokenizer, prepared_dir)
    except BaseException as e:
        if run_id:
            tracking.finish_run(uri, run_id, "FAILED", error=f"after training: {type(e).__name__}: {e}")
        raise
    if run_id:
        tracking.finish_run(uri, run_id, "FINISHED")
    summary = out.metrics.get("tracking_summary")
    if summary:
        s = json.loads(summary) if isinstance(summary, str) else summary
        if s.get("metrics_dropped") or s.get("errors"):
            print(f"[{name}] tracking summary: {s}", flush=True)
    return out
