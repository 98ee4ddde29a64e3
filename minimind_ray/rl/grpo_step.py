"""One GRPO step's plan, for the grpo objective (stages/grpo_objective.py), on the shared base (rl/plan.py): rollouts, advantages, the
optimizer updates over them, and the adaptive KL controller. The math is in rl/grpo.py.

    prepare(step)   the policy's weights to the rollout engine (once per step)
                    each micro-batch: its rollout (generated now, or ahead with rollout_overlap), rewards,
                    dynamic sampling, reference log-probs (rl/grpo.py:rollout_micro_batch)
                    advantages: group / batch (one all-reduce of the rewards' sums) / no scaling, grpo or rloo
                    rollout_overlap: step t+1's requests sent now, from these (pre-update) weights, unless step t
                    is a checkpoint step (so a restored run generates exactly what an uninterrupted one did)
    updates()       num_iterations passes, each of mini_batches optimizer updates over row slices of the rollouts
    end_step()      kl_target: beta *= 1 + clip(KL / target - 1, -0.2, 0.2) / kl_horizon (Ziegler et al., verl)
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from minimind_ray.rl.plan import RolloutPlan
from minimind_ray.rl.rollout import row_seeds

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


class GRPOPlan(RolloutPlan):
    def __init__(self, cfg):
        g = cfg.train.grpo
        super().__init__(cfg, g)
        self.g = g
        self.kl = AdaptiveKL(g.beta, g.kl_target, g.kl_horizon)
        self.pending: Dict[int, list] = {}  # step -> this rank's submitted requests, one per micro-batch

    def _requests(self, state, batches: List[Batch], step: int) -> list:
        """Each micro-batch's rollout request: (prompt rows, their mask, params, each row's seed)."""
        G, dev = self.g.num_generations, state.device
        return [(mb["prompt_ids"].to(dev).repeat_interleave(G, 0), mb["prompt_mask"].to(dev).repeat_interleave(G, 0),
                 self.params(), row_seeds(self.cfg.train.seed, step, mb["sample_ids"], G).to(dev)) for mb in batches]

    def _submit(self, state, batches: List[Batch], step: int) -> list:
        return [self.engine.submit(*request) for request in self._requests(state, batches, step)]

    def prepare(self, state, batches: List[Batch], step: int, *, rewards, reference) -> List[Batch]:
        # lazy: omegaconf, yaml, only when this runs
        from minimind_ray.rl.grpo import group_advantages, rollout_micro_batch

        self.setup(state)
        g, t0 = self.g, time.perf_counter()
        ahead = [self.engine.collect(h) for h in self.pending.pop(step, [])]  # generated from older weights
        self.engine.update_policy(state.model, step)
        if not ahead:  # the step's micro-batches together: the in-worker sampler runs them as one batch
            ahead = self.engine.generate_many(self._requests(state, batches, step))
        out = [rollout_micro_batch(mb, engine=self.engine, params=self.params(), group_size=g.num_generations,
                                   rewards=rewards, tokenizer=self.tokenizer, reference=reference,
                                   autocast=state.autocast, device=state.device, seed=self.cfg.train.seed, step=step,
                                   dynamic_rounds=g.dynamic_sampling, mask_truncated=g.mask_truncated,
                                   pending=ahead[i] if ahead else None) for i, mb in enumerate(batches)]
        if self.overlaps(state, step):
            self.pending[step + 1] = self._submit(state, state.stream.peek(), step + 1)  # runs during the update
        batch_std = self._batch_std(out, state) if g.scale_rewards == "batch" else None
        for b in out:
            b["advantages"] = group_advantages(b["rewards"], g.num_generations, g.scale_rewards, g.advantage,
                                               batch_std)
        # the interval meter divides metric sums by the completions of the interval (global batch * G per step):
        # weighted so, this rank's seconds come out as the step's rollout time averaged over ranks
        per_step = self.cfg.train.global_batch_size * g.num_generations
        scale = per_step / state.world
        out[0]["metric_rollout_s"] = torch.tensor((time.perf_counter() - t0) * scale, dtype=torch.float64,
                                                  device=state.device)
        out[0]["metric_beta"] = torch.tensor(self.kl.beta * scale, dtype=torch.float64, device=state.device)
        return out

    @staticmethod
    def _batch_std(out: List[Batch], state) -> float:
        """The population std of every reward of the global batch (one all-reduce of count, sum, sum of squares)."""
        r = torch.cat([b["rewards"].double() for b in out])
        stats = torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device), r.sum(),
                             (r * r).sum()])
        if state.world > 1:
            dist.all_reduce(stats)
        n, s, sq = (float(x) for x in stats)
        return math.sqrt(max(sq / n - (s / n) ** 2, 0.0))

    def updates(self, batches: List[Batch]) -> List[List[List[Batch]]]:
        """``num_iterations`` passes over the rollouts, each ``mini_batches`` updates: update j of a pass trains
        on the j-th row slice of every micro-batch (the same slices on every rank and pass)."""
        return self.updates_over(batches, self.g.num_iterations, self.g.mini_batches)

    def end_step(self, state, out) -> None:
        if self.g.kl_target is None or "kl" not in out.extras:
            return
        kl_sum = out.extras["kl"].double().clone()  # this rank's completions; metric_weight: all ranks'
        if state.world > 1:
            dist.all_reduce(kl_sum)
        self.kl.update(float(kl_sum / out.metric_weight.clamp_min(1.0)))

    def state_dict(self) -> dict:
        return {"kl": self.kl.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kl"):
            self.kl.load_state_dict(sd["kl"])
