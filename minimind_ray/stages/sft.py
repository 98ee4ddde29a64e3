"""Supervised fine-tuning (MiniMind's train_full_sft.py): the cross-entropy of pretraining, on the assistant's turns
of conversations only (the sft data format puts the targets there)."""
from __future__ import annotations

from minimind_ray.stages.stage import Stage


def objective(cfg):
    from minimind_ray.stages.objective import Objective  # lazy: torch, when a run builds its state

    return Objective(cfg)


STAGE = Stage("sft", "full supervised fine-tuning on conversations", formats=("sft",), objective=objective,
              export_prefix="full_sft", fsdp_refusal=None, cross_entropy=True)
