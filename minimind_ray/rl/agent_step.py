"""One agent step's plan, for the agent objective (engine/objectives.py:AgentObjective): GRPO's plan
(rl/grpo_step.py:GRPOPlan: its updates, adaptive KL, checkpointed state) with multi-turn tool-use rollouts
(rl/agent.py) and the agent's reward terms (rl/agent_rewards.py) in place of single completions and their rewards.

    prepare(step)   each micro-batch: num_generations trajectories per prompt, rewards, the reference's log-probs
                    of the policy's tokens; advantages within each group, as GRPO's
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List

import torch
from torch import Tensor

from minimind_ray.rl.grpo_step import GRPOPlan

Batch = Dict[str, Tensor]


class AgentPlan(GRPOPlan):
    def __init__(self, cfg, toolbox):
        super().__init__(cfg)
        self.a, self.toolbox = cfg.train.agent, toolbox

    def prepare(self, state, batches: List[Batch], step: int, *, rewards, reference) -> List[Batch]:
        from minimind_ray.rl.grpo import group_advantages

        if self.engine is None:
            self._setup(state)
        g, t0 = self.g, time.perf_counter()
        self.engine.update_policy(state.model, step)
        out = [self._rollout(state, mb, step, rewards, reference) for mb in batches]
        batch_std = self._batch_std(out, state) if g.scale_rewards == "batch" else None
        for b in out:
            b["advantages"] = group_advantages(b["rewards"], g.num_generations, g.scale_rewards, g.advantage,
                                               batch_std)
        scale = self.cfg.train.global_batch_size * g.num_generations / state.world  # per step, over ranks
        out[0]["metric_rollout_s"] = torch.tensor((time.perf_counter() - t0) * scale, dtype=torch.float64,
                                                  device=state.device)
        out[0]["metric_beta"] = torch.tensor(self.kl.beta * scale, dtype=torch.float64, device=state.device)
        return out

    def _rollout(self, state, mb: Batch, step: int, rewards, reference) -> Batch:
        from minimind_ray.rl.agent import agent_rollout
        from minimind_ray.rl.agent_rewards import answer_calls, final_answer, gt_found, score_trajectories
        from minimind_ray.rl.grpo import completion_logprobs, group_std

        g, dev = self.g, state.device
        trajs, b = agent_rollout(mb, engine=self.engine, params=self._params(), group_size=g.num_generations,
                                 toolbox=self.toolbox, tokenizer=self.tokenizer, max_turns=self.a.max_turns,
                                 max_total_len=self.a.max_total_len, seed=self.cfg.train.seed, step=step, device=dev)
        total, per_term = score_trajectories(rewards, trajs, self.a.reward_clip)
        as_t = lambda v: torch.tensor(v, dtype=torch.float32, device=dev)  # noqa: E731
        b["rewards"] = total = as_t(total)
        truncated = as_t([t.truncated for t in trajs])
        if g.mask_truncated:
            b["completion_mask"] = b["completion_mask"] * (1.0 - truncated)[:, None]
        mask = b["completion_mask"]
        b["old_logp"] = b["old_logp"] * mask
        if reference is not None:
            with torch.no_grad(), (state.autocast or contextlib.nullcontext)():
                b["ref_logp"] = completion_logprobs(reference, b["input_ids"], b["attention_mask"], mask.shape[1])[0]
        spread = group_std(total, g.num_generations)
        metrics = {"reward": total.sum(), "reward_std": spread.sum(), "zero_std_fraction": spread.le(1e-6).float().sum(),
                   "completion_len": mask.sum(), "total_len": b.pop("total_len").sum(),
                   "turns": as_t([len(t.turns) for t in trajs]).sum(),
                   "called_tool": as_t([bool(answer_calls(t)) for t in trajs]).sum(),
                   "tool_calls": as_t([sum(len(c) for c in t.calls) for t in trajs]).sum(),
                   "tool_errors": as_t([t.errors for t in trajs]).sum(),
                   "bad_tool_calls": as_t([t.bad_calls for t in trajs]).sum(),
                   "unfinished_fraction": as_t([t.unfinished for t in trajs]).sum(), "truncated_fraction": truncated.sum(),
                   "answer_correct": as_t([bool(t.gt) and all(gt_found(final_answer(t), t.gt, "exact"))
                                           for t in trajs]).sum()}
        metrics.update({f"reward_{k}": as_t(v).sum() for k, v in per_term.items()})
        b.update({f"metric_{k}": v.double() for k, v in metrics.items()})
        return b
