"""Driver side of a training run: Ray, data, MLflow run, TorchTrainer, exports.

``run(cfg)`` is what every pipeline and CLI verb calls::

    connect to Ray (cluster.address / RAY_ADDRESS / a local one)
    tokenizer + prepared data (raw jsonl is tokenized once, with Ray Data)
    fail fast if the cluster cannot hold the worker group
    MLflow: create the run, or reopen it when this run name resumes
    LeanTorchTrainer(train_loop_per_worker).fit()   one frozen WorkerSpec; workers restore themselves
    final checkpoint -> MiniMind .pth + safetensors (+ LoRA weights) -> MLflow artifacts + registry
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from minimind_ray.cluster_config import worker_threads
from minimind_ray.config import ConfigError, RunConfig, from_dict, run_identity
from minimind_ray.console import after_ray_start, ray_init_options
from minimind_ray.fsio import filesystem, is_uri, join, redact
from minimind_ray.raytrain.lineage import lineage_tags, skipped
from minimind_ray.raytrain.oom import explain as explain_oom, warn_if_short
from minimind_ray.raytrain.preemption import check_interval
from minimind_ray.raytrain.progress import ProgressPrinter, progress_sink
from minimind_ray.raytrain.resources import ClusterTooSmall, check_resources, worker_resources
from minimind_ray.raytrain.restarts import fit as fit_with_restarts
from minimind_ray.raytrain.runtime_env import shipped_modules, side_cpus, worker_pythonpath
from minimind_ray.raytrain.spec import WorkerSpec
from minimind_ray.raytrain.validation import validation_config
from minimind_ray.stages import get_stage
from minimind_ray.store.reach import check_storage
from minimind_ray.tracking.artifacts import log_final_artifacts
from minimind_ray.tracking.runs import finish_run, resolve_tracking_uri, start_run

REPO_ROOT = Path(__file__).resolve().parents[2]
PREPARE_OOM_RETRIES = 2  # a prepare task killed for memory more often than this fails the command (data/prepare.py)


class RunFinished(ConfigError):
    """``resume=auto`` found this run finished, with no more steps asked for: the same command run again. The CLI
    says where its results are and exits 0 (:meth:`line`); a pipeline or sweep uses the run as it is."""

    def __init__(self, msg: str, name: str = "", step: int = 0, run_dir: str = "", checkpoint: str = "",
                 mlflow_run_id: Optional[str] = None):
        super().__init__(msg)
        self.name, self.step, self.run_dir, self.checkpoint, self.mlflow_run_id = (name, step, run_dir, checkpoint,
                                                                                   mlflow_run_id)

    def line(self) -> str:
        """``already finished at step N: <run dir>, <export>, MLflow <id>``, and how to train on."""
        export = f"{self.run_dir.rstrip('/')}/export"
        export = export if _has_run_state(export) else "no export (the driver stopped before writing it)"
        return redact(f"[minimind-ray] {self.name} already finished at step {self.step}: {self.run_dir}, {export}, "
                      f"MLflow {self.mlflow_run_id or '(untracked)'}; raise train.max_steps above {self.step} to "
                      f"train it further, or pass --fresh to start anew")


@dataclass
class RunResult:
    name: str
    run_dir: str
    checkpoint_dir: Optional[str]
    mlflow_run_id: Optional[str]
    tracking_uri: Optional[str]
    exports: Dict[str, str] = field(default_factory=dict)
    metrics: Dict[str, Any] = field(default_factory=dict)
    latest: Optional[str] = None  # <storage>/<stage>-latest, linked to this run (store/checkpoint.py:mark_latest)


# --------------------------------------------------------------------------- Ray and resources


def in_ray_job() -> bool:
    """True in the driver of a `ray job submit` (Ray sets this variable there, not RAY_JOB_ID)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def warn_relative_paths(cfg: RunConfig) -> None:
    """Under `ray job submit` the cwd is a temporary copy of the working dir: relative outputs vanish with it."""
    rel = [f for f, v in (("checkpoint.storage_path", cfg.checkpoint.storage_path),
                          ("data.cache_dir", cfg.data.cache_dir)) if not is_uri(v) and not os.path.isabs(v)]
    if cfg.tracking.enabled and not (cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")):
        rel.append("tracking.uri")
    if rel:
        print(f"[minimind-ray] WARNING: {', '.join(rel)} resolve inside the job's temporary working dir "
              f"({os.getcwd()}); pass absolute paths or URIs to keep the results", flush=True)


def connect_ray(cfg: RunConfig, dashboard: bool = True, num_cpus: Optional[int] = None):
    """Join cluster.address / RAY_ADDRESS, or start a local Ray sized for this run (with its dashboard
    unless ``dashboard=False``: ``prepare`` needs none, and it starts in half the time), or with ``num_cpus``
    logical CPUs if more (a sweep's trials at once)."""
    import ray

    if ray.is_initialized():
        return ray
    # Tasks this driver owns (the prepare job's) that Ray's memory monitor kills are retried without end
    # by default ("infinite oom retries remaining"): the command would hang. Read when Ray starts here.
    os.environ.setdefault("RAY_task_oom_retries", str(PREPARE_OOM_RETRIES))
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {"PYTHONPATH": worker_pythonpath(), "TOKENIZERS_PARALLELISM": "false"}}
    quiet = ray_init_options()  # Ray's own lines to its log files, unless --verbose (console.py)
    if in_ray_job():
        after_ray_start(ray.init(**quiet))  # the job's own runtime env already applies; another one would conflict
    elif address:
        after_ray_start(ray.init(address=address, runtime_env=env, **quiet))
    else:
        # Logical CPUs: the workers plus room for Ray Data (it starves when workers take every CPU).
        # (and what runs beside the workers: the evaluation task of eval.tasks, GRPO's rollout actors)
        need = math.ceil(cfg.cluster.num_workers * cfg.cluster.cpus_per_worker + side_cpus(cfg)) + 1
        # The dashboard (127.0.0.1 only) also serves the state API that Ray Train's placement-group
        # cleaner polls; without it the cleaner logs a warning every few seconds. Its port is chosen here and
        # given to every actor (RAY_API_SERVER_ADDRESS): with other Rays on the machine the cleaner would
        # otherwise fail ("multiple active Ray instances") and a sweep's stopped trials keep their CPUs.
        port = _free_port() if dashboard else None
        # the dashboard's modules get 120 s to come up instead of Ray's 30, and ray.init waits 200 s for the
        # dashboard instead of 60: a busy machine (load 15-40 on 2 cores, measured) misses either and the whole
        # local Ray fails to start
        os.environ.setdefault("RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT", "120")
        os.environ.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "200")
        if port:
            env["env_vars"]["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
        after_ray_start(ray.init(num_cpus=max(os.cpu_count() or 1, need, num_cpus or 0), include_dashboard=dashboard,
                                 dashboard_host="127.0.0.1", runtime_env=env, **({"dashboard_port": port} if port else {}),
                                 **quiet))
    return ray


@contextlib.contextmanager
def train_env(cfg: RunConfig):
    """The Ray Train settings of this run in this process's environment while it trains, then as they were: Ray Train
    hands them on from the driver's environment to its controller and workers (ray.train.v2's
    ENV_VARS_TO_PROPAGATE), so they apply however the run reaches Ray: a local Ray, cluster.address, or a submitted
    job, whose runtime env this driver cannot extend (a ray.init env would conflict). A value exported by the user
    wins. Yields what applies."""
    from minimind_ray.raytrain.start_guard import START_GUARD  # lazy: ray, only when this runs

    wanted = {
        # the controller polls the workers at this interval, and a checkpoint's report waits for that poll (2 s by
        # default: a barrier of up to 2 s per checkpoint)
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        # a worker group that cannot be placed (e.g. after a node loss) is retried after this, smaller when elastic
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": f"{cfg.cluster.resource_timeout_s:g}",  # Ray reads a float
    }
    if not check_interval(cfg):  # checkpoint.preemption_check_interval=0: no rank asks, so no PreemptionWatcher
        wanted["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"  # actor polling the GCS for drains (raytrain/preemption.py)
    ours = {k: v for k, v in wanted.items() if k not in os.environ}
    # The start guard (raytrain/start_guard.py) goes before the user's own callbacks and Ray's: read by the driver's
    # TorchTrainer.fit, which builds the controller's callbacks
    callbacks = os.environ.get("RAY_TRAIN_CALLBACKS")
    ours["RAY_TRAIN_CALLBACKS"] = ",".join(c for c in (START_GUARD, callbacks) if c)
    saved = {k: os.environ.get(k) for k in ours}
    os.environ.update(ours)
    try:
        yield {k: os.environ[k] for k in [*wanted, "RAY_TRAIN_CALLBACKS"]}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- run


def decide_run(cfg: RunConfig, storage: str) -> Tuple[str, str]:
    """(run name, what happens to it), by ``cfg.resume``; raises ConfigError when the choice is the user's.

    The name is ``cfg.name``, or the run's identity (:func:`minimind_ray.config.run_identity`), so the
    same command finds the same run. Ray Train resumes a run whose name it finds in storage; this decides
    beforehand whether that is what the user asked for, and says so."""
    from minimind_ray.store.checkpoint import newest_complete  # lazy: torch, only when this runs

    name = cfg.name or run_identity(cfg)
    run_dir = f"{storage.rstrip('/')}/{name}"
    latest = newest_complete(run_dir)
    if cfg.resume == "never":
        if latest is None and not _has_run_state(run_dir):
            return name, f"starting run {name}"
        if cfg.name:
            raise ConfigError(f"resume: run {name!r} already exists in {storage} and resume=never starts a new run; "
                              f"choose another name= (nothing is deleted)")
        name = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        return name, f"starting run {name} (resume=never; {run_dir} is left as it is)"
    if latest is None:
        if cfg.resume == "must":
            raise ConfigError(f"resume: must, but run {name!r} has no complete checkpoint in {storage}")
        return name, f"starting run {name}" + (" (its earlier attempt left no checkpoint)" if _has_run_state(run_dir)
                                                else "")
    meta = latest.meta()
    if meta.step < meta.total_steps:
        return name, f"resuming run {name} from step {meta.step} of {meta.total_steps} ({latest.location})"
    old = from_dict(meta.config).train
    t = cfg.train
    more = t.max_steps > meta.step if t.max_steps else (old.max_steps is None and t.epochs > old.epochs)
    if more:
        return name, f"training run {name} further from its last checkpoint (step {meta.step}, {latest.location})"
    msg = (f"resume: run {name!r} finished at step {meta.step} ({latest.location}). To train it further, raise "
           f"train.max_steps above {meta.step} (or train.epochs); to start anew, pass --fresh or resume=never (a new "
           f"run name) or another name=")
    if cfg.resume == "must":
        raise ConfigError(msg.replace("resume: run", "resume: must, but run", 1))
    raise RunFinished(msg, name, meta.step, run_dir, latest.location, meta.mlflow_run_id)


def _absolute_weight_paths(t):
    """The TrainConfig with every local weights path made absolute: workers run in another directory."""
    def absolute(p):
        return p if p is None or is_uri(p) else str(Path(p).expanduser().resolve())

    return dataclasses.replace(t, init_from=absolute(t.init_from),
                               dpo=dataclasses.replace(t.dpo, reference=absolute(t.dpo.reference)),
                               distill=dataclasses.replace(t.distill, teacher_weights=absolute(t.distill.teacher_weights)))


def _has_run_state(run_dir: str) -> bool:
    """Has Ray Train left anything of this run in storage (so that starting it again resumes it)?"""
    import pyarrow.fs as pafs

    fs, root = filesystem(run_dir)
    return fs.get_file_info(root).type == pafs.FileType.Directory


def storage_root(cfg: RunConfig) -> str:
    """checkpoint.storage_path as the run sees it: a URI as given, a local path made absolute."""
    sp = cfg.checkpoint.storage_path
    return sp if is_uri(sp) else str(Path(sp).expanduser().resolve())


def _finish(spec: WorkerSpec, result, tokenizer) -> RunResult:
    """Exports of the final checkpoint, the checkpoint index, then MLflow artifacts.

    The exports land in ``<run_dir>/export``. With URI storage they are written to a local temporary
    directory first (export and MLflow need local files), copied up to storage, and the temporary
    directory is removed: nothing of the run is left behind in /tmp."""
    import contextlib
    import tempfile

    import pyarrow.fs as pafs

    from minimind_ray.export import export_run_checkpoint  # lazy: torch, only when this runs
    from minimind_ray.store.checkpoint import prune_untracked  # lazy: torch, only when this runs

    cfg, run_dir, name, run_id = spec.cfg, spec.run_dir, spec.cfg.name, spec.mlflow_run_id
    remote = is_uri(run_dir)
    ck = result.checkpoint
    ckpt_dir = None if ck is None else (join(run_dir, Path(ck.path).name) if remote else ck.path)
    out = RunResult(name=name, run_dir=run_dir, checkpoint_dir=ckpt_dir, mlflow_run_id=run_id,
                    tracking_uri=spec.tracking_uri, metrics=dict(result.metrics or {}))
    if ck is None:
        return out
    if cfg.checkpoint.num_to_keep:  # what Ray keeps is what num_to_keep asked for; drop what it never registered
        removed = prune_untracked(run_dir, {Path(c.path).name for c, _ in (result.best_checkpoints or [])})
        if removed:
            print(f"[{name}] removed checkpoints Ray did not keep (unregistered or cut short by a crash): {removed}",
                  flush=True)
    staging = tempfile.TemporaryDirectory(prefix="mmr-export-") if remote else contextlib.nullcontext(
        str(Path(run_dir) / "export"))
    with staging as export_dir:
        export_dir = Path(export_dir)
        out.exports = export_run_checkpoint(cfg, ckpt_dir, export_dir)
        index = export_dir / "checkpoints.json"  # where every kept checkpoint is, by step: MLflow points at storage
        index.write_text(json.dumps([{"path": redact(join(run_dir, Path(c.path).name)),
                                      **{k: m.get(k) for k in ("step", "loss")}}
                                     for c, m in (result.best_checkpoints or [])], indent=1))
        if run_id:
            extra = {str(index): "checkpoints"}
            if "lora" in out.exports:
                extra[out.exports["lora"]] = "model/lora"
            final = log_final_artifacts(
                spec.tracking_uri, run_id, pth_path=out.exports.get("pth"),
                safetensors_path=out.exports.get("safetensors"), tokenizer_dir=tokenizer.path,
                manifest_path=None if is_uri(spec.prepared_dir) else str(Path(spec.prepared_dir) / "manifest.json"),
                registered_model=cfg.tracking.registered_model or f"minimind-{cfg.train.stage}", extra=extra)
            out.metrics["model_version"] = final.get("model_version")
            if final.get("errors"):
                print(redact(f"[{name}] tracking: not everything was logged: {final['errors']}"), flush=True)
        if remote:
            fs, root = filesystem(join(run_dir, "export"))
            pafs.copy_files(str(export_dir), root, destination_filesystem=fs)
            out.exports = {k: join(join(run_dir, "export"), Path(v).name) if Path(v).exists() else v
                           for k, v in out.exports.items()}
    return out


def run(cfg: RunConfig, *, tags: Optional[Dict[str, str]] = None, callbacks=(), report_every_eval: bool = False
        ) -> RunResult:
    """Train one stage end to end; resumes when a run of this name exists in storage.
    ``cfg`` is not modified: what the driver decides goes into the run's own copy (WorkerSpec.cfg).
    A sweep or pipeline passes its MLflow ``tags`` (the parent run), Ray Train ``callbacks`` (Tune's report) and
    ``report_every_eval`` (each eval step's score reported, for ASHA); every run is tagged with its lineage."""
    storage = storage_root(cfg)
    check_storage(storage)  # a store that is down reads as empty: one line naming it, before Ray (store/reach.py)
    name, plan = decide_run(cfg, storage)  # before Ray is imported: a finished run or a choice for the user is a second
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.v2.api.config import LoggingConfig

    from minimind_ray.data.prepare import ensure_prepared  # lazy: numpy, only when this runs
    from minimind_ray.raytrain.faults import (LaunchFault, StartFaults, failure_callback, lost_report_callbacks,
                                             not_placed, start_fault_callbacks, torch_config)
    from minimind_ray.raytrain.trainer import LeanTorchTrainer  # lazy: ray.train
    from minimind_ray.raytrain.worker import train_loop_per_worker  # lazy: torch, only when this runs
    from minimind_ray.store.checkpoint import mark_latest
    from minimind_ray.tokenizer import resolve_tokenizer  # lazy: tokenizers, only when this runs

    print(redact(f"[minimind-ray] {plan}"), flush=True)
    run_dir = f"{storage.rstrip('/')}/{name}"
    connect_ray(cfg)
    if in_ray_job():
        warn_relative_paths(cfg)

    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = bool(gpus) if cfg.cluster.use_gpu is None else cfg.cluster.use_gpu
    if cfg.cluster.backend == "nccl" and not use_gpu:
        raise ConfigError("cluster.backend: nccl needs GPU workers, and this run has none "
                          f"({'cluster.use_gpu=false' if cfg.cluster.use_gpu is False else 'the cluster has no GPUs'}); "
                          "use cluster.backend=auto (nccl on GPUs, gloo otherwise) or gloo")
    run_cfg = dataclasses.replace(cfg, name=name, cluster=dataclasses.replace(cfg.cluster, use_gpu=use_gpu),
                                  train=_absolute_weight_paths(cfg.train))
    check_resources(run_cfg, use_gpu)  # before any data work: a request that cannot fit fails in seconds
    warn_if_short(run_cfg, use_gpu)  # one worker's peak memory by the estimate, against what a worker has

    tokenizer = resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, cfg.model.generation)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} < tokenizer vocabulary {tokenizer.vocab_size}")
    prepared_dir = ensure_prepared(cfg.data, tokenizer)
    lost = skipped(prepared_dir)  # records the prepare left out are said, here and as the run's tag data/skipped
    if lost and not lost.startswith("0 of"):
        print(f"[minimind-ray] skipped {lost}; see {redact(join(prepared_dir, 'manifest.json'))}", flush=True)
    backend = cfg.cluster.backend if cfg.cluster.backend != "auto" else ("nccl" if use_gpu else "gloo")

    uri = run_id = None
    if cfg.tracking.enabled:
        uri = resolve_tracking_uri(cfg.tracking)
        try:
            run_id = start_run(run_cfg, name, run_dir, tags={
                "world_size": str(cfg.cluster.num_workers), "device_type": "cuda" if use_gpu else "cpu",
                "backend": backend, **lineage_tags(run_cfg, prepared_dir), **(tags or {})})
        except Exception as e:  # a down tracking server must not stop training
            print(redact(f"[{name}] WARNING: MLflow at {uri} unavailable ({type(e).__name__}: {e}); training untracked"),
                  flush=True)

    progress_run = uuid.uuid4().hex  # this run's key in the process's ProgressSink
    sink = progress_sink(progress_run)
    start_faults = StartFaults.of(cfg, run_dir)  # train.faults' start:<phase>:<rank> entries (raytrain/faults.py)
    spec = WorkerSpec(cfg=run_cfg, run_dir=run_dir, prepared_dir=prepared_dir, use_gpu=use_gpu, tracking_uri=uri,
                      mlflow_run_id=run_id, progress_sink=sink, progress_run=progress_run,
                      report_every_eval=report_every_eval,
                      launch_fault=LaunchFault(start_faults) if start_faults and start_faults.has("launch") else None)
    threads = worker_threads(cfg)
    plugin_modules = shipped_modules(cfg)  # the user's own modules: the workers' and the validation task's
    num_workers = (cfg.cluster.min_workers, cfg.cluster.num_workers) if cfg.cluster.min_workers else cfg.cluster.num_workers
    validation = validation_config(cfg.eval, run_dir=run_dir, tracking_uri=uri if run_id else None,
                                   cache_dir=str(Path(cfg.data.cache_dir).resolve()) if not is_uri(cfg.data.cache_dir)
                                   else cfg.data.cache_dir, tracking_timeout_s=cfg.tracking.timeout_s,
                                   py_modules=plugin_modules)
    make_trainer = lambda failures_left: LeanTorchTrainer(  # noqa: E731 (start_guard.fit makes one per attempt)
        functools.partial(train_loop_per_worker, spec),
        validation_config=validation,
        torch_config=torch_config(start_faults, backend=backend, timeout_s=int(cfg.train.collective_timeout_s)),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker=worker_resources(cfg, use_gpu),
                                     **({"elastic_resize_monitor_interval_s": 10.0} if cfg.cluster.min_workers else {})),
        run_config=RayRunConfig(
            name=name, storage_path=storage,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep,
                                               checkpoint_score_attribute=cfg.checkpoint.score_metric,
                                               checkpoint_score_order=cfg.checkpoint.score_order),
            # a start failure ends the fit at once: start_guard.fit counts it against cluster.max_failures and fits
            # the run again (Ray would retry it without a limit, into a placement group it leaked)
            failure_config=FailureConfig(max_failures=failures_left, controller_failure_limit=0),
            callbacks=[failure_callback(sink, progress_run, run_dir), *start_fault_callbacks(start_faults),
                       *lost_report_callbacks(cfg), *callbacks],
            logging_config=LoggingConfig(log_level="WARNING"),  # progress comes from ProgressPrinter
            worker_runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                                             "TOKENIZERS_PARALLELISM": "false",
                                             "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"},  # else prints show twice
                                # the user's own plug-ins (the stage's reward terms, tools) reach every worker and what
                                # it starts (rollout actors, the tool worker), on any node, in every mode: a submitted
                                # job's working_dir holds only what was in it
                                **({"py_modules": plugin_modules} if plugin_modules else {})},
        ),
    )
    stage = get_stage(cfg.train.stage)  # the console shows its headline metrics
    printer = ProgressPrinter(sink, progress_run, name, stage.headline, stage.rl)
    printer.start()
    # the run's end in MLflow, each request bounded by the user's tracking.timeout_s (finish_run's own is 10 s)
    end_mlflow_run = functools.partial(finish_run, uri, run_id, timeout_s=cfg.tracking.timeout_s)
    try:
        with train_env(cfg):
            result = fit_with_restarts(make_trainer, cfg.cluster.max_failures, run_dir, name, cfg.cluster.min_workers)
    except BaseException as e:
        printer.close()
        oom = explain_oom(run_cfg, e)  # one line naming the settings, instead of Ray's traceback
        one_line = oom or (ClusterTooSmall(not_placed(e)) if not_placed(e) else None)
        if run_id:
            end_mlflow_run("FAILED", error=redact(str(one_line) if one_line else f"{type(e).__name__}: {e}"))
        if one_line is not None:
            raise one_line from None
        raise
    printer.close()
    try:
        out = _finish(spec, result, tokenizer)
    except BaseException as e:
        if run_id:
            end_mlflow_run("FAILED", error=f"after training: {type(e).__name__}: {e}")
        raise
    if run_id:
        end_mlflow_run("FINISHED")
    if out.checkpoint_dir:  # the next stage starts from <storage>/<stage>-latest
        out.latest = mark_latest(run_dir, cfg.train.stage)
    summary = out.metrics.get("tracking_summary")
    if summary:
        s = json.loads(summary) if isinstance(summary, str) else summary
        if s.get("metrics_dropped") or s.get("errors"):
            print(redact(f"[{name}] tracking summary: {s}"), flush=True)
    return out
