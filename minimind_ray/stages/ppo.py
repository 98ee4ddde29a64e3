"""PPO with a critic (MiniMind's train_ppo.py): GAE advantages of the rewards, clipped policy and value losses
(``train.ppo``; the pieces are in minimind_ray/rl/ppo*.py)."""
from __future__ import annotations

from typing import List

from minimind_ray.data.config import PROMPT_FORMATS
from minimind_ray.rl.ppo_config import PPOConfig, validate_ppo
from minimind_ray.rl.rewards import user_reward_names
from minimind_ray.stages.rl_stage import RL_RECORD
from minimind_ray.stages.stage import MemoryTerms, Stage


def objective(cfg):
    from minimind_ray.rl.ppo_step import PPOPlan  # lazy: torch, when a run builds its state
    from minimind_ray.stages.rl_objective import RLObjective  # lazy: torch, as its plan

    return RLObjective(cfg, PPOPlan(cfg, cfg.train.ppo))


def memory(cfg, policy, count) -> MemoryTerms:
    """One completion per prompt; the critic (a copy of the policy with a value head) trains beside it; the reference
    when kl_coef > 0."""
    p = cfg.train.ppo
    return MemoryTerms(extra_tokens=p.max_gen_len, frozen_models=1.0 if p.kl_coef > 0 else 0.0, trained_models=1.0,
                       batch_fields=("train.ppo.max_gen_len",))


def plugins(cfg) -> List[str]:
    return user_reward_names(cfg.train.ppo.rewards)


STAGE = Stage("ppo", "PPO: an actor and a critic, GAE advantages of the rewards, clipped policy and value losses",
              formats=PROMPT_FORMATS, objective=objective, export_prefix="ppo_actor", parts=(("critic", "ppo_critic"),),
              section=PPOConfig, validate=validate_ppo, memory=memory, plugins=plugins,
              headline=("reward", "kl"),
              **dict(RL_RECORD, fsdp_refusal=RL_RECORD["fsdp_refusal"] + ", and its critic has a DDP wrapper of its "
                                                                         "own"))
