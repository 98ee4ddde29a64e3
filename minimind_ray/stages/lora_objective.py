"""LoRA's objective: the cross-entropy, through adapters on a frozen base (model/lora.py)."""
from __future__ import annotations

import torch
from torch import nn

from minimind_ray.model.config import holds_lora
from minimind_ray.model.lora import apply_lora, freeze_base
from minimind_ray.stages.objective import Objective


class LoRAObjective(Objective):
    """Adapters on the configured projections; base weights frozen.

    Frozen parameters have requires_grad=False before DDP wraps the model, so DDP
    never waits for their gradients (no unused-parameter hang)."""

    def setup(self, model: nn.Module, device: torch.device) -> None:
        if not holds_lora(model.state_dict()):
            apply_lora(model, self.cfg.train.lora)
        freeze_base(model)
