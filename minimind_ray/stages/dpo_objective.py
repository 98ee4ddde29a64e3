"""DPO's objective (MiniMind's train_dpo.py): the preference loss against a frozen reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minimind_ray.stages.objective import Batch, Objective, frozen_copy, load_frozen, token_log_probs


class DPOObjective(Objective):
    """-logsigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r))), log-probs summed over assistant tokens.

    The reference model is a frozen copy held outside the trained module: it is
    never handed to the optimizer, DDP or the checkpoint."""

    def setup(self, model: nn.Module, device: torch.device) -> None:
        ref = self.cfg.train.dpo.reference
        self.reference = (load_frozen(self.cfg.model, ref, device, "train.dpo.reference") if ref
                          else frozen_copy(model).to(device))

    def weight(self, batch: Batch) -> int:
        return int(batch["chosen_input_ids"].shape[0])

    def tokens(self, batch: Batch) -> int:
        return int(batch["chosen_input_ids"].numel() + batch["rejected_input_ids"].numel())

    @staticmethod
    def _seq_logp(model, ids, targets):
        out = model(ids)
        logp, _ = token_log_probs(out.logits, targets)
        return logp.sum(-1), out.aux_loss  # (B,)

    def loss_sum(self, model, batch):
        # one forward over chosen+rejected keeps DDP to a single backward graph
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        tgt = torch.cat([batch["chosen_targets"], batch["rejected_targets"]])
        b = batch["chosen_input_ids"].shape[0]
        pol, aux = self._seq_logp(model, ids, tgt)
        with torch.no_grad():
            ref, _ = self._seq_logp(self.reference, ids, tgt)
        pi_logratio = pol[:b] - pol[b:]
        ref_logratio = ref[:b] - ref[b:]
        beta = self.cfg.train.dpo.beta
        margin = beta * (pi_logratio - ref_logratio)  # implicit reward margin (B,)
        loss = -F.logsigmoid(margin).sum()
        chosen_reward = beta * (pol[:b] - ref[:b]).detach()
        rejected_reward = beta * (pol[b:] - ref[b:]).detach()
        extra = {
            "reward_margin": (chosen_reward - rejected_reward).sum(),
            "reward_accuracy": (chosen_reward > rejected_reward).float().sum(),
            "chosen_reward": chosen_reward.sum(),
            "rejected_reward": rejected_reward.sum(),
        }
        return loss, aux, extra
