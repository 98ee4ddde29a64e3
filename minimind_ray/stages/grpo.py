"""GRPO / CISPO (MiniMind's train_grpo.py, with verl's, TRL's and DAPO's options): sample completions of each prompt,
score them with reward terms, reinforce the better ones (``train.grpo``; the pieces are in minimind_ray/rl/)."""
from __future__ import annotations

from typing import List

from minimind_ray.data.config import PROMPT_FORMATS
from minimind_ray.rl.grpo_config import GRPOConfig, adopt_old_keys, validate_grpo
from minimind_ray.rl.rewards import user_reward_names
from minimind_ray.stages.rl_stage import RL_RECORD
from minimind_ray.stages.stage import MemoryTerms, Stage


def objective(cfg):
    from minimind_ray.rl.grpo_step import GRPOPlan  # lazy: torch, when a run builds its state
    from minimind_ray.stages.rl_objective import RLObjective  # lazy: torch, as its plan

    return RLObjective(cfg, GRPOPlan(cfg, cfg.train.grpo))


def memory(cfg, policy, count) -> MemoryTerms:
    g = cfg.train.grpo
    return MemoryTerms(sequences=g.num_generations, extra_tokens=g.max_gen_len, frozen_models=1.0 if g.beta > 0 else 0.0,
                       batch_fields=("train.grpo.num_generations", "train.grpo.max_gen_len"))


def plugins(cfg) -> List[str]:
    return user_reward_names(cfg.train.grpo.rewards)


STAGE = Stage("grpo", "GRPO/CISPO: sample completions, score them with rewards, reinforce the better ones",
              formats=PROMPT_FORMATS, objective=objective, export_prefix="grpo", section=GRPOConfig,
              validate=validate_grpo, memory=memory, plugins=plugins, old_keys=adopt_old_keys,
              headline=("reward", "reward_exact_answer", "kl"), **RL_RECORD)
