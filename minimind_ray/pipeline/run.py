"""``minimind-ray pipeline``: steps from data to a served model as one job that a rerun resumes (docs/pipeline.md).

A pipeline's steps are prepare, the training stages (any of ``stages/``), eval, register and serve; "step" is the
pipeline's word, "stage" the training one's.

    the pipeline's parent MLflow run (created, or reopened by the same command)
    for each step, in order:
        finished before (recorded in <storage>/<name>/pipeline.json with the same settings)  -> skipped
        prepare             the Ray Data job of its recipe's data; a child run with the manifest and its hash
        pretrain/sft/...    raytrain/driver.py:run(the step's run resolved once, config.py:resolve_run: recipe +
                            overrides, name=<pipeline>-<step>, resume=auto, train.init_from = the previous training
                            step's last checkpoint): a child run, tagged with its data's manifest hash and the run it
                            started from
        eval                evals/run.py:evaluate_task on a step's checkpoint: a child run with eval/<task>/*, the
                            scores also logged on the evaluated run
        register            the step's model in the MLflow registry, the version tagged with its lineage
        serve               minimind-ray serve on that model, until stopped
    the state is written after each step, atomically: a killed pipeline run again skips the finished steps and
    the unfinished training step resumes from its newest checkpoint (the run's own resume rule)
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from minimind_ray.config import ConfigError, RunConfig, RunSpec, load_config, refuse_other_stages_field, resolve
from minimind_ray.fsio import filesystem, is_uri, join, redact, write_text_atomic
from minimind_ray.pipeline.config import PipelineConfig, StepConfig, is_training, kind_of, step_digest
from minimind_ray.raytrain.driver import run
from minimind_ray.raytrain.resume import RunFinished, storage_root
from minimind_ray.raytrain.session import connect_ray
from minimind_ray.raytrain.lineage import TAG_DATA, TAG_MANIFEST, manifest_sha256
from minimind_ray.serve import serve_verb
from minimind_ray.tracking.parents import child_tags, end_run, record, register_version, start_parent
from minimind_ray.tracking.runs import resolve_tracking_uri

STATE = "pipeline.json"
# the MLflow tags keep the names they had when a pipeline's steps were called stages: older runs search the same
TAG_PIPELINE, TAG_STEP = "minimind.pipeline", "minimind.pipeline.stage"


@dataclass
class PipelineResult:
    name: str
    state_path: str
    parent_run_id: Optional[str]
    tracking_uri: Optional[str]
    steps: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    wall_s: float = 0.0


class _Context:
    """What the steps share: the pipeline, the command line's overrides, MLflow, the results so far."""

    def __init__(self, pipe: PipelineConfig, cli: List[str], storage: str, uri: Optional[str], experiment: str):
        self.pipe, self.cli, self.storage, self.uri, self.experiment = pipe, cli, storage, uri, experiment
        self.parent: Optional[str] = None
        self.results: Dict[str, Dict[str, Any]] = {}
        self.last_trained: Optional[str] = None
        self.resolved: Dict[str, RunSpec] = {}  # a training step's run, resolved when the step before it ended

    def recipe(self, step: StepConfig, extra: List[str], stage: Optional[str] = None, check: bool = True) -> RunConfig:
        """The step's recipe with the pipeline's overrides, the pipeline's experiment, then the step's own; ``stage``:
        a training step's; ``check=False``: composed, for config.py:resolve to validate."""
        exp = [f"tracking.experiment={self.experiment}"]
        return load_config(step.recipe, [*self.pipe.overrides, *exp, *extra, *step.overrides, *self.cli], check=check,
                           stage=stage)

    def model(self, step: StepConfig) -> Dict[str, Any]:
        return self.results[self.last_trained if step.model == "previous" else step.model]

    def tags(self, step: StepConfig) -> Dict[str, str]:
        return child_tags(self.parent, "pipeline", **{TAG_PIPELINE: self.pipe.name, TAG_STEP: step.name})


def _read_state(path: str) -> dict:
    try:
        fs, p = filesystem(path)
        with fs.open_input_stream(p) as f:
            state = json.loads(f.read())
    except FileNotFoundError:
        return {"steps": {}}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: the pipeline's state cannot be read ({e}); move it away to start anew") from None
    if "stages" in state and "steps" not in state:  # written before the steps were called so: it resumes
        state["steps"] = state.pop("stages")
    return state


def _first_config(pipe: PipelineConfig, cli: List[str]) -> RunConfig:
    """The first recipe's config with the pipeline's overrides: where runs are stored, where MLflow is."""
    first = next(s for s in pipe.steps if s.recipe)
    return load_config(first.recipe, [*pipe.overrides, *first.overrides, *cli])


def run_pipeline(pipe: PipelineConfig, cli: Optional[List[str]] = None, text: str = "") -> PipelineResult:
    t0 = time.monotonic()
    cli = list(cli or [])
    for step in pipe.steps:  # a field another stage reads, set on a training step: refused before any step runs
        if is_training(step):
            cfg = load_config(step.recipe, [*pipe.overrides, *step.overrides, *cli], check=False, stage=kind_of(step))
            refuse_other_stages_field(cfg, f"pipeline step {step.name!r}: ")
    first = _first_config(pipe, cli)
    storage = storage_root(first)
    state_path = join(join(storage, pipe.name), STATE)
    state = _read_state(state_path)
    experiment = pipe.experiment or f"minimind-{pipe.name}"
    uri = resolve_tracking_uri(first.tracking) if first.tracking.enabled else None
    ctx = _Context(pipe, cli, storage, uri, experiment)
    if uri:
        try:
            ctx.parent = start_parent(uri, experiment, "pipeline", pipe.name, storage,
                                      {"steps": " -> ".join(s.name for s in pipe.steps),
                                       "overrides": " ".join([*pipe.overrides, *cli])}, text,
                                      timeout_s=first.tracking.timeout_s)
        except Exception as e:  # a down tracking server must not stop the pipeline
            print(redact(f"[{pipe.name}] WARNING: MLflow at {uri} unavailable ({type(e).__name__}: {e}); untracked"),
                  flush=True)
    out = PipelineResult(name=pipe.name, state_path=state_path, parent_run_id=ctx.parent, tracking_uri=uri)
    upstream = ""
    try:
        for step in pipe.steps:
            digest = upstream = step_digest(step, pipe, cli, upstream)
            done = state["steps"].get(step.name)
            if done and done.get("digest") == digest and kind_of(step) != "serve":
                print(f"[{pipe.name}] step {step.name}: finished before, skipped", flush=True)
                out.skipped.append(step.name)
                result = done
            else:
                if done:
                    print(f"[{pipe.name}] step {step.name}: its settings changed since it finished; running it "
                          f"again", flush=True)
                print(f"[{pipe.name}] step {step.name} ({kind_of(step)})", flush=True)
                result = {**_run_step(ctx, step), "digest": digest, "kind": kind_of(step), "done_at": time.time()}
                if kind_of(step) != "serve":
                    state["steps"][step.name] = result
                    write_text_atomic(state_path, json.dumps(state, indent=1, default=str))
            ctx.results[step.name] = result
            if is_training(step):
                ctx.last_trained = step.name
                if step.name not in out.skipped:
                    check_the_next_training_step(ctx, step)
    except BaseException as e:
        if ctx.parent:
            end_run(uri, ctx.parent, "FAILED", tags={"error": f"step {step.name}: {type(e).__name__}: {e}"[:4000]})
        raise
    out.steps = ctx.results
    if ctx.parent:
        end_run(uri, ctx.parent, "FINISHED", tags=_summary_tags(ctx))
    out.wall_s = time.monotonic() - t0
    return out


def _summary_tags(ctx: _Context) -> Dict[str, str]:
    tags = {}
    for name, r in ctx.results.items():
        if r.get("mlflow_run_id"):
            tags[f"stage.{name}.run_id"] = r["mlflow_run_id"]  # (the tag's first name, as TAG_STEP)
        if r.get("registered_model"):
            tags["registered_model"] = f"models:/{r['registered_model']}/{r['model_version']}"
    return tags


def _run_step(ctx: _Context, step: StepConfig) -> Dict[str, Any]:
    kind = kind_of(step)
    if is_training(step):
        return _train(ctx, step)
    return {"prepare": _prepare, "eval": _eval, "register": _register, "serve": _serve}[kind](ctx, step)


def _train_run(ctx: _Context, step: StepConfig):
    """(the training step's run, resolved once: config.py:resolve; the weights it starts from): its recipe, named for
    the pipeline, from the step its init_from names (``previous``: the last training step's result)."""
    extra = [f"name={ctx.pipe.name}-{step.name}", "resume=auto"]
    source = None
    if step.init_from == "previous":
        source = ctx.results[ctx.last_trained]["checkpoint_dir"] if ctx.last_trained else None
    elif step.init_from != "none":
        source = ctx.results[step.init_from]["checkpoint_dir"] if step.init_from in ctx.results else step.init_from
    if source:
        extra.append(f"train.init_from={source}")
    if step.name not in ctx.resolved:
        ctx.resolved[step.name] = resolve(ctx.recipe(step, extra, stage=kind_of(step), check=False))
    return ctx.resolved[step.name], source


def check_the_next_training_step(ctx: _Context, done: StepConfig) -> None:
    """When a training step ends, the next training step that starts from it is resolved (config.py:resolve: the
    architecture its recipe asks for checked against its weights), before the steps between them run; it runs as
    resolved here."""
    later = ctx.pipe.steps[ctx.pipe.steps.index(done) + 1:]
    nxt = next((s for s in later if is_training(s)), None)
    if nxt is None or nxt.init_from not in ("previous", done.name):
        return
    try:
        _train_run(ctx, nxt)
    except ConfigError as e:
        raise ConfigError(f"step {nxt.name} (starts from step {done.name}): {e}") from None


def _train(ctx: _Context, step: StepConfig) -> Dict[str, Any]:
    from minimind_ray.store.checkpoint import newest_complete  # lazy: torch, only when this runs

    spec, source = _train_run(ctx, step)
    cfg = spec.cfg
    try:
        res = run(spec, tags=ctx.tags(step))
    except RunFinished:  # trained to its end before, but killed before the pipeline wrote that down

        run_dir = join(storage_root(cfg), cfg.name)
        latest = newest_complete(run_dir)
        print(f"[{ctx.pipe.name}] step {step.name}: its run {cfg.name} had finished; using {latest.location} "
              f"(its exports and registered version may be missing: the driver was stopped before writing them)",
              flush=True)
        return {"run_name": cfg.name, "run_dir": run_dir, "checkpoint_dir": latest.location,
                "mlflow_run_id": latest.meta().mlflow_run_id, "exports": {}, "metrics": {}, "init_from": source}
    return {"run_name": res.name, "run_dir": res.run_dir, "checkpoint_dir": res.checkpoint_dir,
            "mlflow_run_id": res.mlflow_run_id, "exports": res.exports, "init_from": source,
            "metrics": {k: v for k, v in res.metrics.items() if isinstance(v, (int, float))},
            "model_version": res.metrics.get("model_version")}


def _step_run(ctx: _Context, step: StepConfig, tags: Dict[str, str]) -> Optional[str]:
    """The MLflow run of a step that trains nothing (prepare, eval): a child, reopened on a rerun."""
    if not (ctx.uri and ctx.parent):
        return None

    return start_parent(ctx.uri, ctx.experiment, f"pipeline-{kind_of(step)}", f"{ctx.pipe.name}-{step.name}",
                        ctx.storage, {}, "", tags={**ctx.tags(step), **tags})


def _prepare(ctx: _Context, step: StepConfig) -> Dict[str, Any]:
    from minimind_ray.data.prepare import ensure_prepared  # lazy: numpy, only when this runs
    from minimind_ray.tokenizer import resolve_tokenizer  # lazy: tokenizers, only when this runs

    cfg = ctx.recipe(step, [])
    tok = resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, cfg.model.generation)
    connect_ray(cfg)
    prepared = ensure_prepared(cfg.data, tok)
    sha = manifest_sha256(prepared)
    run_id = _step_run(ctx, step, {TAG_DATA: redact(prepared), TAG_MANIFEST: sha or ""})
    if run_id:
        files = {} if is_uri(prepared) else {os.path.join(prepared, "manifest.json"): "data"}
        record(ctx.uri, run_id, files=files)
        end_run(ctx.uri, run_id, "FINISHED")
    print(f"[{ctx.pipe.name}] prepared {redact(prepared)} (manifest sha256 {sha})", flush=True)
    return {"prepared_dir": prepared, "manifest_sha256": sha, "mlflow_run_id": run_id}


def _eval(ctx: _Context, step: StepConfig) -> Dict[str, Any]:
    from minimind_ray.evals.run import evaluate_task, metric_items, result_notes  # lazy: numpy, torch

    model = ctx.model(step)
    scores: Dict[str, float] = {}
    notes: Dict[str, str] = {}  # subjects skipped or short of shots, as tags of the step's run
    cache = ctx.recipe(next(s for s in ctx.pipe.steps if s.recipe), []).data.cache_dir
    for task in step.tasks:
        res = evaluate_task(model["checkpoint_dir"], task, cache_dir=cache)
        scores.update(metric_items(res))
        notes.update(result_notes(res))
        said = "".join(f"; {k.rsplit('/', 1)[1].replace('_', ' ')}: {v}" for k, v in result_notes(res).items())
        print(f"[{ctx.pipe.name}] {res['task']}: " + ", ".join(f"{k} {v:.3f}" for k, v in metric_items(res).items())
              + said, flush=True)
    run_id = _step_run(ctx, step, {"minimind.evaluated.run_id": model.get("mlflow_run_id") or "",
                                     "minimind.evaluated.checkpoint": redact(model["checkpoint_dir"])})
    if run_id:
        record(ctx.uri, run_id, metrics=scores, tags=notes)
        end_run(ctx.uri, run_id, "FINISHED")
        if model.get("mlflow_run_id"):  # beside the evaluated run's own curves, at its last step
            record(ctx.uri, model["mlflow_run_id"], metrics=scores, step=int(model.get("metrics", {}).get("step", 0)))
    return {"scores": scores, "mlflow_run_id": run_id, "model": model.get("run_name")}


def _register(ctx: _Context, step: StepConfig) -> Dict[str, Any]:
    model = ctx.model(step)
    name = step.registered_model or f"minimind-{ctx.pipe.name}"
    if not (ctx.uri and model.get("mlflow_run_id")):
        print(f"[{ctx.pipe.name}] step {step.name}: nothing to register (untracked)", flush=True)
        return {}
    version = register_version(ctx.uri, name, model["mlflow_run_id"], {
        TAG_PIPELINE: ctx.pipe.name, "minimind.pipeline.run_id": ctx.parent or "", TAG_STEP: model["run_name"]})
    print(f"[{ctx.pipe.name}] registered models:/{name}/{version} (run {model['mlflow_run_id']})", flush=True)
    return {"registered_model": name, "model_version": version, "mlflow_run_id": model["mlflow_run_id"],
            "model": model["run_name"]}


def _serve(ctx: _Context, step: StepConfig) -> Dict[str, Any]:
    import argparse

    model = ctx.model(step)
    p = argparse.ArgumentParser(prog="serve step")
    serve_verb.add_arguments(p)  # the serve verb's own flags
    serve_verb.run(p.parse_args([model["checkpoint_dir"], *step.serve_args]))
    return {"served": model["checkpoint_dir"]}


def print_pipeline(out: PipelineResult) -> None:
    print(f"\n==== pipeline {out.name}: {len(out.steps)} steps ({len(out.skipped)} finished before), "
          f"{out.wall_s:.0f}s ====")
    for name, r in out.steps.items():
        what = r.get("checkpoint_dir") or r.get("prepared_dir") or r.get("scores") or \
            (f"models:/{r['registered_model']}/{r['model_version']}" if r.get("registered_model") else "")
        print(f"{name:<12} {r.get('kind', ''):<9} {redact(str(what))}  MLflow {r.get('mlflow_run_id') or '-'}")
    print(f"state: {redact(out.state_path)}")
    if out.parent_run_id:
        print(redact(f"MLflow parent run: {out.parent_run_id}  (tracking URI {out.tracking_uri}; make ui)"))
