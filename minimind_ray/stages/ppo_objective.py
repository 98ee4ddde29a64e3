"""PPO's objective: the engine's side of rl/ppo_step.py's plan, with the critic as a trained part."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from minimind_ray.rl.ppo import CriticModel
from minimind_ray.rl.ppo_step import PPOPlan
from minimind_ray.rl.rewards import build_rewards
from minimind_ray.stages.objective import Batch, Objective, frozen_copy


class PPOObjective(Objective):
    """PPO with a critic (MiniMind's train_ppo.py; rl/ppo.py, rl/ppo_step.py, docs/rl.md). ``prepare`` samples one
    completion per prompt, scores it with the reward terms, and turns the score on its last token (and, with
    ``kl_penalty: reward``, the per-token KL) into GAE advantages over the critic's values; ``update_plan`` makes
    ``ppo_update_iters`` passes of ``mini_batches`` updates; ``loss_sum`` is the clipped policy loss, kl_coef x
    the k3 KL to a frozen copy of the initial weights and vf_coef x the clipped value loss, per completion token;
    ``keep_update`` stops the step's updates when their approximate KL exceeds early_stop_kl. The critic (a value
    head on a copy of the initial policy) is a trained part: its own DDP wrapper, AdamW at critic_lr, and
    ``critic.pth`` in every checkpoint."""

    name = "ppo"

    def setup(self, model: nn.Module, device: torch.device) -> None:
        p = self.cfg.train.ppo
        self.reference = frozen_copy(model).to(device) if p.kl_coef > 0 else None
        self.critic = self.critic_forward = CriticModel(model, seed=self.cfg.train.seed)
        with torch.random.fork_rng(devices=[]):  # loading a reward model must not move the sampling RNG
            self.rewards = build_rewards(p.rewards, device, run_name=self.cfg.name)
        self.plan = PPOPlan(self.cfg)

    def trained_parts(self) -> Dict[str, Tuple[nn.Module, float]]:
        return {"critic": (self.critic, self.cfg.train.ppo.critic_lr)}

    def bind_parts(self, forward_modules: Dict[str, nn.Module]) -> None:
        self.critic_forward = forward_modules["critic"]

    def prepare(self, state, batches: List[Batch], step: int) -> List[Batch]:
        return self.plan.prepare(state, batches, step, rewards=self.rewards, reference=self.reference,
                                 critic=self.critic)

    def update_plan(self, batches: List[Batch]) -> List[List[List[Batch]]]:
        return self.plan.updates(batches)

    def weight(self, batch: Batch) -> int:
        return int(batch["completion_mask"].sum())  # MiniMind's losses are means over the completion tokens

    def metric_weight(self, batch: Batch) -> int:
        return int(batch.get("metric_rows", batch["completion_mask"].new_zeros(())).item())

    def loss_sum(self, model, batch):
        return self.plan.loss_sum(model, self.critic_forward, batch)

    def keep_update(self, state) -> bool:
        return self.plan.keep_update(state)

    def end_step(self, state, out) -> None:
        self.plan.end_step(state, out)
