"""The one registry of training stages (docs/architecture.md, "Where to add things").

Each stage is one module, ``stages/<name>.py``, whose :class:`~minimind_ray.stages.stage.Stage` record holds all that
differs between stages: its config section (``train.<name>``) and checks, its data formats, its objective (in
``stages/<name>_objective.py``, or the cross-entropy of ``stages/objective.py``), its memory terms, the user's
plug-ins it names, what it places beside the workers, the weights it starts from, its export names, its metric group.
Nothing outside this room compares stage names: it asks the record. Adding a stage is its module(s) and one name in
``STAGE_MODULES``. Light: the CLI and the config read it; no torch until an objective is built.
"""
from __future__ import annotations

import importlib
from typing import Dict, Tuple

from minimind_ray.stages.stage import MemoryTerms, Stage

STAGE_MODULES = ("pretrain", "sft", "lora", "dpo", "distill", "grpo", "ppo", "agent", "simpo", "kto", "rloo")

STAGES: Dict[str, Stage] = {}
for _module in STAGE_MODULES:
    _stage = importlib.import_module(f"{__name__}.{_module}").STAGE
    STAGES[_stage.name] = _stage
STAGE_NAMES: Tuple[str, ...] = tuple(STAGES)

__all__ = ["MemoryTerms", "STAGES", "STAGE_MODULES", "STAGE_NAMES", "Stage", "get_stage"]


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        raise KeyError(f"unknown stage {name!r}; one of {STAGE_NAMES}")
    return STAGES[name]


def build_objective(cfg):
    """The objective of ``cfg.train.stage`` (stages/objective.py), set up by the engine's state."""
    return get_stage(cfg.train.stage).objective(cfg)
