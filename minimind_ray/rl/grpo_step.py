"""One GRPO step's plan, on the plan base's group sampling (rl/plan.py:GroupPlan: the step's skeleton, the
rollouts of num_generations completions per prompt, rl/grpo.py:rollout_micro_batch's rewards, dynamic sampling and
reference log-probs); what is GRPO's own is here, its math in rl/grpo.py:

    advantages()    group / batch (one all-reduce of the rewards' sums) / no scaling, grpo or rloo
    passes          num_iterations passes, each of mini_batches optimizer updates over row slices of the rollouts
    loss_sum()      rl/grpo.py:grpo_loss_sum at the controller's beta
    end_step()      kl_target: beta *= 1 + clip(KL / target - 1, -0.2, 0.2) / kl_horizon (Ziegler et al., verl)
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from torch import Tensor

from minimind_ray.rl.grpo import group_advantages, grpo_loss_sum, loss_units
from minimind_ray.rl.plan import GroupPlan, all_reduced

Batch = Dict[str, Tensor]


class AdaptiveKL:
    """The KL weight: fixed, or moved toward ``target`` each step (Stateful: checkpoints hold it)."""

    def __init__(self, beta: float, target: Optional[float], horizon: int):
        self.beta, self.target, self.horizon = beta, target, horizon

    def update(self, kl: float, steps: int = 1) -> None:
        if self.target is None or not math.isfinite(kl):
            return
        error = max(-0.2, min(0.2, kl / self.target - 1.0))
        self.beta *= 1.0 + error * steps / self.horizon

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, sd: dict) -> None:
        self.beta = float(sd.get("beta", self.beta))


class GRPOPlan(GroupPlan):
    """GRPO / CISPO on the plan base: group advantages, the clipped or clamped loss with beta * KL, the adaptive KL
    controller (its beta is the plan's checkpointed state)."""

    def __init__(self, cfg, section):  # section: a GRPOConfig (train.grpo)
        super().__init__(cfg, section)
        self.g = self.section
        self.kl = AdaptiveKL(self.g.beta, self.g.kl_target, self.g.kl_horizon)

    @property
    def kl_weight(self) -> float:
        return self.g.beta

    @property
    def dynamic_rounds(self) -> int:
        return self.g.dynamic_sampling

    @property
    def passes(self) -> int:
        return self.g.num_iterations

    def advantages(self, state, out: List[Batch]) -> None:
        g = self.g
        batch_std = self._batch_std(out, state) if g.scale_rewards == "batch" else None
        for b in out:
            b["advantages"] = group_advantages(b["rewards"], g.num_generations, g.scale_rewards, g.advantage,
                                               batch_std)

    def step_metrics(self, first: Batch, scale: float, state) -> None:
        first["metric_beta"] = torch.tensor(self.kl.beta * scale, dtype=torch.float64, device=state.device)

    @staticmethod
    def _batch_std(out: List[Batch], state) -> float:
        """The population std of every reward of the global batch (one all-reduce of count, sum, sum of squares)."""
        r = torch.cat([b["rewards"].double() for b in out])
        stats = all_reduced(state, torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device),
                                                r.sum(), (r * r).sum()]))
        n, s, sq = (float(x) for x in stats)
        return math.sqrt(max(sq / n - (s / n) ** 2, 0.0))

    def weight(self, batch: Batch) -> int:
        return loss_units(batch["completion_mask"], self.g.loss_agg)

    def loss_sum(self, model, batch: Batch):
        return grpo_loss_sum(model, batch, self.g, beta=self.kl.beta)

    def end_step(self, state, out) -> None:
        if self.g.kl_target is None or "kl" not in out.extras:
            return
        kl_sum = all_reduced(state, out.extras["kl"].double().clone())  # this rank's completions; metric_weight: all
        self.kl.update(float(kl_sum / out.metric_weight.clamp_min(1.0)))

    def state_dict(self) -> dict:
        return {"kl": self.kl.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kl"):
            self.kl.load_state_dict(sd["kl"])
