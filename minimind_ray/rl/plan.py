"""What the step plans of GRPO (rl/grpo_step.py), PPO (rl/ppo_step.py) and the agent (rl/agent_step.py) share: the
rollout engine ``train.rollout`` names and the run's tokenizer, the sampling parameters of the algorithm's section,
rollouts sent ahead of the update (``train.rollout.overlap``), and a step's optimizer updates as passes over row
slices of the rollouts."""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import Tensor

from minimind_ray.rl.actors import ActorRollout
from minimind_ray.rl.rollout import SamplingParams, TorchRollout

Batch = Dict[str, Tensor]


def rows(batch: Batch, lo: int, hi: int, keep_metrics: bool) -> Batch:
    """Rows lo:hi of a rolled-out micro-batch; its metric sums and metric_rows stay with one slice only."""
    out = {k: v[lo:hi] for k, v in batch.items() if not k.startswith("metric_") and v.dim() > 0}
    if keep_metrics:
        out.update({k: v for k, v in batch.items() if k.startswith("metric_")})
    out["metric_rows"] = torch.tensor(batch["completion_mask"].shape[0] if keep_metrics else 0)
    return out


def build_rollout(cfg, state):
    """The engine ``train.rollout.engine`` names: this worker's sampler, or a pool of Ray actors (rl/actors.py)."""
    engine = cfg.train.rollout.engine
    if engine == "worker":
        return TorchRollout(state.autocast)
    if engine == "actors":
        return ActorRollout(cfg, state.rank, state.world)
    raise ValueError(f"train.rollout.engine: unknown rollout engine {engine!r}; one of ('worker', 'actors')")


class RolloutPlan:
    """The base of an RL step plan. ``sampling`` is the algorithm's section holding max_gen_len, temperature, top_p,
    top_k (train.grpo, train.ppo)."""

    def __init__(self, cfg, sampling):
        self.cfg, self.sampling = cfg, sampling
        self.engine = self.tokenizer = None

    def setup(self, state) -> None:
        """The engine and the tokenizer, once, on the first step (the engine needs the worker's state)."""
        from minimind_ray.rl.grpo import run_tokenizer  # lazy: omegaconf, yaml, only when this runs

        if self.engine is None:
            self.engine = build_rollout(self.cfg, state)
            self.tokenizer = run_tokenizer(self.cfg, state.dataset.manifest)

    def params(self):
        s = self.sampling
        return SamplingParams(s.max_gen_len, s.temperature, s.top_p, s.top_k, self.tokenizer.eos_id,
                              self.tokenizer.pad_id)

    def overlaps(self, state, step: int) -> bool:
        """Whether step ``step + 1``'s rollouts are sent now, from the weights before this step's update: with
        ``train.rollout.overlap``, except before the last step and at a checkpoint step (a run restored there must
        generate what an uninterrupted one did, so nothing of step + 1 may come from before the checkpoint)."""
        from minimind_ray.store.config import checkpoint_due  # lazy: omegaconf, yaml, only when this runs

        return (self.cfg.train.rollout.overlap and step < state.total_steps
                and not checkpoint_due(self.cfg, step, state.total_steps))

    @staticmethod
    def updates_over(batches: List[Batch], passes: int, mini_batches: int) -> List[List[List[Batch]]]:
        """``passes`` passes over the rollouts, each ``mini_batches`` updates: update j of a pass trains on the j-th row
        slice of every micro-batch (the same slices on every rank and pass); the metrics ride with the first."""
        out = []
        for p in range(passes):
            updates = []
            for j in range(mini_batches):
                update = []
                for b in batches:
                    n = b["completion_mask"].shape[0]
                    update.append(rows(b, n * j // mini_batches, n * (j + 1) // mini_batches,
                                       keep_metrics=(p == 0 and j == 0)))
                updates.append(update)
            out.append(updates)
        return out
