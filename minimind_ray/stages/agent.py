"""Agentic tool-use RL (MiniMind's train_agent.py): multi-turn GRPO/CISPO rollouts that call tools and read their
results (``train.agent``; the policy loss, group and sampling are ``train.grpo``'s: this record runs GRPO's record's
checks and key migration on that section, and hands it to the plan)."""
from __future__ import annotations

from typing import List

from minimind_ray.config_checks import need
from minimind_ray.rl.agent_config import AgentConfig, validate_agent
from minimind_ray.rl.grpo_config import GRPOConfig
from minimind_ray.rl.rewards import user_reward_names
from minimind_ray.stages.grpo import STAGE as GRPO
from minimind_ray.stages.rl_stage import RL_RECORD
from minimind_ray.stages.stage import MemoryTerms, Stage


def objective(cfg):
    from minimind_ray.rl.agent_step import AgentPlan  # lazy: torch, when a run builds its state
    from minimind_ray.stages.rl_objective import RLObjective  # lazy: torch, as its plan

    return RLObjective(cfg, AgentPlan(cfg, cfg.train.grpo, cfg.train.agent))


def validate(cfg) -> None:
    """GRPO's checks of train.grpo (the policy loss, the group, the sampling), the fields of it the agent does not
    read left as they are, then train.agent's own (rl/agent_config.py)."""
    g = cfg.train.grpo
    GRPO.validate(cfg)
    need(g.dynamic_sampling == 0, "train.grpo.dynamic_sampling", "not available for the agent stage (0)")
    need([r.name for r in g.rewards] == [r.name for r in GRPOConfig().rewards], "train.grpo.rewards",
         "the agent stage scores whole trajectories with train.agent.rewards; leave train.grpo.rewards as it is")
    validate_agent(cfg)


def memory(cfg, policy, count) -> MemoryTerms:
    """num_generations trajectories per prompt, each up to max_total_len tokens (its turns and the tools' answers)."""
    a, g = cfg.train.agent, cfg.train.grpo
    return MemoryTerms(sequences=g.num_generations, extra_tokens=max(0, a.max_total_len - cfg.data.max_seq_len),
                       frozen_models=1.0 if g.beta > 0 else 0.0,
                       batch_fields=("train.grpo.num_generations", "train.agent.max_total_len"))


def plugins(cfg) -> List[str]:
    """Its reward terms and the tools of its own that the user names (``package.module:function``)."""
    a = cfg.train.agent
    return user_reward_names(a.rewards) + [t.function for t in a.tools if t.function]


STAGE = Stage("agent", "agentic tool-use RL: multi-turn GRPO/CISPO rollouts that call tools and read their results",
              formats=("agent_rl",), objective=objective, export_prefix="agent", section=AgentConfig,
              validate=validate, memory=memory, plugins=plugins, old_keys=GRPO.old_keys, reads=("grpo",),
              headline=("reward", "kl"), **RL_RECORD)
