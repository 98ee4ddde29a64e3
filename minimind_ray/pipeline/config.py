"""A pipeline's YAML (``minimind-ray pipeline --config``): stages from data to a served model, in order. Read and
checked here before anything runs; pipeline/run.py runs it (docs/pipeline.md)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from omegaconf import OmegaConf

from minimind_ray.config_checks import ConfigError, config_field as _f, need, read_yaml
from minimind_ray.evals.config import EvalTaskConfig, validate_task
from minimind_ray.stages import STAGES

OTHER_KINDS = ("prepare", "eval", "register", "serve")


@dataclass
class StageConfig:
    """One stage: a training stage is a normal recipe plus overrides; the others act on the data or a model."""

    name: str = _f("", "the stage's name, unique in the pipeline: its training run is <pipeline>-<name>")
    kind: Optional[str] = _f(None, "prepare | a training stage (pretrain, sft, lora, dpo, distill, grpo, ...) | eval | "
                                   "register | serve; None = the name")
    recipe: Optional[str] = _f(None, "training stages and prepare: the recipe (a training YAML)")
    overrides: List[str] = _f([], "dotted overrides of the recipe, after the pipeline's own")
    init_from: str = _f("previous", "training stages: previous (the result of the last training stage before this "
                                    "one, if any) | none (the recipe's own train.init_from) | <stage name> | a path")
    model: str = _f("previous", "eval, register, serve: whose result (previous = the last training stage's, or a "
                                "training stage's name)")
    tasks: List[EvalTaskConfig] = _f([], "eval: the tasks (as in a recipe's eval.tasks, docs/evaluation.md)")
    registered_model: Optional[str] = _f(None, "register: the registry name; None = minimind-<pipeline name>")
    serve_args: List[str] = _f([], "serve: arguments of `minimind-ray serve` after WEIGHTS (e.g. [--port, '8000']); "
                                   "the stage serves until Ctrl-C and is run again on every rerun")


@dataclass
class PipelineConfig:
    """Stages from data to a served model, each stage's run a child of one MLflow run (docs/pipeline.md)."""

    name: str = _f("", "the pipeline's name: its parent MLflow run, its stages' runs <name>-<stage>, its state "
                       "<checkpoint.storage_path>/<name>/pipeline.json; running it again resumes it")
    experiment: Optional[str] = _f(None, "the MLflow experiment of the parent and of every stage's run (children are "
                                         "nested in one experiment); None = minimind-<name>")
    overrides: List[str] = _f([], "dotted overrides for every training (and prepare) stage, before each stage's own")
    stages: List[StageConfig] = _f([], "the stages, in order")


def kind_of(stage: StageConfig) -> str:
    return stage.kind or stage.name


def is_training(stage: StageConfig) -> bool:
    return kind_of(stage) in STAGES


def load_pipeline(path: str) -> PipelineConfig:
    """The pipeline YAML, checked: names, kinds, recipes, references to earlier stages (errors name the field)."""
    schema = OmegaConf.structured(PipelineConfig)
    pipe: PipelineConfig = OmegaConf.to_object(OmegaConf.merge(schema, read_yaml(path, schema)))  # type: ignore
    need(bool(pipe.name) and all(c.isalnum() or c in "-_." for c in pipe.name), "name",
         f"{path}: a pipeline needs a name of letters, digits and - _ . (got {pipe.name!r})")
    need(bool(pipe.stages), "stages", f"{path}: no stages")
    seen: List[str] = []
    trained: List[str] = []
    for i, st in enumerate(pipe.stages):
        where = f"stages[{i}]"
        need(bool(st.name) and all(c.isalnum() or c in "-_." for c in st.name) and st.name not in seen,
             f"{where}.name", f"{path}: each stage needs a unique name of letters, digits and - _ . (got {st.name!r})")
        kind = kind_of(st)
        need(kind in STAGES or kind in OTHER_KINDS, f"{where}.kind",
             f"{path}: unknown kind {kind!r}; one of {', '.join([*STAGES, *OTHER_KINDS])}")
        if kind in STAGES or kind == "prepare":
            need(bool(st.recipe), f"{where}.recipe", f"{path}: stage {st.name!r} ({kind}) needs a recipe")
        if kind in STAGES and st.init_from not in ("previous", "none") and "/" not in st.init_from \
                and not st.init_from.endswith(".pth"):
            need(st.init_from in trained, f"{where}.init_from",
                 f"{path}: {st.init_from!r} is not an earlier training stage ({trained}) nor a path")
        if kind in ("eval", "register", "serve"):
            need(bool(trained), f"{where}.model", f"{path}: stage {st.name!r} needs an earlier training stage")
            need(st.model == "previous" or st.model in trained, f"{where}.model",
                 f"{path}: {st.model!r} is not an earlier training stage ({trained})")
        if kind == "eval":
            need(bool(st.tasks), f"{where}.tasks", f"{path}: an eval stage needs tasks")
            for j, t in enumerate(st.tasks):
                validate_task(t, f"{where}.tasks[{j}].")
        if kind == "serve" and i != len(pipe.stages) - 1:
            raise ConfigError(f"{where}.kind: {path}: serve runs until stopped, so it must be the last stage")
        seen.append(st.name)
        if kind in STAGES:
            trained.append(st.name)
    return pipe


def stage_digest(stage: StageConfig, pipe: PipelineConfig, cli_overrides: List[str], upstream: str = "") -> str:
    """What a finished stage was run with, chained to the stages before it (``upstream``: the previous stage's
    digest): a stage recorded done under another digest, or after an earlier stage that changed, runs again."""
    return hashlib.sha256(json.dumps({"stage": asdict(stage), "pipeline_overrides": list(pipe.overrides),
                                      "cli": list(cli_overrides), "upstream": upstream},
                                     sort_keys=True, default=str).encode()).hexdigest()[:16]
