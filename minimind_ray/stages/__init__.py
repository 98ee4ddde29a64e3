"""The one registry of training stages (docs/architecture.md, "Where to add things").

Each stage is one module, ``stages/<name>.py``, whose :class:`~minimind_ray.stages.stage.Stage` record holds all that
differs between stages: its config section (``train.<name>``) and checks, its data formats, its objective (in
``stages/<name>_objective.py``, the cross-entropy of ``stages/objective.py``, or an RL stage's plan in its own
module), its memory terms, the user's
plug-ins it names, what it places beside the workers, the weights it starts from, its export names, its metric group.
Nothing outside this room compares stage names: it asks the record. Adding a stage is its module(s) and one name in
``STAGE_MODULES``. Light: the CLI and the config read it; no torch until an objective is built.
"""
from __future__ import annotations

import copyreg
import dataclasses
import importlib
from typing import Dict, Optional, Tuple

from minimind_ray.config_checks import flatten
from minimind_ray.stages.stage import MemoryTerms, Stage

STAGE_MODULES = ("pretrain", "sft", "lora", "dpo", "distill", "grpo", "ppo", "agent", "simpo", "kto", "rloo")

STAGES: Dict[str, Stage] = {}
for _module in STAGE_MODULES:
    _stage = importlib.import_module(f"{__name__}.{_module}").STAGE
    STAGES[_stage.name] = _stage
STAGE_NAMES: Tuple[str, ...] = tuple(STAGES)


def _sections() -> Dict[str, Tuple[type, Tuple[str, ...]]]:
    out: Dict[str, Tuple[type, Tuple[str, ...]]] = {}
    for s in STAGES.values():
        for name, cls in ([(s.name, s.section)] if s.section else []) + [(x.name, x.cls) for x in s.shares]:
            known, readers = out.get(name, (cls, ()))
            assert known is cls, f"train.{name}: two records bring two sections of that name"
            out[name] = (cls, readers + (s.name,))
    for s in STAGES.values():  # another stage's section it reads
        for name in s.reads:
            out[name] = (out[name][0], out[name][1] + (s.name,))
    return out


# {name: (its dataclass, the stages that read it)} for every train.<name> section a record brings, in the registry's
# order: the engine's config composes TrainConfig of them
TRAIN_SECTIONS: Dict[str, Tuple[type, Tuple[str, ...]]] = _sections()

__all__ = ["MemoryTerms", "STAGES", "STAGE_MODULES", "STAGE_NAMES", "Stage", "TRAIN_SECTIONS", "get_stage",
           "other_stages_field", "other_sections"]


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        raise KeyError(f"unknown stage {name!r}; one of {STAGE_NAMES}")
    return STAGES[name]


# a record pickles as its name and unpickles as the registry's record (Ray ships a run's record to every worker in its
# WorkerSpec): one record per stage in every process, and no stage's callables pickled by value
copyreg.pickle(Stage, lambda stage: (get_stage, (stage.name,)))


def build_objective(cfg):
    """The objective of ``cfg.train.stage`` (stages/objective.py), set up by the engine's state."""
    return get_stage(cfg.train.stage).objective(cfg)


def other_sections(stage: str) -> Tuple[str, ...]:
    """The ``train.<name>`` sections a run of ``stage`` does not read."""
    return tuple(name for name in TRAIN_SECTIONS if name not in get_stage(stage).section_names())


def other_stages_field(train) -> Optional[Tuple[str, str]]:
    """(the field, why it is refused) for the first field of a section the run's stage does not read that is set
    to other than its default (a TrainConfig ``train``), or None. A run given ``train.grpo.rewards`` on an rloo run
    would train on rloo's own rewards without a word."""
    stage = get_stage(train.stage)
    for name in other_sections(stage.name):
        section = getattr(train, name)
        defaults = flatten(dataclasses.asdict(type(section)()))
        for key, value in flatten(dataclasses.asdict(section)).items():
            if key in defaults and defaults[key] == value:
                continue
            readers = TRAIN_SECTIONS[name][1]
            whose = f"the {name} stage's section" if name in STAGES else f"the section of {', '.join(readers)}"
            mine = [f"train.{n}.{key}" for n in stage.section_names()
                    if key in flatten(dataclasses.asdict(getattr(train, n)))]
            reads = ", ".join("train." + n for n in stage.section_names()) or "no stage's section"
            hint = f"did you mean {mine[0]}?" if mine else f"the {stage.name} stage reads {reads}: leave it out"
            return f"train.{name}.{key}", f"a field of {whose}, which the {stage.name} stage does not read; {hint}"
    return None
