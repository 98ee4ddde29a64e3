"""RLOO, REINFORCE leave-one-out (Ahmadian et al., 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
for Learning from Human Feedback in LLMs"), as TRL's RLOOTrainer and OpenRLHF's ``rloo`` estimator compute it: k
completions of each prompt and no critic. A completion's reward is the sum of its reward terms minus beta times its
KL to the frozen reference (the sum over its tokens of log p - log ref, TRL's sequence-level penalty); its advantage
is that reward minus the mean of the other k - 1 rewards of its prompt,

    A_i = r_i - (sum_j r_j - r_i) / (k - 1),

optionally normalised over the global batch; its loss is REINFORCE with PPO's clip on the probability ratio of the
whole completion (the completion is one action),

    loss_i = -min(rho_i A_i, clip(rho_i, 1 - epsilon, 1 + epsilon_high) A_i),   rho_i = exp(sum_t log p - log p_old),

averaged over the global batch's completions (``train.rloo``).

The worked example of docs/architecture.md, "Where to add things", for an RL algorithm: this module and one line of
stages/__init__.py. The plan base (rl/plan.py:GroupPlan) samples the groups, scores them, keeps the reference and sends
rollouts ahead; this module supplies the section, the advantages (the leave-one-out baseline is the RL toolkit's,
rl/advantages.py, which GRPO's advantage='rloo' shares) and the loss; its plan is its objective. Its math uses tensor methods only, and
torch is imported where a run uses it: the CLI and the config read this record.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

from minimind_ray.config_checks import config_field as _f, need
from minimind_ray.data.config import PROMPT_FORMATS
from minimind_ray.rl.constraints import json_schema_field, validate_json_schema
from minimind_ray.rl.plan import Batch, GroupPlan, all_reduced
from minimind_ray.rl.rewards import RewardConfig, reward_terms_field, user_reward_names, validate_reward_terms
from minimind_ray.stages.rl_stage import (RL_RECORD, need_no_held_out, need_room_for_completions,
                                          need_trained_policy)
from minimind_ray.stages.stage import MemoryTerms, Stage


@dataclass
class RLOOConfig:
    """REINFORCE leave-one-out (stage 'rloo'); defaults are TRL's RLOOConfig's where it has the setting."""

    num_generations: int = _f(4, "k, completions sampled per prompt: each one's baseline is the mean reward of the "
                                 "other k - 1 (TRL: 2)", ge=2)
    max_gen_len: int = _f(256, "most new tokens per completion (TRL's max_completion_length)", ge=1)
    temperature: float = _f(1.0, "sampling temperature of the rollouts", gt=0)
    top_p: float = _f(1.0, "nucleus sampling mass (1 = off)", gt=0, le=1)
    top_k: int = _f(0, "sample among the k most likely tokens (0 = off)", ge=0)
    beta: float = _f(0.05, "KL penalty in the reward: r - beta * the sum over the completion's tokens of (log p - log "
                           "ref), to a frozen copy of the initial weights; 0 = no reference", ge=0)
    epsilon: float = _f(0.2, "the completion's probability ratio is clipped below at 1 - epsilon (and above at 1 + "
                             "epsilon unless epsilon_high)", gt=0, lt=1)
    epsilon_high: Optional[float] = _f(None, "the ratio's upper clip is 1 + epsilon_high (DAPO: 0.28); None = epsilon",
                                       gt=0)
    normalize_advantages: bool = _f(False, "advantages to mean 0 and std 1 over the global batch (TRL's option)")
    num_iterations: int = _f(1, "optimizer passes over each batch of rollouts; from the second on the ratio moves "
                                "and the clip acts", ge=1)
    mini_batches: int = _f(1, "optimizer updates per pass: the rollouts split into this many mini-batches", ge=1)
    mask_truncated: bool = _f(False, "completions that reach max_gen_len without an EOS carry no loss (TRL)")
    json_schema: Optional[str] = json_schema_field()
    rewards: List[RewardConfig] = reward_terms_field(
        "reward terms (docs/rl.md: a rule's name, 'module:function' or reward_model); default: MiniMind's "
                "rule rewards")


def validate(cfg) -> None:
    """The rloo stage's checks, naming the field."""
    r = cfg.train.rloo
    need_room_for_completions(cfg, "train.rloo", r.max_gen_len)
    need_no_held_out(cfg)
    need_trained_policy(cfg, "RLOO")
    validate_reward_terms(r.rewards, "train.rloo.rewards")
    validate_json_schema(r.json_schema, "train.rloo.json_schema")


# --------------------------------------------------------------------------- the math (tensors in, tensors out)


def kl_penalised(rewards, old_logp, ref_logp, mask, beta: float):
    """Each completion's reward (N,) minus beta times its KL to the reference: the sum of log p - log ref over its
    tokens (``mask`` (N, R)), with the behaviour policy's log-probs, as TRL penalises its RLOO rewards."""
    return rewards - beta * ((old_logp - ref_logp) * mask).sum(dim=1)


def sequence_loss(logp, old_logp, mask, advantages, epsilon: float, epsilon_high: Optional[float]):
    """(each completion's clipped REINFORCE loss (N,), whether its clip took over (N,)): the ratio is that of the
    whole completion, exp(sum over its tokens of log p - log p_old); a completion with no token under ``mask`` has
    ratio 1 and no gradient."""
    ratio = ((logp - old_logp) * mask).sum(dim=1).exp()
    high = epsilon if epsilon_high is None else epsilon_high
    unclipped, clipped = ratio * advantages, ratio.clamp(1 - epsilon, 1 + high) * advantages
    return -unclipped.minimum(clipped), (clipped < unclipped).detach()


def normalised(advantages: list, state) -> list:
    """Advantages to mean 0 and std 1 (Bessel's, as torch.std and TRL) over every completion of the global batch:
    one all-reduce of count, sum and sum of squares."""
    a = [x.double() for x in advantages]
    stats = all_reduced(state, a[0].new_tensor([float(sum(x.numel() for x in a)), float(sum(x.sum() for x in a)),
                                                float(sum((x * x).sum() for x in a))]))
    n, s, sq = (float(x) for x in stats)
    mean = s / n
    std = math.sqrt(max(sq - n * mean * mean, 0.0) / max(n - 1.0, 1.0))
    return [((x - mean) / (std + 1e-4)).to(y.dtype) for x, y in zip(a, advantages)]


# --------------------------------------------------------------------------- the plan and the record


class RLOOPlan(GroupPlan):
    """RLOO on the plan base: GroupPlan's rollouts (num_generations completions of each prompt, their rewards, the
    behaviour and reference log-probs); the KL-penalised leave-one-out advantages and the clipped sequence loss here."""

    def advantages(self, state, out: List[Batch]) -> None:
        from minimind_ray.rl.advantages import leave_one_out  # lazy: torch, when a run trains

        r = self.section
        for b in out:
            rewards, mask = b["rewards"], b["completion_mask"]
            if "ref_logp" in b:
                rewards = kl_penalised(rewards, b["old_logp"], b["ref_logp"], mask, r.beta)
                per_token = ((b["old_logp"] - b["ref_logp"]) * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)
                b["metric_kl"] = per_token.sum().double()  # each completion's mean over its tokens, summed
            b["advantages"] = leave_one_out(rewards, r.num_generations)
        if r.normalize_advantages:
            for b, a in zip(out, normalised([b["advantages"] for b in out], state)):
                b["advantages"] = a

    def weight(self, batch: Batch) -> int:
        return int(batch["completion_mask"].sum(dim=1).gt(0).sum())  # completions that carry a token

    def loss_sum(self, model, batch: Batch) -> Tuple:
        from minimind_ray.rl.logprobs import completion_logprobs  # lazy: torch, when a run trains

        r, mask = self.section, batch["completion_mask"]
        logp, aux = completion_logprobs(model, batch["input_ids"], batch["attention_mask"], mask.shape[1])
        loss, clipped = sequence_loss(logp, batch["old_logp"], mask, batch["advantages"], r.epsilon, r.epsilon_high)
        counted = mask.sum(dim=1).gt(0).to(loss.dtype)
        extras = {k[len("metric_"):]: v for k, v in batch.items() if k.startswith("metric_")}
        extras["clip_fraction"] = (clipped.to(loss.dtype) * counted).sum() / r.num_iterations  # a mean over passes
        return (loss * counted).sum(), aux, extras


def objective(cfg):
    return RLOOPlan(cfg, cfg.train.rloo)


def memory(cfg, policy, count) -> MemoryTerms:
    r = cfg.train.rloo
    return MemoryTerms(sequences=r.num_generations, extra_tokens=r.max_gen_len, frozen_models=1.0 if r.beta > 0 else 0.0,
                       batch_fields=("train.rloo.num_generations", "train.rloo.max_gen_len"))


def plugins(cfg) -> List[str]:
    return user_reward_names(cfg.train.rloo.rewards)


STAGE = Stage("rloo", "RLOO: k completions of each prompt, each one's baseline the mean reward of the other k - 1, "
                      "no critic", formats=PROMPT_FORMATS, objective=objective, export_prefix="rloo",
              section=RLOOConfig, validate=validate, memory=memory, plugins=plugins, headline=("reward", "kl"), **RL_RECORD)
