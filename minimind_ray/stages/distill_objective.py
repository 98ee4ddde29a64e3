"""Distillation's objective (MiniMind's train_distillation.py): cross-entropy and the KL to a frozen teacher."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minimind_ray.model.config import ModelConfig
from minimind_ray.model.presets import preset_values
from minimind_ray.stages.objective import Objective, load_frozen


class DistillObjective(Objective):
    """alpha * CE + (1 - alpha) * T^2 * KL(teacher || student) on target tokens (MiniMind's defaults 0.5, 1.5)."""

    def setup(self, model: nn.Module, device: torch.device) -> None:
        d = self.cfg.train.distill
        tcfg = ModelConfig(**preset_values(d.teacher_preset)) if d.teacher_preset else self.cfg.model
        self.teacher = load_frozen(tcfg, d.teacher_weights, device, "train.distill.teacher_weights")

    def loss_sum(self, model, batch):
        d = self.cfg.train.distill
        out = model(batch["input_ids"])
        with torch.no_grad():
            t_logits = self.teacher(batch["input_ids"]).logits
        targets = batch["targets"]
        s, t = out.logits.float(), t_logits.float()  # (B, T, V)
        ce = F.cross_entropy(s.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
        T = d.temperature
        kl_tok = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True,
                          reduction="none").sum(-1)  # (B, T); masked by multiplication: no host sync
        kl = (kl_tok * targets.ne(-100)).sum() * (T * T)
        loss = d.alpha * ce + (1.0 - d.alpha) * kl
        return loss, out.aux_loss, {"ce": ce.detach(), "kl": kl.detach()}
