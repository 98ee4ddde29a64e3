"""Agentic tool-use RL (MiniMind's ``trainer/train_agent.py``, d65ef2c): multi-turn GRPO/CISPO rollouts that call
tools and read their results (``train.agent``). One module, as every RL algorithm: its section (GRPO's group policy
fields, then its turns, tools and trajectory rewards) and checks, its plan (GRPO's, with multi-turn rollouts: its
objective) and its record, on the neutral RL toolkit of minimind_ray/rl/ (rl/turns.py, rl/tools.py,
rl/trajectory_rewards.py). Before issue 56 the agent read GRPO's section for its group, sampling and loss: those
``train.grpo.*`` keys are still read, into ``train.agent``, with a notice each; a run's identity hashes them under
their old names, so the same command finds a run made before.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from minimind_ray.config_checks import ConfigError, config_field as _f, need
from minimind_ray.rl.constraints import validate_tool_calls
from minimind_ray.rl.plan import Batch
from minimind_ray.rl.rewards import RewardConfig, user_reward_names, validate_reward_term
from minimind_ray.rl.tools import BUILTIN_TOOLS, load_tool_function
from minimind_ray.stages.grpo import GRPOConfig, GRPOPlan, GroupPolicyConfig, adopt_old_keys, validate_group_policy
from minimind_ray.stages.rl_stage import RL_RECORD, need_trained_policy
from minimind_ray.stages.stage import MemoryTerms, Stage

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
class AgentConfig(GroupPolicyConfig):
    """Agentic tool-use RL (stage 'agent'): multi-turn GRPO/CISPO rollouts that call tools; the group, the sampling,
    max_gen_len (the limit of one turn) and the policy loss are GRPO's fields (GroupPolicyConfig), with GRPO's
    defaults; what is the agent's own follows them."""

    mask_truncated: bool = _f(False, "trajectories that reach max_total_len unfinished carry no loss (TRL)")
    max_turns: int = _f(3, "model turns per trajectory: each may call tools, whose responses come back as the next "
                           "user turn; a trajectory still calling tools after the last is 'unfinished'", ge=1)
    max_total_len: int = _f(2500, "most tokens of a trajectory: prompt, every turn and every tool response (MiniMind's "
                                  "max_total_len); a trajectory that reaches it ends, unfinished", ge=2)
    tools: List[ToolConfig] = field(default_factory=lambda: [ToolConfig("calculate"), ToolConfig("calculate_math")],
                                    metadata={"help": "the tools calls are run with, by name; a record offers the model "
                                                      "its own list (its system message's tools), whose names must be "
                                                      "here to run"})
    max_tool_response_chars: int = _f(2048, "a tool's response is cut to this many characters (MiniMind's)", ge=16)
    constrain_tool_calls: bool = _f(False, "each turn is sampled under llguidance's mask to be an answer without "
                                           "<tool_call>, or calls of the tools above with arguments valid against "
                                           "their schemas (docs/rl.md, 'Constrained rollouts'); false = free sampling")
    reward_clip: Optional[float] = _f(3.0, "the total reward is clipped to [-reward_clip, reward_clip] (MiniMind: 3); "
                                           "None = no clip", gt=0)
    rewards: List[RewardConfig] = field(default_factory=lambda: [RewardConfig(n) for n in AGENT_REWARDS[:-1]],
                                        metadata={"help": "reward terms of a whole trajectory (rl/trajectory_rewards.py): "
                                                          "tool_tags | tool_calls | reply_format | gt_answer | "
                                                          "unfinished | repetition | reward_model, or "
                                                          "'module:function' called as fn(trajectories, **args); "
                                                          "default: MiniMind's terms without its reward model"})


# the fields the agent read from train.grpo before issue 56, now its own
FROM_GRPO = tuple(f.name for f in dataclasses.fields(GroupPolicyConfig)) + ("mask_truncated",)


def validate(cfg) -> None:
    """The agent stage's checks, naming the field: the group policy's (GRPO's, on train.agent), then its own."""
    a, d = cfg.train.agent, cfg.data
    validate_group_policy(cfg, a, "train.agent")
    need_trained_policy(cfg, "the agent", "a demo tool SFT run: train.init_from=runs/<run>")
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
    if a.constrain_tool_calls:
        validate_tool_calls(a.tools, "train.agent.constrain_tool_calls")
    need(bool(a.rewards), "train.agent.rewards", "no reward terms")
    for i, r in enumerate(a.rewards):
        where = f"train.agent.rewards[{i}]"
        need(r.name in AGENT_REWARDS or ":" in r.name, f"{where}.name",
             f"{r.name!r} is neither an agent reward ({', '.join(AGENT_REWARDS)}) nor 'module:function'")
        if r.name == "reward_model" or ":" in r.name:  # loads, as a GRPO term's would
            validate_reward_term(r, where)


def adopt_grpo_keys(cfg) -> List[str]:
    """``train.grpo.*`` values a recipe or an override set for the agent (those that differ from their defaults):
    GRPO's old rollout keys into ``train.rollout`` (GRPO's own move), the group policy's into ``train.agent``; each
    moved key is reset in train.grpo, which an agent run does not read. One notice per key; a new key set to something
    else as well is refused."""
    notices = adopt_old_keys(cfg)
    grpo, agent, defaults = cfg.train.grpo, cfg.train.agent, GRPOConfig()
    for name in ("rollout", "rollout_actors", "rollout_actor_cpus", "rollout_actor_gpus", "rollout_overlap"):
        setattr(grpo, name, getattr(defaults, name))
    for name in FROM_GRPO:
        value = getattr(grpo, name)
        if value == getattr(defaults, name):
            continue
        current = getattr(agent, name)
        need(current in (getattr(defaults, name), value), f"train.agent.{name}",
             f"{current!r}, but the old train.grpo.{name} says {value!r}: set train.agent.{name} only")
        setattr(agent, name, value)
        setattr(grpo, name, getattr(defaults, name))
        notices.append(f"train.grpo.{name} is now train.agent.{name} for the agent stage (read as "
                       f"train.agent.{name}={value!r})")
    return notices


# --------------------------------------------------------------------------- the plan and the record


class AgentPlan(GRPOPlan):
    """GRPO's plan (its advantages within each group, loss, adaptive KL and checkpointed state) with multi-turn
    tool-use rollouts (rl/turns.py) and the trajectory rewards (rl/trajectory_rewards.py) in place of single completions
    and their rewards: requests() are each micro-batch's first turns (what train.rollout.overlap sends to the actors
    during the previous step's update), score() generates the later turns (tools run in this worker) and scores the
    trajectories."""

    generate_together = False  # a trajectory's turns are generated one after another, in score()
    dynamic_rounds = 0  # no resampling of a group: a trajectory is too dear

    def __init__(self, cfg, section):  # section: an AgentConfig (train.agent)
        super().__init__(cfg, section)
        self.a, self.toolbox = section, None

    def grammar(self):
        """With constrain_tool_calls: an answer, or calls of train.agent.tools with valid arguments."""
        from minimind_ray.rl.constraints import tool_calls_grammar  # lazy: llguidance, when a run trains

        return tool_calls_grammar(self.a.tools) if self.a.constrain_tool_calls else None

    def build_rewards(self, device) -> list:
        from minimind_ray.rl.trajectory_rewards import build_agent_rewards  # lazy: torch, when a run builds its state

        return build_agent_rewards(self.a.rewards, device, run_name=self.cfg.name)

    def setup(self, model, device) -> None:
        from minimind_ray.rl.tools import ToolBox  # lazy: with the run's state

        super().setup(model, device)
        self.toolbox = ToolBox(self.a.tools, self.a.max_tool_response_chars)
        self.toolbox.load_user_tools()  # a tool of the user's that did not reach this worker fails here, named

    def requests(self, state, batches: List[Batch], step: int) -> list:
        from minimind_ray.rl.turns import first_turn_request  # lazy: torch, when a run trains

        return [first_turn_request(mb, params=self.params(), group_size=self.g.num_generations,
                                   max_total_len=self.a.max_total_len, seed=self.cfg.train.seed, step=step,
                                   device=state.device) for mb in batches]

    def score(self, state, mb: Batch, step: int, roll) -> Batch:
        """``roll``: the first turns' rollout when it was sent ahead; the turns are generated here otherwise."""
        import contextlib

        import torch

        from minimind_ray.rl.advantages import group_std  # lazy: torch, when a run trains
        from minimind_ray.rl.logprobs import completion_logprobs  # lazy: torch, when a run trains
        from minimind_ray.rl.trajectory_rewards import (answer_calls, final_answer, gt_found,  # lazy: when a run trains
                                                         score_trajectories)
        from minimind_ray.rl.turns import agent_rollout  # lazy: torch, when a run trains

        g, dev, reference = self.g, state.device, self.reference
        trajs, b = agent_rollout(mb, engine=self.engine, params=self.params(), group_size=g.num_generations,
                                 toolbox=self.toolbox, tokenizer=self.tokenizer, max_turns=self.a.max_turns,
                                 max_total_len=self.a.max_total_len, seed=self.cfg.train.seed, step=step, device=dev,
                                 first_turn=roll)
        total, per_term = score_trajectories(self.rewards, trajs, self.a.reward_clip)
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


def objective(cfg):
    return AgentPlan(cfg, cfg.train.agent)


def memory(cfg, policy, count) -> MemoryTerms:
    """num_generations trajectories per prompt, each up to max_total_len tokens (its turns and the tools' answers)."""
    a = cfg.train.agent
    return MemoryTerms(sequences=a.num_generations, extra_tokens=max(0, a.max_total_len - cfg.data.max_seq_len),
                       frozen_models=1.0 if a.beta > 0 else 0.0,
                       batch_fields=("train.agent.num_generations", "train.agent.max_total_len"))


def plugins(cfg) -> List[str]:
    """Its reward terms and the tools of its own that the user names (``package.module:function``)."""
    a = cfg.train.agent
    return user_reward_names(a.rewards) + [t.function for t in a.tools if t.function]


STAGE = Stage("agent", "agentic tool-use RL: multi-turn GRPO/CISPO rollouts that call tools and read their results",
              formats=("agent_rl",), objective=objective, export_prefix="agent", section=AgentConfig,
              validate=validate, memory=memory, plugins=plugins, old_keys=adopt_grpo_keys,
              identity_renames=tuple((f"train.agent.{n}", f"train.grpo.{n}") for n in FROM_GRPO),
              headline=("reward", "kl"), **RL_RECORD)
