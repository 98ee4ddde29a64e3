"""``minimind-ray sweep``: a Ray Tune search over a recipe's fields, each trial an ordinary run (docs/sweeps.md).

    read the sweep YAML (raytrain/sweep_config.py) and its base recipe; Ray; the data prepared once
    MLflow: the sweep's parent run (created, or reopened when the same sweep runs again)
    Tune: one function trial per draw from the space, as many at once as the cluster holds (computed)
        each trial: raytrain/driver.py:run(the recipe + its values, name=<sweep>-<trial id>, resume=auto)
            a TorchTrainer of its own; its MLflow run a child of the parent; every eval step's eval_loss
            reported to Tune (ScoreReport) with the step as ASHA's time attribute
    the end: trials stopped early ended KILLED in MLflow; the best trial's values, score and run on the parent;
        its recipe written as a ready YAML (<storage>/<sweep>/best.yaml)

Killed and started again, the same command restores Tune's experiment (``Tuner.restore``): finished trials are
not run again, unfinished ones resume from their checkpoints (the runs' own resume rule), and a trial whose run
had finished although Tune did not record it yet reports its stored score instead of training again. ASHA's rungs
come back too (raytrain/asha.py): a resumed trial is compared with the scores recorded before the kill.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from minimind_ray.config import ConfigError, RunConfig, RunSpec, load_config, resolve_run, to_yaml
from minimind_ray.console import verbose
from minimind_ray.fsio import filesystem, is_uri, join, redact, write_text_atomic
from minimind_ray.raytrain import driver
from minimind_ray.raytrain.resume import RunFinished, storage_root
from minimind_ray.raytrain.session import connect_ray
from minimind_ray.raytrain.runtime_env import side_cpus
from minimind_ray.raytrain.sweep_config import SweepConfig, check_against_recipe, reported_metric, trial_overrides
from minimind_ray.tracking import parents
from minimind_ray.tracking.parents import child_tags, children, end_run, start_parent
from minimind_ray.tracking.runs import resolve_tracking_uri

TRIAL_RECORD = "sweep_trial.json"  # <run_dir>/sweep_trial.json: a finished trial's score, read if Tune lost it
TAG_SWEEP, TAG_TRIAL, TAG_PARAMS = "minimind.sweep", "minimind.sweep.trial_id", "minimind.sweep.params"
TAG_STOPPED = "minimind.sweep.stopped_early"


@dataclass
class SweepResult:
    name: str
    storage: str
    parent_run_id: Optional[str]
    tracking_uri: Optional[str]
    trials: List[Dict[str, Any]] = field(default_factory=list)  # one row per trial: id, params, score, step, status
    best: Optional[Dict[str, Any]] = None
    best_recipe: Optional[str] = None
    concurrency: int = 1
    wall_s: float = 0.0


def base_config(sweep: SweepConfig) -> RunSpec:
    """The sweep's recipe with its overrides, resolved once (config.py:resolve_run): every trial is this run with the
    trial's values (each trial resolves its own)."""
    base = resolve_run(sweep.recipe, list(sweep.overrides))
    check_against_recipe(sweep, base.cfg)
    return base


def trial_resources(sweep: SweepConfig, run: RunSpec) -> Dict[str, float]:
    """What one trial holds at once: its own process (and the side tasks it may own: the evaluation task, GRPO's
    rollout actors) plus its TorchTrainer's workers (at the largest worker count the space can draw)."""
    base, beside = run.cfg, side_cpus(run.cfg, run.stage)
    def largest(key, default):
        spec = sweep.space.get(key)
        return max(next(iter(spec.values()))) if spec else default

    workers = largest("cluster.num_workers", base.cluster.num_workers)
    per_worker = largest("cluster.cpus_per_worker", base.cluster.cpus_per_worker)
    need = {"trial": sweep.trial_cpus + beside, "CPU": sweep.trial_cpus + beside + workers * per_worker}
    if base.cluster.use_gpu:
        need["GPU"] = float(workers)
    return need


def concurrency(sweep: SweepConfig, need: Dict[str, float], total: Dict[str, float]) -> int:
    """max_concurrent_trials, or how many trials the cluster's CPUs (and GPUs) hold at once (at least 1)."""
    if sweep.max_concurrent_trials:
        return sweep.max_concurrent_trials
    fits = [math.floor(total.get(k, 0.0) / v + 1e-9) for k, v in need.items() if k in ("CPU", "GPU") and v > 0]
    return max(1, min(fits) if fits else 1)


def tune_space(space: Dict[str, Any]) -> Dict[str, Any]:
    from ray import tune

    kinds = {"choice": tune.choice, "grid": tune.grid_search, "uniform": lambda v: tune.uniform(*v),
             "loguniform": lambda v: tune.loguniform(*v), "randint": lambda v: tune.randint(*v)}
    return {k: kinds[kind](list(v)) for k, spec in space.items() for kind, v in spec.items()}


def _score_report(metric: str):
    """Tune's TuneReportCallback, passing on only the reports that carry the metric (Tune refuses a result without
    it): every eval step's report, not the checkpoints between them."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class ScoreReport(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and metric in metrics[0]:
                super().after_report(run_context, metrics, checkpoint)

    return ScoreReport()


def _read_json(path: str) -> Optional[dict]:
    try:
        fs, p = filesystem(path)
        with fs.open_input_stream(p) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def _trial(params: Dict[str, Any], ctx: Dict[str, Any]) -> None:
    """One trial, in Tune's trial process: the recipe with this trial's values, trained by the ordinary driver."""
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    name = f"{ctx['sweep']}-{trial_id}"
    run = resolve_run(ctx["recipe"], [*ctx["overrides"], *trial_overrides(params), f"name={name}", "resume=auto"])
    record = join(join(ctx["storage"], name), TRIAL_RECORD)
    key, metric = ctx["metric_key"], ctx["metric"]
    tags = child_tags(ctx["parent_id"], "sweep", **{TAG_SWEEP: ctx["sweep"], TAG_TRIAL: trial_id,
                                                      TAG_PARAMS: json.dumps(params, sort_keys=True, default=str)})
    try:
        res = driver.run(run, tags=tags, callbacks=[_score_report(key)] if key else [], report_every_eval=bool(key))
    except RunFinished:  # trained to its end by an earlier attempt that Tune did not record: not trained again
        final = _read_json(record)
        if final is None:
            raise
        tune.report(final)
        return
    final = {"step": res.metrics.get("step"), metric if not key else key: res.metrics.get(key or metric),
             "mlflow_run_id": res.mlflow_run_id or ""}
    write_text_atomic(record, json.dumps(final))
    if not key:  # a validation score: known only now, the one report of this trial
        tune.report(final)


def _tuner(sweep: SweepConfig, base: RunConfig, ctx: Dict[str, Any], storage: str, need: Dict[str, float], n: int):
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    from minimind_ray.raytrain.asha import ResumableASHA  # lazy: ray, only when this runs

    key = ctx["metric_key"] or sweep.metric
    trainable = tune.with_resources(tune.with_parameters(_trial, ctx=ctx), {"CPU": need["trial"]})
    exp_dir = join(storage, sweep.name)
    if tune.Tuner.can_restore(exp_dir):
        print(f"[minimind-ray] resuming sweep {sweep.name} ({exp_dir}): finished trials are kept", flush=True)
        return tune.Tuner.restore(exp_dir, trainable, resume_unfinished=True, resume_errored=True)
    s = sweep.scheduler
    # stop_last_trials=False: a trial that reaches max_t ends by itself (exports, its MLflow run FINISHED); ASHA's
    # default stops it at that report, killing its process before the run's end is written. Its rungs are kept in the
    # sweep's storage: Tune's own experiment state does not keep them (raytrain/asha.py)
    scheduler = (ResumableASHA(join(storage, f"{sweep.name}.asha_rungs.json"), time_attr="step",
                               max_t=s.max_steps or base.train.max_steps, grace_period=s.grace_period,
                               reduction_factor=s.reduction_factor, stop_last_trials=False)
                 if s.kind == "asha" else FIFOScheduler())
    return tune.Tuner(
        trainable, param_space=tune_space(sweep.space),
        tune_config=tune.TuneConfig(metric=key, mode=sweep.mode, scheduler=scheduler, num_samples=sweep.num_samples,
                                    # the limit goes to the generator: Tune ignores max_concurrent_trials beside it
                                    search_alg=BasicVariantGenerator(random_state=sweep.seed, max_concurrent=n),
                                    trial_dirname_creator=lambda t: t.trial_id),
        run_config=tune.RunConfig(name=sweep.name, storage_path=storage, verbose=1 if verbose() else 0,  # Tune's table
                                  failure_config=tune.FailureConfig(max_failures=sweep.max_failures)))


def _same_sweep(storage: str, sweep: SweepConfig, text: str) -> None:
    """A sweep name is its identity: running it again with another config would mix two sweeps' trials."""
    mine = join(join(storage, sweep.name), "sweep.yaml")
    old = _read_json(mine + ".json")
    want = {"space": sweep.space, "recipe": sweep.recipe, "overrides": list(sweep.overrides),
            "metric": sweep.metric, "mode": sweep.mode, "num_samples": sweep.num_samples}
    if old is not None and old != json.loads(json.dumps(want)):
        raise ConfigError(f"name: sweep {sweep.name!r} already exists in {storage} with another space, recipe, "
                          f"metric or num_samples ({mine}); choose another name (nothing is deleted)")
    if old is None:
        write_text_atomic(mine + ".json", json.dumps(want))
        write_text_atomic(mine, text)


def run_sweep(sweep: SweepConfig, text: str = "") -> SweepResult:
    """Run (or resume) the sweep to its end; the trials, the best one and its recipe."""
    from minimind_ray.data.prepare import ensure_prepared  # lazy: numpy, only when this runs
    from minimind_ray.tokenizer import resolve_tokenizer  # lazy: tokenizers, only when this runs

    t0 = time.monotonic()
    base_run = base_config(sweep)
    base = base_run.cfg
    storage = storage_root(base)
    _same_sweep(storage, sweep, text)
    need = trial_resources(sweep, base_run)
    # a local Ray started here gets room for max_concurrent_trials trials (logical CPUs, like connect_ray's own sizing)
    ray = connect_ray(base, num_cpus=math.ceil(need["CPU"] * (sweep.max_concurrent_trials or 1)), stage=base_run.stage)
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"  # trials keep the driver's cwd (Tune passes this on to them)
    # the data once, here: Ray Data inside a trial would run in the trial's placement group (its few CPUs)
    tok = resolve_tokenizer(base.data.tokenizer, base.data.cache_dir, base.model.generation)
    ensure_prepared(base.data, tok)
    uri = parent = None
    experiment = base.tracking.experiment or f"minimind-{base.train.stage}"
    if base.tracking.enabled:
        uri = resolve_tracking_uri(base.tracking)
        try:
            parent = start_parent(uri, experiment, "sweep", sweep.name, storage, _params(sweep), text,
                                  timeout_s=base.tracking.timeout_s)
        except Exception as e:  # a down tracking server must not stop the sweep
            print(redact(f"[{sweep.name}] WARNING: MLflow at {uri} unavailable ({type(e).__name__}: {e}); the sweep "
                         f"runs untracked"), flush=True)
    n = concurrency(sweep, need, ray.cluster_resources())
    print(f"[minimind-ray] sweep {sweep.name}: {n} trial(s) at once (each holds {need['CPU']:g} CPU"
          f"{', %g GPU' % need['GPU'] if 'GPU' in need else ''}), metric {sweep.metric} ({sweep.mode}), "
          f"scheduler {sweep.scheduler.kind}", flush=True)
    cache = base.data.cache_dir if is_uri(base.data.cache_dir) else os.path.abspath(base.data.cache_dir)
    ctx = {"sweep": sweep.name, "storage": storage, "parent_id": parent, "metric": sweep.metric,
           "metric_key": reported_metric(sweep),
           "recipe": sweep.recipe if is_uri(sweep.recipe) else os.path.abspath(sweep.recipe),
           # what a trial's process must not resolve against its own cwd, and the parent's experiment
           "overrides": [*sweep.overrides, f"checkpoint.storage_path={storage}", f"data.cache_dir={cache}",
                         *([f"tracking.uri={uri}", f"tracking.experiment={experiment}"] if uri else [])]}
    grid = _tuner(sweep, base, ctx, storage, need, n).fit()
    out = SweepResult(name=sweep.name, storage=storage, parent_run_id=parent, tracking_uri=uri, concurrency=n)
    out.trials = _table(grid, ctx["metric_key"] or sweep.metric)
    out.best = _best(out.trials, sweep.mode)
    if out.best is not None:
        best_cfg = load_config(sweep.recipe, [*sweep.overrides, *trial_overrides(out.best["params"])])
        out.best_recipe = join(join(storage, sweep.name), "best.yaml")
        write_text_atomic(out.best_recipe, _best_header(sweep, out.best) + to_yaml(best_cfg))
    out.wall_s = time.monotonic() - t0
    if parent:
        record_sweep(uri, parent, sweep, out, timeout_s=base.tracking.timeout_s)
    return out


def _params(sweep: SweepConfig) -> Dict[str, str]:
    s = sweep.scheduler
    return {"recipe": sweep.recipe, "overrides": " ".join(sweep.overrides), "metric": sweep.metric,
            "mode": sweep.mode, "num_samples": sweep.num_samples, "scheduler": s.kind,
            **({"grace_period": s.grace_period, "max_steps": s.max_steps, "reduction_factor": s.reduction_factor}
               if s.kind == "asha" else {}),
            **{f"space.{k}": json.dumps(v) for k, v in sweep.space.items()}}


def _table(grid, key: str) -> List[Dict[str, Any]]:
    rows = []
    for r in grid:
        m = r.metrics or {}
        rows.append({"trial_id": m.get("trial_id") or Path(str(r.path)).name, "params": dict(r.config or {}),
                     "score": m.get(key), "step": m.get("step"), "error": None if r.error is None else
                     redact(str(r.error).splitlines()[0])[:300]})
    return sorted(rows, key=lambda row: row["trial_id"])


def _best(rows: List[Dict[str, Any]], mode: str) -> Optional[Dict[str, Any]]:
    scored = [r for r in rows if r["error"] is None and isinstance(r["score"], (int, float)) and math.isfinite(r["score"])]
    if not scored:
        return None
    return (min if mode == "min" else max)(scored, key=lambda r: r["score"])


def _best_header(sweep: SweepConfig, best: Dict[str, Any]) -> str:
    values = ", ".join(trial_overrides(best["params"]))
    return (f"# The best trial of sweep {sweep.name} (trial {best['trial_id']}: {sweep.metric} = {best['score']:.6g} "
            f"at step {best['step']}), its values: {values}.\n# A ready recipe: minimind-ray <stage> --config "
            f"<this file> (name: null gives it a run of its own).\n")


def print_sweep(out: SweepResult, sweep: SweepConfig) -> None:
    print(f"\n==== sweep {out.name}: {len(out.trials)} trials, {out.concurrency} at once, {out.wall_s:.0f}s ====")
    for r in out.trials:
        score = "-" if r["score"] is None else f"{r['score']:.5g}"
        state = r["error"] or r.get("status", "")
        print(f"{r['trial_id']:<14} {json.dumps(r['params'], sort_keys=True):<48} {sweep.metric}={score:<10} "
              f"step {r['step']}  {state}")
    if out.best:
        print(f"best: trial {out.best['trial_id']} {sweep.metric}={out.best['score']:.6g} -> {out.best_recipe}")
    if out.parent_run_id:
        print(redact(f"MLflow parent run: {out.parent_run_id}  (tracking URI {out.tracking_uri})"))


def record_sweep(uri: str, parent: str, sweep: SweepConfig, out: SweepResult, timeout_s: float = 10.0) -> None:
    """The end in MLflow: each trial's run closed as what happened to it (a trial ASHA stopped is left RUNNING by
    its killed process: KILLED, tagged stopped early), then the best trial's values, score and run on the parent."""
    by_trial = {}
    try:
        for run in children(uri, parent, timeout_s=timeout_s):
            by_trial[run.data.tags.get(TAG_TRIAL)] = run
    except Exception as e:  # noqa: BLE001 - tracking must not fail the sweep
        print(redact(f"[{sweep.name}] could not list the trials' MLflow runs: {e}"), flush=True)
    for row in out.trials:
        run = by_trial.get(row["trial_id"])
        row["mlflow_run_id"] = run.info.run_id if run else None
        row["status"] = run.info.status if run else ("ERROR" if row["error"] else "")
        if run is not None and run.info.status == "RUNNING":
            stopped = row["error"] is None
            end_run(uri, run.info.run_id, "KILLED" if stopped else "FAILED", timeout_s=timeout_s,
                    tags={TAG_STOPPED: "true", "minimind.sweep.stopped_at_step": str(row["step"])} if stopped else
                    {"error": row["error"] or "trial failed"})
            row["status"] = "STOPPED EARLY" if stopped else "FAILED"
    tags = {"minimind.sweep.trials": str(len(out.trials)),
            "minimind.sweep.stopped_early": str(sum(r["status"] == "STOPPED EARLY" for r in out.trials))}
    metrics, texts = {}, {"trials.json": json.dumps(out.trials, indent=1, default=str)}
    if out.best is not None:
        b = out.best
        tags.update({"best.trial_id": b["trial_id"], "best.run_id": str(b.get("mlflow_run_id")),
                     "best.run_name": f"{sweep.name}-{b['trial_id']}", "best.step": str(b["step"]),
                     "best.score": repr(b["score"]), **{f"best.params.{k}": json.dumps(v) for k, v in b["params"].items()}})
        metrics[f"best/{sweep.metric.replace('/', '_')}"] = b["score"]
        texts["best.yaml"] = Path(out.best_recipe).read_text() if out.best_recipe and not is_uri(out.best_recipe) else ""
    parents.record(uri, parent, tags=tags, metrics=metrics, texts=texts, timeout_s=timeout_s)
    end_run(uri, parent, "FINISHED" if out.best is not None else "FAILED", timeout_s=timeout_s)
