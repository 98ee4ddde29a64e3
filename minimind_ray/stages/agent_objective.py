"""The agent stage's objective: GRPO's, on multi-turn trajectories with tool calls (rl/agent_step.py)."""
from __future__ import annotations

import torch
from torch import nn

from minimind_ray.rl.agent_rewards import build_agent_rewards
from minimind_ray.rl.agent_step import AgentPlan
from minimind_ray.rl.tools import ToolBox
from minimind_ray.stages.grpo_objective import GRPOObjective
from minimind_ray.stages.objective import frozen_copy


class AgentObjective(GRPOObjective):
    """Agentic tool-use RL (MiniMind's train_agent.py; rl/agent*.py, rl/tools.py, docs/rl.md): GRPO/CISPO as the grpo
    objective computes it (train.grpo), on multi-turn trajectories in which the policy calls tools (train.agent.tools,
    run in a worker process with a time limit) and reads their results; only the policy's own tokens carry loss, and
    a trajectory's reward is the sum of train.agent.rewards (MiniMind's answer, format and repetition terms)."""

    name = "agent"

    def setup(self, model: nn.Module, device: torch.device) -> None:
        a, g = self.cfg.train.agent, self.cfg.train.grpo
        self.reference = frozen_copy(model).to(device) if g.beta > 0 else None
        with torch.random.fork_rng(devices=[]):  # loading a reward model must not move the sampling RNG
            self.rewards = build_agent_rewards(a.rewards, device, run_name=self.cfg.name)
        tools = ToolBox(a.tools, a.max_tool_response_chars)
        tools.load_user_tools()  # a tool of the user's that did not reach this worker fails here, named
        self.plan = AgentPlan(self.cfg, tools)
