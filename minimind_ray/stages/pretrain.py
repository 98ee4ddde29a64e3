"""Pretraining (MiniMind's train_pretrain.py): next-token cross-entropy on raw text."""
from __future__ import annotations

from minimind_ray.stages.stage import Stage


def objective(cfg):
    from minimind_ray.stages.objective import Objective  # lazy: torch, when a run builds its state

    return Objective(cfg)


STAGE = Stage("pretrain", "next-token pretraining on raw text", formats=("pretrain",), objective=objective,
              export_prefix="pretrain", fsdp_refusal=None, cross_entropy=True)
