"""Driver side of a training run: one run end to end, as a list of steps (docs/architecture.md, "The path of one
run"). ``run(spec)`` is what every pipeline, sweep and CLI verb calls, with the run resolved once
(config.py:resolve_run); it reads the resolved run and never rebuilds or validates it again::

    check_before_ray   what the run's files decide (preflight.py): the stage's other weights, the tokenizer, what a
                       local Ray can hold, a look at the data; a mistake is said before Ray starts
    decide_run         a new run, a resumed one, one trained further, or one already finished (resume.py)
    hold_lease         one writer per run: the run's lease, or a refusal naming its holder (store/lease.py)
    set_aside_refused_checkpoints   a checkpoint that no longer verifies, out of Ray's count (store/retention.py)
    connect            a cluster or a local Ray (session.py), GPUs or not, the worker group checked against it
    prepare_data       raw jsonl tokenized once with Ray Data into Parquet + manifest (data/prepare.py)
    open_tracking      the MLflow run: created, or reopened when this run name resumes
    build_trainer      one frozen WorkerSpec, the fault wiring (faults.py:fault_wiring), a trainer per attempt
    fit                fitted again after a failed start (restarts.py); a failure said in one line (failed.py)
    finish             the final checkpoint's exports, the MLflow artifacts and registry, the <stage>-latest link
"""
from __future__ import annotations

import dataclasses
import functools
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from minimind_ray.cluster_config import worker_threads
from minimind_ray.config import RunConfig, RunSpec, resolve
from minimind_ray.fsio import filesystem, is_uri, join, redact
from minimind_ray.preflight import check_before_ray
from minimind_ray.raytrain.failed import explain as explain_failure
from minimind_ray.raytrain.faults import fault_wiring
from minimind_ray.raytrain.interrupt import Interrupted, StopRequest, stop_on_signals
from minimind_ray.raytrain.lineage import lineage_tags, skipped
from minimind_ray.raytrain.oom import warn_if_short
from minimind_ray.raytrain.progress import ProgressPrinter, progress_sink
from minimind_ray.raytrain.resources import check_resources, worker_resources
from minimind_ray.raytrain.restarts import fit as fit_with_restarts
from minimind_ray.raytrain.resume import decide_run, storage_root
from minimind_ray.raytrain.runtime_env import shipped_modules
from minimind_ray.raytrain.session import (connect_ray, gpus_and_backend, in_ray_job, starts_own_ray, train_env,
                                           warn_relative_paths)
from minimind_ray.raytrain.spec import WorkerSpec
from minimind_ray.raytrain.validation import validation_config
from minimind_ray.rl.constraints import with_absolute_schema
from minimind_ray.stages import Stage
from minimind_ray.store.lease import hold as hold_lease
from minimind_ray.tracking.artifacts import log_final_artifacts
from minimind_ray.tracking.runs import finish_run, resolve_tracking_uri, start_run


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


def run(run_spec: Union[RunSpec, RunConfig], *, tags: Optional[Dict[str, str]] = None, callbacks=(),
        report_every_eval: bool = False) -> RunResult:
    """Train one stage end to end; resumes when a run of this name exists in storage.
    ``run_spec``: the run resolved once (config.py:resolve_run), read and never rebuilt; a RunConfig (a library
    caller's own) is resolved here, once. Nothing of it is modified: what the driver decides goes into its own copy
    (WorkerSpec.cfg). A sweep or pipeline passes its MLflow ``tags`` (the parent run), Ray Train ``callbacks`` (Tune's
    report) and ``report_every_eval`` (each eval step's score reported, for ASHA); every run is tagged with its
    lineage."""
    run = run_spec if isinstance(run_spec, RunSpec) else resolve(run_spec)
    checked = check_before_ray(run, local_ray=starts_own_ray(run.cfg))
    storage = storage_root(run.cfg)
    name, plan = decide_run(run.cfg, storage)  # a finished run, or a choice for the user, is said before Ray starts
    run_dir = f"{storage.rstrip('/')}/{name}"
    lease = hold_lease(run_dir)  # one writer per run: a second command on it is refused here, before Ray
    try:
        return train_held_run(run, checked, name, run_dir, storage, tags, callbacks, report_every_eval,
                              said=(plan, *run.lines, *checked.lines, *lease.lines))
    finally:
        lease.release()


def train_held_run(run: RunSpec, checked, name: str, run_dir: str, storage: str, tags, callbacks,
                   report_every_eval: bool, said=()) -> RunResult:
    """:func:`run`'s steps once this process holds the run's lease (store/lease.py), from its first lines (``said``)
    on. From :func:`connect` on, the run's own copy of the config (``cfg``: its name, GPUs or not, absolute weights
    paths) is the only one read."""
    end_mlflow_run = None
    try:  # Ctrl-C before training begins (Ray's start, the data's preparation): one line, the MLflow run KILLED
        for line in said:
            print(redact(f"[minimind-ray] {line}"), flush=True)
        set_aside_refused_checkpoints(run_dir)
        cfg, use_gpu, backend = connect(run, name)
        prepared_dir = prepare_data(cfg, checked.tokenizer)
        uri, run_id = open_tracking(cfg, run_dir, prepared_dir, {
            "world_size": str(cfg.cluster.num_workers), "device_type": "cuda" if use_gpu else "cpu",
            "backend": backend, **lineage_tags(cfg, run.stage, prepared_dir), **(tags or {})})
        if run_id:
            end_mlflow_run = functools.partial(finish_run, uri, run_id, timeout_s=cfg.tracking.timeout_s)
        progress_run = uuid.uuid4().hex  # this run's key in the process's ProgressSink
        sink = progress_sink(progress_run)
        wiring = fault_wiring(cfg, run_dir, backend, sink, progress_run)
        spec = WorkerSpec(cfg=cfg, stage=run.stage, storage=storage, run_dir=run_dir, prepared_dir=prepared_dir,
                          use_gpu=use_gpu, tracking_uri=uri, mlflow_run_id=run_id, progress_sink=sink,
                          progress_run=progress_run, report_every_eval=report_every_eval, launch_fault=wiring.launch)
        make_trainer = build_trainer(spec, wiring, [*wiring.callbacks, *callbacks])
    except KeyboardInterrupt:
        if end_mlflow_run:
            end_mlflow_run("KILLED")
        line = ("[minimind-ray] interrupted before training began: this command trained nothing and the run's "
                "checkpoints are as they were; run the same command to go on")
        print(line, flush=True)
        raise Interrupted(line, 130) from None
    stop = StopRequest()  # Ctrl-C / SIGTERM while it trains: a clean stop (raytrain/interrupt.py)
    printer = ProgressPrinter(sink, progress_run, name, spec.stage.headline, spec.stage.rl, operator_stop=stop)
    result = fit(spec, make_trainer, printer, end_mlflow_run, stop)
    if stop.asked:
        end_on_stop(spec, result, stop, end_mlflow_run)
    return finish(spec, result, checked.tokenizer, end_mlflow_run)


def end_on_stop(spec: WorkerSpec, result, stop: StopRequest, end_mlflow_run) -> None:
    """The operator stopped the run and its workers ended on a checkpoint, whose uploads they waited for: the MLflow
    run KILLED, one line (the step, the checkpoint, how to resume), :class:`Interrupted`. A run that reached its last
    step before it could stop is finished as usual."""
    from minimind_ray.store.checkpoint import open_checkpoint  # lazy: torch, only when this runs

    step, where = (result.metrics or {}).get("step"), "none"
    if result.checkpoint is not None:
        where = join(spec.run_dir, Path(result.checkpoint.path).name)
        meta = open_checkpoint(where).meta()
        if meta.step >= meta.total_steps:
            return
        step = meta.step
    if end_mlflow_run:
        end_mlflow_run("KILLED")
    line = redact(f"[minimind-ray] interrupted at step {step}: the run ends on checkpoint {where}, in storage; run "
                  f"the same command to resume")
    print(line, flush=True)
    raise Interrupted(line, stop.exit_code)


def set_aside_refused_checkpoints(run_dir: str) -> None:
    """Before Ray counts them: each checkpoint of the run that no longer verifies moved aside and out of Ray's list
    (store/retention.py), so checkpoint.num_to_keep never keeps a refused one in place of a good one; said."""
    from minimind_ray.store.retention import set_aside_refused  # lazy: torch, only when this runs

    for line in set_aside_refused(run_dir):
        print(redact(f"[minimind-ray] {line}"), flush=True)


def connect(run: RunSpec, name: str) -> Tuple[RunConfig, bool, str]:
    """Connect to Ray; (the run's own config: its name, GPUs or not, weight paths made absolute; GPUs or not; the
    torch.distributed backend), once the worker group and what runs beside it are known to fit."""
    cfg = run.cfg
    connect_ray(cfg, stage=run.stage)
    if in_ray_job():
        warn_relative_paths(cfg)
    use_gpu, backend = gpus_and_backend(cfg)
    run_cfg = dataclasses.replace(cfg, name=name, cluster=dataclasses.replace(cfg.cluster, use_gpu=use_gpu),
                                  train=absolute_weight_paths(cfg.train, run.stage))
    check_resources(run_cfg, run.stage, use_gpu)  # before any data work: a request that cannot fit fails in seconds
    warn_if_short(run_cfg, use_gpu)  # one worker's peak memory by the estimate, against what a worker has
    return run_cfg, use_gpu, backend


def prepare_data(cfg: RunConfig, tokenizer) -> str:
    """The prepared directory of cfg.data: reused, or made by the Ray Data job; the records it left out are said."""
    from minimind_ray.data.prepare import ensure_prepared  # lazy: numpy, only when this runs

    prepared_dir = ensure_prepared(cfg.data, tokenizer)
    lost = skipped(prepared_dir)  # records the prepare left out are said, here and as the run's tag data/skipped
    if lost and not lost.startswith("0 of"):
        print(f"[minimind-ray] skipped {lost}; see {redact(join(prepared_dir, 'manifest.json'))}", flush=True)
    return prepared_dir


def open_tracking(run_cfg: RunConfig, run_dir: str, prepared_dir: str, tags: Dict[str, str]
                  ) -> Tuple[Optional[str], Optional[str]]:
    """(tracking URI, MLflow run id): the run created, or reopened when this run name resumes. A tracking server that
    does not answer leaves the run untracked, with a warning: it never stops training."""
    if not run_cfg.tracking.enabled:
        return None, None
    uri = resolve_tracking_uri(run_cfg.tracking)
    try:
        return uri, start_run(run_cfg, run_cfg.name, run_dir, tags=tags, prepared_dir=prepared_dir)
    except Exception as e:  # a down tracking server must not stop training
        print(redact(f"[{run_cfg.name}] WARNING: MLflow at {uri} unavailable ({type(e).__name__}: {e}); training "
                     f"untracked"), flush=True)
        return uri, None


def build_trainer(spec: WorkerSpec, wiring, callbacks: list):
    """``make_trainer(failures_left)``: a LeanTorchTrainer of this run (restarts.fit makes one per attempt)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.v2.api.config import LoggingConfig

    from minimind_ray.raytrain.trainer import LeanTorchTrainer  # lazy: ray.train
    from minimind_ray.raytrain.worker import train_loop_per_worker  # lazy: torch, only when this runs

    cfg = spec.cfg
    threads = worker_threads(cfg)
    plugin_modules = shipped_modules(cfg, spec.stage)  # the user's own modules: the workers' and the validation task's
    cl = cfg.cluster
    num_workers = (cl.min_workers, cl.num_workers) if cl.min_workers else cl.num_workers
    validation = validation_config(cfg.eval, run_dir=spec.run_dir,
                                   tracking_uri=spec.tracking_uri if spec.mlflow_run_id else None,
                                   cache_dir=cfg.data.cache_dir if is_uri(cfg.data.cache_dir)
                                   else str(Path(cfg.data.cache_dir).resolve()),
                                   tracking_timeout_s=cfg.tracking.timeout_s, py_modules=plugin_modules)
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}  # else prints show twice
    return lambda failures_left: LeanTorchTrainer(
        functools.partial(train_loop_per_worker, spec),
        validation_config=validation,
        torch_config=wiring.torch_config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=spec.use_gpu,
                                     resources_per_worker=worker_resources(cfg, spec.use_gpu),
                                     **({"elastic_resize_monitor_interval_s": 10.0} if cl.min_workers else {})),
        run_config=RayRunConfig(
            name=cfg.name, storage_path=spec.storage,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep,
                                               checkpoint_score_attribute=cfg.checkpoint.score_metric,
                                               checkpoint_score_order=cfg.checkpoint.score_order),
            # a start failure ends the fit at once: restarts.fit counts it against cluster.max_failures and fits the
            # run again (Ray would retry it without a limit, into a placement group it leaked)
            failure_config=FailureConfig(max_failures=failures_left, controller_failure_limit=0),
            callbacks=callbacks,
            logging_config=LoggingConfig(log_level="WARNING"),  # progress comes from ProgressPrinter
            # the user's own plug-ins (the stage's reward terms, tools) reach every worker and what it starts (rollout
            # actors, the tool worker), on any node, in every mode: a submitted job's working_dir holds only what was
            # in it
            worker_runtime_env={"env_vars": env, **({"py_modules": plugin_modules} if plugin_modules else {})},
        ),
    )


def fit(spec: WorkerSpec, make_trainer, printer: ProgressPrinter, end_mlflow_run, stop: Optional[StopRequest] = None):
    """Ray Train's result of the run, fitted again after each failed start; a failure ends the MLflow run and is
    raised as one line where it can be (failed.py), its tracebacks in the run's error.log. ``stop``: the operator's
    signals while it trains (interrupt.py); a second one ends the run at once, KILLED."""
    cfg = spec.cfg
    printer.start()
    try:
        with train_env(cfg), stop_on_signals(stop or StopRequest()):
            result = fit_with_restarts(make_trainer, cfg.cluster.max_failures, spec.run_dir, cfg.name,
                                       cfg.cluster.min_workers)
    except KeyboardInterrupt:  # the second signal (or Ctrl-C outside a main thread's handler): stopped at once
        printer.close()
        if end_mlflow_run:
            end_mlflow_run("KILLED")
        code = stop.exit_code if stop is not None and stop.asked else 130
        line = ("[minimind-ray] stopped at once by the operator; run the same command to resume from the last "
                "checkpoint in storage")
        print(line, flush=True)
        raise Interrupted(line, code) from None
    except BaseException as e:
        printer.close()
        one_line = explain_failure(cfg, spec.run_dir, e)
        if end_mlflow_run:
            end_mlflow_run("FAILED", error=redact(str(one_line) if one_line else f"{type(e).__name__}: {e}"))
        if one_line is not None:
            raise one_line from None
        raise
    printer.close()
    return result


def finish(spec: WorkerSpec, result, tokenizer, end_mlflow_run) -> RunResult:
    """The exports and MLflow artifacts (export_and_log), the MLflow run's end, the <stage>-latest link."""
    from minimind_ray.store.checkpoint import mark_latest  # lazy: torch, only when this runs

    try:
        out = export_and_log(spec, result, tokenizer)
    except BaseException as e:
        if end_mlflow_run:
            end_mlflow_run("FAILED", error=f"after training: {type(e).__name__}: {e}")
        raise
    if end_mlflow_run:
        end_mlflow_run("FINISHED")
    if out.checkpoint_dir:  # the next stage starts from <storage>/<stage>-latest
        out.latest = mark_latest(spec.run_dir, spec.stage.name)
    summary = out.metrics.get("tracking_summary")
    if summary:
        s = json.loads(summary) if isinstance(summary, str) else summary
        if s.get("metrics_dropped") or s.get("errors"):
            print(redact(f"[{spec.cfg.name}] tracking summary: {s}"), flush=True)
    return out


def absolute_weight_paths(t, stage: Stage):
    """The TrainConfig ``t`` with every local weights path made absolute (init_from, and each of the parents of
    ``stage``, its record: a reference, a teacher), and an RL section's json_schema file: the workers run in another
    directory."""
    def absolute(p):
        return p if p is None or is_uri(p) else str(Path(p).expanduser().resolve())

    t = stage.with_parents(dataclasses.replace(t, init_from=absolute(t.init_from)), absolute)
    return with_absolute_schema(t, absolute)


def export_and_log(spec: WorkerSpec, result, tokenizer) -> RunResult:
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
            # beside the weights: every other file the export wrote (LoRA's adapters, a critic), under its own name
            extra = {str(index): "checkpoints", **{path: f"model/{key}" for key, path in out.exports.items()
                                                   if key not in ("pth", "safetensors")}}
            final = log_final_artifacts(
                spec.tracking_uri, run_id, pth_path=out.exports.get("pth"),
                safetensors_path=out.exports.get("safetensors"), tokenizer_dir=tokenizer.path,
                manifest_path=None if is_uri(spec.prepared_dir) else str(Path(spec.prepared_dir) / "manifest.json"),
                registered_model=cfg.tracking.registered_model or f"minimind-{spec.stage.name}", extra=extra)
            out.metrics["model_version"] = final.get("model_version")
            if final.get("errors"):
                print(redact(f"[{name}] tracking: not everything was logged: {final['errors']}"), flush=True)
        if remote:
            fs, root = filesystem(join(run_dir, "export"))
            pafs.copy_files(str(export_dir), root, destination_filesystem=fs)
            out.exports = {k: join(join(run_dir, "export"), Path(v).name) if Path(v).exists() else v
                           for k, v in out.exports.items()}
    return out
