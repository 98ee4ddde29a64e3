"""GRPO's objective: the engine's side of rl/grpo_step.py's plan and rl/grpo.py's losses."""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from minimind_ray.rl.grpo import grpo_loss_sum, loss_units
from minimind_ray.rl.grpo_step import GRPOPlan
from minimind_ray.rl.rewards import build_rewards
from minimind_ray.stages.objective import Batch, Objective, frozen_copy


class GRPOObjective(Objective):
    """GRPO / CISPO (MiniMind's train_grpo.py, with verl's, TRL's and DAPO's options; the pieces are in
    minimind_ray/rl/, docs/rl.md). ``prepare`` samples ``num_generations`` completions of each prompt from the
    current policy (in this worker or on a pool of rollout actors), scores them with the reward terms and turns
    the rewards into advantages; ``update_plan`` makes ``num_iterations`` passes of ``mini_batches`` optimizer
    updates over them; ``loss_sum`` is the clipped (grpo) or clamped (cispo) policy-gradient loss plus beta * KL to
    a frozen copy of the initial weights, aggregated as ``loss_agg`` says. Every completion samples from a seed of
    its own (rl/rollout.py:row_seeds), so a restarted run samples what an uninterrupted one did; the adaptive KL
    controller's beta is the objective's checkpointed state."""

    name = "grpo"

    def setup(self, model: nn.Module, device: torch.device) -> None:
        g = self.cfg.train.grpo
        self.reference = frozen_copy(model).to(device) if g.beta > 0 else None
        with torch.random.fork_rng(devices=[]):  # loading a reward model must not move the sampling RNG
            self.rewards = build_rewards(g.rewards, device, run_name=self.cfg.name)
        self.plan = GRPOPlan(self.cfg)

    def prepare(self, state, batches: List[Batch], step: int) -> List[Batch]:
        return self.plan.prepare(state, batches, step, rewards=self.rewards, reference=self.reference)

    def update_plan(self, batches: List[Batch]) -> List[List[List[Batch]]]:
        return self.plan.updates(batches)

    def weight(self, batch: Batch) -> int:
        return loss_units(batch["completion_mask"], self.cfg.train.grpo.loss_agg)

    def metric_weight(self, batch: Batch) -> int:
        return int(batch.get("metric_rows", batch["completion_mask"].new_zeros(())).item())

    def loss_sum(self, model, batch):
        return grpo_loss_sum(model, batch, self.cfg.train.grpo, beta=self.plan.kl.beta)

    def end_step(self, state, out) -> None:
        self.plan.end_step(state, out)

    def state_dict(self) -> Dict:
        return self.plan.state_dict()

    def load_state_dict(self, sd: Dict) -> None:
        self.plan.load_state_dict(sd)
