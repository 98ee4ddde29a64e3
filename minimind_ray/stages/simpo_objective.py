"""SimPO's objective (stages/simpo.py): the reference-free preference loss on length-normalised log-likelihoods."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minimind_ray.stages.objective import Batch, Objective, token_log_probs


class SimPOObjective(Objective):
    """-logsigmoid(beta * (mean logp(chosen) - mean logp(rejected)) - gamma), summed over the micro-batch's pairs.

    Chosen and rejected go through one forward (one backward graph for DDP), as in DPO; there is no reference."""

    def weight(self, batch: Batch) -> int:
        return int(batch["chosen_input_ids"].shape[0])  # pairs

    def tokens(self, batch: Batch) -> int:
        return int(batch["chosen_input_ids"].numel() + batch["rejected_input_ids"].numel())

    def loss_sum(self, model, batch):
        s = self.cfg.train.simpo
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])  # (2B, T)
        tgt = torch.cat([batch["chosen_targets"], batch["rejected_targets"]])
        b = batch["chosen_input_ids"].shape[0]
        out = model(ids)
        logp, mask = token_log_probs(out.logits, tgt)  # (2B, T) each
        mean_logp = logp.sum(-1) / mask.sum(-1).clamp_min(1.0)  # (2B,): the length-normalised log-likelihood
        chosen_reward, rejected_reward = s.beta * mean_logp[:b], s.beta * mean_logp[b:]  # (B,) each
        loss = -F.logsigmoid(chosen_reward - rejected_reward - s.gamma).sum()
        chosen_reward, rejected_reward = chosen_reward.detach(), rejected_reward.detach()
        extra = {
            "reward_margin": (chosen_reward - rejected_reward).sum(),
            "reward_accuracy": (chosen_reward > rejected_reward).float().sum(),
            "chosen_reward": chosen_reward.sum(),
            "rejected_reward": rejected_reward.sum(),
        }
        return loss, out.aux_loss, extra
