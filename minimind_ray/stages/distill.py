"""Knowledge distillation (MiniMind's train_distillation.py) from a frozen teacher (``train.distill``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minimind_ray.config_checks import config_field as _f, need
from minimind_ray.model.config import ModelConfig
from minimind_ray.model.presets import preset_values
from minimind_ray.stages.stage import MemoryTerms, Stage


@dataclass
class DistillConfig:
    """Knowledge distillation (stage 'distill')."""

    teacher_preset: Optional[str] = _f(None, "teacher architecture preset; None = same as the student")
    teacher_weights: Optional[str] = _f(None, "teacher weights (.pth or checkpoint directory)")
    alpha: float = _f(0.5, "weight of the hard-label CE; (1-alpha) goes to the KL term", ge=0, le=1)
    temperature: float = _f(1.5, "softmax temperature of the KL term", gt=0)


def objective(cfg):
    from minimind_ray.stages.distill_objective import DistillObjective  # lazy: torch, when a run builds its state

    return DistillObjective(cfg)


def validate(cfg) -> None:
    need(cfg.train.distill.teacher_weights is not None, "train.distill.teacher_weights", "distillation needs teacher weights")


def memory(cfg, policy, count) -> MemoryTerms:
    """The teacher, at its preset's size (the student's when none is given); its logits and the KL's log-softmaxes."""
    teacher = 1.0
    if cfg.train.distill.teacher_preset:
        teacher = count(ModelConfig(**preset_values(cfg.train.distill.teacher_preset))) / count(policy)
    return MemoryTerms(frozen_models=teacher, extra_logit_bytes=16)


STAGE = Stage("distill", "distillation from a frozen teacher", formats=("sft", "pretrain"), objective=objective,
              export_prefix="full_dist", section=DistillConfig, validate=validate, memory=memory,
              parent_fields=(("teacher", "teacher_weights"),), own_architecture=("teacher",),
              headline=("kl",),
              fsdp_refusal="its frozen teacher would stay a whole copy on every worker, unsharded")
