"""KTO's objective (stages/kto.py): the prospect-theoretic loss of unpaired replies against a frozen reference, around
a KL reference point estimated over the optimizer step's global batch."""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from torch import nn

from minimind_ray.stages.objective import Batch, Objective, frozen_copy, load_frozen, token_log_probs


def reply_log_probs(model, ids: torch.Tensor, targets: torch.Tensor):
    """log p(reply | prompt) of each row, summed over its target tokens (B,), and the forward's aux loss."""
    out = model(ids)
    logp, _ = token_log_probs(out.logits, targets)
    return logp.sum(-1), out.aux_loss


class KTOObjective(Objective):
    """Per reply, with r = log pi - log ref of the reply and z the batch's KL point:
    ``desirable_weight * (1 - sigmoid(beta * (r - z)))`` if its label is true, else
    ``undesirable_weight * (1 - sigmoid(beta * (z - r)))``; summed over the micro-batch's rows (the step divides by the
    global batch's rows: TRL's mean).

    ``prepare`` computes z before any loss of the step: the mean of log pi - log ref over every mismatched pair
    (``kl_input_ids``) of all this step's micro-batches, summed over the workers in one all-reduce, then clamped at 0;
    each micro-batch carries it as ``kl``. With no ``kl`` (the held-out evaluation, which has no step) a micro-batch
    uses its own pairs'. The reference is a frozen copy held outside the trained module, as DPO's."""

    def setup(self, model: nn.Module, device: torch.device) -> None:
        ref = self.cfg.train.kto.reference
        self.reference = (load_frozen(self.cfg.model, ref, device, "train.kto.reference") if ref
                          else frozen_copy(model).to(device))

    def _kl_sums(self, policy, batch: Batch) -> torch.Tensor:
        """[sum over the micro-batch's mismatched pairs of log pi - log ref, their count] (float64)."""
        with torch.no_grad():
            pol, _ = reply_log_probs(policy, batch["kl_input_ids"], batch["kl_targets"])
            ref, _ = reply_log_probs(self.reference, batch["kl_input_ids"], batch["kl_targets"])
        return torch.stack([(pol.double() - ref.double()).sum(), pol.new_tensor(len(pol), dtype=torch.float64)])

    @staticmethod
    def _kl_point(sums: torch.Tensor) -> torch.Tensor:
        return (sums[0] / sums[1].clamp_min(1.0)).clamp_min(0.0).float()

    def prepare(self, state, batches: List[Batch], step: int) -> List[Batch]:
        sums = torch.zeros(2, dtype=torch.float64, device=state.device)
        for mb in batches:
            mb = {k: v.to(state.device, non_blocking=True) for k, v in mb.items()}
            with state.autocast():
                sums += self._kl_sums(state.model, mb)
        if state.world > 1:  # the point of the global batch: every worker's pairs (TRL gathers them)
            dist.all_reduce(sums)
        kl = self._kl_point(sums)
        return [{**mb, "kl": kl} for mb in batches]

    def weight(self, batch: Batch) -> int:
        return int(batch["label"].numel())  # replies

    def tokens(self, batch: Batch) -> int:
        return int(batch["input_ids"].numel())  # the trained forward's (the KL pairs' run without gradients)

    def loss_sum(self, model, batch):
        k = self.cfg.train.kto
        pol, aux = reply_log_probs(model, batch["input_ids"], batch["targets"])
        with torch.no_grad():
            ref, _ = reply_log_probs(self.reference, batch["input_ids"], batch["targets"])
        kl = batch["kl"] if "kl" in batch else self._kl_point(self._kl_sums(model, batch))
        kl = kl.detach().to(pol.device)
        logratio = pol.float() - ref.float()  # (B,)
        desirable = batch["label"].to(pol.device)
        value = torch.where(desirable, torch.sigmoid(k.beta * (logratio - kl)), torch.sigmoid(k.beta * (kl - logratio)))
        weights = torch.where(desirable, logratio.new_tensor(k.desirable_weight),
                              logratio.new_tensor(k.undesirable_weight))
        loss = (weights * (1.0 - value)).sum()
        reward = k.beta * logratio.detach()
        extra = {
            "kl": kl * len(reward),  # the step's reference point (a mean over rows of the same value)
            "reward_accuracy": (value.detach() > 0.5).float().sum(),  # replies on their label's side of the point
            # beta * r with the label's sign: grows as desirable replies gain on the reference and undesirable ones lose
            "signed_reward": torch.where(desirable, reward, -reward).sum(),
        }
        return loss, aux, extra
