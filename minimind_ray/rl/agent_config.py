"""The agent stage's configuration (a TrainConfig's ``agent`` section) and its checks; defaults are MiniMind's
``trainer/train_agent.py`` (d65ef2c). The policy loss, sampling and group settings are GRPO's section's (the agent
stage is multi-turn GRPO/CISPO; its record, stages/agent.py, checks that section); what is the agent's own is here: the
turns, the tools and the rewards."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from minimind_ray.config_checks import ConfigError, config_field as _f, need
from minimind_ray.rl.rewards import RewardConfig, validate_reward_term
from minimind_ray.rl.tools import BUILTIN_TOOLS, load_tool_function

AGENT_REWARDS = ("tool_tags", "tool_calls", "reply_format", "gt_answer", "unfinished", "repetition", "reward_model")


@dataclass
class ToolConfig:
    """One tool the model may call (rl/tools.py). A built-in's name alone is enough (``calculate``, ``calculate_math``:
    a safe arithmetic evaluator); any other tool is ``function`` with its ``schema``."""

    name: str = _f("calculate", "the name the model calls; 'calculate' / 'calculate_math' = the built-in safe "
                                "arithmetic evaluator (the demo's and MiniMind's names)")
    function: Optional[str] = _f(None, "'package.module:function', called with the call's arguments as keywords and "
                                       "returning a JSON-serialisable result; None = the built-in of this name")
    schema: Dict[str, Any] = _f({}, "the tool's OpenAI function schema ({type: function, function: {name, description, "
                                    "parameters}}), for the argument checks; {} = the built-in's")
    timeout_s: float = _f(1.0, "a call that runs longer is stopped and answered with an error (MiniMind: 1 s)", gt=0)


@dataclass
class AgentConfig:
    """Agentic tool-use RL (stage 'agent'): multi-turn GRPO/CISPO rollouts that call tools (train.grpo holds the loss,
    the group size, the sampling and max_gen_len, the limit of one turn)."""

    max_turns: int = _f(3, "model turns per trajectory: each may call tools, whose responses come back as the next "
                           "user turn; a trajectory still calling tools after the last is 'unfinished'", ge=1)
    max_total_len: int = _f(2500, "most tokens of a trajectory: prompt, every turn and every tool response (MiniMind's "
                                  "max_total_len); a trajectory that reaches it ends, unfinished", ge=2)
    tools: List[ToolConfig] = field(default_factory=lambda: [ToolConfig("calculate"), ToolConfig("calculate_math")],
                                    metadata={"help": "the tools calls are run with, by name; a record offers the model "
                                                      "its own list (its system message's tools), whose names must be "
                                                      "here to run"})
    max_tool_response_chars: int = _f(2048, "a tool's response is cut to this many characters (MiniMind's)", ge=16)
    reward_clip: Optional[float] = _f(3.0, "the total reward is clipped to [-reward_clip, reward_clip] (MiniMind: 3); "
                                           "None = no clip", gt=0)
    rewards: List[RewardConfig] = field(default_factory=lambda: [RewardConfig(n) for n in AGENT_REWARDS[:-1]],
                                        metadata={"help": "reward terms of a whole trajectory (rl/agent_rewards.py): "
                                                          "tool_tags | tool_calls | reply_format | gt_answer | "
                                                          "unfinished | repetition | reward_model, or "
                                                          "'module:function' called as fn(trajectories, **args); "
                                                          "default: MiniMind's terms without its reward model"})


def validate_agent(cfg) -> None:
    """The checks of train.agent (its stage record's validate runs them after GRPO's section's), naming the field."""
    a, d = cfg.train.agent, cfg.data
    need(a.max_total_len > d.max_seq_len, "train.agent.max_total_len",
         f"{a.max_total_len} leaves no room after a prompt of data.max_seq_len {d.max_seq_len}")
    need(a.max_total_len <= cfg.model.max_position_embeddings, "train.agent.max_total_len",
         f"{a.max_total_len} exceeds model.max_position_embeddings {cfg.model.max_position_embeddings}")
    names = [t.name for t in a.tools]
    need(len(set(names)) == len(names), "train.agent.tools", f"a tool name twice in {names}")
    for i, t in enumerate(a.tools):
        where = f"train.agent.tools[{i}]"
        if t.function is None:
            need(t.name in BUILTIN_TOOLS, f"{where}.function", f"{t.name!r} is no built-in tool "
                 f"({', '.join(BUILTIN_TOOLS)}): give its 'package.module:function' and schema")
        else:
            try:
                load_tool_function(t.function)
            except ValueError as e:
                raise ConfigError(f"{where}.function: {e}") from None
            need(bool(t.schema), f"{where}.schema", "a tool of your own needs its OpenAI function schema")
    need(bool(a.rewards), "train.agent.rewards", "no reward terms")
    for i, r in enumerate(a.rewards):
        where = f"train.agent.rewards[{i}]"
        need(r.name in AGENT_REWARDS or ":" in r.name, f"{where}.name",
             f"{r.name!r} is neither an agent reward ({', '.join(AGENT_REWARDS)}) nor 'module:function'")
        if r.name == "reward_model" or ":" in r.name:  # loads, as a GRPO term's would
            validate_reward_term(r, where)
