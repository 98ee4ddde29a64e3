"""Direct preference optimisation (MiniMind's train_dpo.py) on chosen/rejected pairs, against a frozen reference
(``train.dpo``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minimind_ray.config_checks import config_field as _f
from minimind_ray.stages.stage import MemoryTerms, Stage


@dataclass
class DPOConfig:
    """Direct preference optimisation (stage 'dpo')."""

    beta: float = _f(0.1, "DPO temperature", gt=0)
    reference: Optional[str] = _f(None, "reference weights (.pth/checkpoint); None = a frozen copy of the initial weights")


def objective(cfg):
    from minimind_ray.stages.dpo_objective import DPOObjective  # lazy: torch, when a run builds its state

    return DPOObjective(cfg)


def memory(cfg, policy, count) -> MemoryTerms:
    return MemoryTerms(sequences=2, frozen_models=1.0)  # chosen and rejected in one forward; the reference


STAGE = Stage("dpo", "direct preference optimisation on chosen/rejected pairs", formats=("dpo",), objective=objective,
              export_prefix="dpo", section=DPOConfig, memory=memory,
              parent_fields=(("reference", "reference"),),
              headline=("reward_margin", "reward_accuracy"),
              fsdp_refusal="its frozen reference would stay a whole copy on every worker, unsharded")
