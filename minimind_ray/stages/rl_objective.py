"""The objective of every RL stage: the engine's side of an RL algorithm's plan (rl/plan.py), which does the work. A
stage record builds it with the algorithm's plan (stages/grpo.py, ppo.py, agent.py, rloo.py)."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from minimind_ray.stages.objective import Batch, Objective


class RLObjective(Objective):
    """Sample completions of each prompt from the current policy (in this worker or on a pool of rollout actors), score
    them with reward terms, turn the rewards into advantages (``prepare``: the plan's step), and make the algorithm's
    optimizer updates over them (``update_plan``, ``loss_sum``). Every completion samples from a seed of its own
    (rl/rollout.py:row_seeds), so a restarted run samples what an uninterrupted one did; the plan's own state (GRPO's
    adaptive beta) is the objective's checkpointed state, a model it trains beside the policy (PPO's critic) a trained
    part. ``metric_weight``: the rolled-out completions (the interval meter's means are over completions)."""

    def __init__(self, cfg, plan):
        super().__init__(cfg)
        self.plan = plan

    @property
    def reference(self):
        """The frozen reference policy (a copy of the initial weights), or None."""
        return self.plan.reference

    def setup(self, model: nn.Module, device: torch.device) -> None:
        self.plan.build(model, device)

    def trained_parts(self) -> Dict[str, Tuple[nn.Module, float]]:
        return self.plan.trained_parts()

    def bind_parts(self, forward_modules: Dict[str, nn.Module]) -> None:
        self.plan.bind_parts(forward_modules)

    def prepare(self, state, batches: List[Batch], step: int) -> List[Batch]:
        return self.plan.prepare(state, batches, step)

    def update_plan(self, batches: List[Batch]) -> List[List[List[Batch]]]:
        return self.plan.updates(batches)

    def weight(self, batch: Batch) -> int:
        return self.plan.weight(batch)

    def metric_weight(self, batch: Batch) -> int:
        return int(batch.get("metric_rows", batch["completion_mask"].new_zeros(())).item())

    def loss_sum(self, model, batch):
        return self.plan.loss_sum(model, batch)

    def keep_update(self, state) -> bool:
        return self.plan.keep_update(state)

    def end_step(self, state, out) -> None:
        self.plan.end_step(state, out)

    def state_dict(self) -> Dict:
        return self.plan.state_dict()

    def load_state_dict(self, sd: Dict) -> None:
        self.plan.load_state_dict(sd)
