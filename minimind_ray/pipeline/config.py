"""A pipeline's YAML (``minimind-ray pipeline --config``): steps from data to a served model, in order. Read and
checked here before anything runs; pipeline/run.py runs it (docs/pipeline.md). A step is prepare, a training stage
(any of ``stages/``), eval, register or serve."""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from omegaconf import OmegaConf

from minimind_ray.config_checks import ConfigError, config_field as _f, need, read_yaml
from minimind_ray.evals.config import EvalTaskConfig, validate_task
from minimind_ray.stages import STAGE_NAMES, STAGES

OTHER_KINDS = ("prepare", "eval", "register", "serve")


@dataclass
class StepConfig:
    """One step: a training step is a normal recipe plus overrides; the others act on the data or a model."""

    name: str = _f("", "the step's name, unique in the pipeline: its training run is <pipeline>-<name>")
    kind: Optional[str] = _f(None, f"prepare | a training stage ({' | '.join(STAGE_NAMES)}) | eval | register | "
                                   f"serve; None = the name")
    recipe: Optional[str] = _f(None, "training steps and prepare: the recipe (a training YAML)")
    overrides: List[str] = _f([], "dotted overrides of the recipe, after the pipeline's own")
    init_from: str = _f("previous", "training steps: previous (the result of the last training step before this "
                                    "one, if any) | none (the recipe's own train.init_from) | <step name> | a path")
    model: str = _f("previous", "eval, register, serve: whose result (previous = the last training step's, or a "
                                "training step's name)")
    tasks: List[EvalTaskConfig] = _f([], "eval: the tasks (as in a recipe's eval.tasks, docs/evaluation.md)")
    registered_model: Optional[str] = _f(None, "register: the registry name; None = minimind-<pipeline name>")
    serve_args: List[str] = _f([], "serve: arguments of `minimind-ray serve` after WEIGHTS (e.g. [--port, '8000']); "
                                   "the step serves until Ctrl-C and is run again on every rerun")


@dataclass
class PipelineConfig:
    """Steps from data to a served model, each step's run a child of one MLflow run (docs/pipeline.md)."""

    name: str = _f("", "the pipeline's name: its parent MLflow run, its steps' runs <name>-<step>, its state "
                       "<checkpoint.storage_path>/<name>/pipeline.json; running it again resumes it")
    experiment: Optional[str] = _f(None, "the MLflow experiment of the parent and of every stage's run (children are "
                                         "nested in one experiment); None = minimind-<name>")
    overrides: List[str] = _f([], "dotted overrides for every training (and prepare) step, before each step's own")
    steps: List[StepConfig] = _f([], "the steps, in order")
    stages: List[StepConfig] = _f([], "the steps' name before it was steps (read as steps, with a notice)")


def kind_of(step: StepConfig) -> str:
    return step.kind or step.name


def is_training(step: StepConfig) -> bool:
    return kind_of(step) in STAGES


def load_pipeline(path: str) -> PipelineConfig:
    """The pipeline YAML, checked: names, kinds, recipes, references to earlier steps (errors name the field)."""
    schema = OmegaConf.structured(PipelineConfig)
    pipe: PipelineConfig = OmegaConf.to_object(OmegaConf.merge(schema, read_yaml(path, schema)))  # type: ignore
    need(bool(pipe.name) and all(c.isalnum() or c in "-_." for c in pipe.name), "name",
         f"{path}: a pipeline needs a name of letters, digits and - _ . (got {pipe.name!r})")
    if pipe.stages:  # a YAML written before the steps were called so
        need(not pipe.steps, "stages", f"{path}: give steps: or the older stages:, not both")
        print(f"[minimind-ray] notice: {path}: 'stages:' is now 'steps:' (read as steps)", file=sys.stderr)
        pipe.steps, pipe.stages = pipe.stages, []
    need(bool(pipe.steps), "steps", f"{path}: no steps")
    seen: List[str] = []
    trained: List[str] = []
    for i, st in enumerate(pipe.steps):
        where = f"steps[{i}]"
        need(bool(st.name) and all(c.isalnum() or c in "-_." for c in st.name) and st.name not in seen,
             f"{where}.name", f"{path}: each step needs a unique name of letters, digits and - _ . (got {st.name!r})")
        kind = kind_of(st)
        need(kind in STAGES or kind in OTHER_KINDS, f"{where}.kind",
             f"{path}: unknown kind {kind!r}; one of {', '.join([*STAGES, *OTHER_KINDS])}")
        if kind in STAGES or kind == "prepare":
            need(bool(st.recipe), f"{where}.recipe", f"{path}: step {st.name!r} ({kind}) needs a recipe")
        if kind in STAGES and st.init_from not in ("previous", "none") and "/" not in st.init_from \
                and not st.init_from.endswith(".pth"):
            need(st.init_from in trained, f"{where}.init_from",
                 f"{path}: {st.init_from!r} is not an earlier training step ({trained}) nor a path")
        if kind in ("eval", "register", "serve"):
            need(bool(trained), f"{where}.model", f"{path}: step {st.name!r} needs an earlier training step")
            need(st.model == "previous" or st.model in trained, f"{where}.model",
                 f"{path}: {st.model!r} is not an earlier training step ({trained})")
        if kind == "eval":
            need(bool(st.tasks), f"{where}.tasks", f"{path}: an eval step needs tasks")
            for j, t in enumerate(st.tasks):
                validate_task(t, f"{where}.tasks[{j}].")
        if kind == "serve" and i != len(pipe.steps) - 1:
            raise ConfigError(f"{where}.kind: {path}: serve runs until stopped, so it must be the last step")
        seen.append(st.name)
        if kind in STAGES:
            trained.append(st.name)
    return pipe


def step_digest(step: StepConfig, pipe: PipelineConfig, cli_overrides: List[str], upstream: str = "") -> str:
    """What a finished step was run with, chained to the steps before it (``upstream``: the previous step's
    digest): a step recorded done under another digest, or after an earlier step that changed, runs again. (Its key
    is "stage", as before the steps were called so: a pipeline finished then is still finished.)"""
    return hashlib.sha256(json.dumps({"stage": asdict(step), "pipeline_overrides": list(pipe.overrides),
                                      "cli": list(cli_overrides), "upstream": upstream},
                                     sort_keys=True, default=str).encode()).hexdigest()[:16]
