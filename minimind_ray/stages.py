"""The one registry of training stages and data formats.

Config validation, the objectives, the export file names and the CLI verbs all read this
table; adding a stage means adding a row here and its objective class in
``minimind_ray/engine/objectives.py``. No heavy imports: the CLI reads it for ``--help``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

# Record formats of the data pipeline (minimind_ray/data/formats.py says what each holds).
FORMATS: Tuple[str, ...] = ("pretrain", "sft", "dpo", "rlaif", "prompt", "agent_rl")
# Formats that hold prompts to sample completions for (RL), not text to imitate.
RL_FORMATS: Tuple[str, ...] = ("rlaif", "prompt", "agent_rl")
PROMPT_FORMATS: Tuple[str, ...] = ("rlaif", "prompt")  # single-turn prompts (grpo, ppo)


@dataclass(frozen=True)
class Stage:
    name: str
    formats: Tuple[str, ...]  # data formats this stage trains on
    objective: str  # class name in minimind_ray.engine.objectives
    export_prefix: str  # MiniMind's file-name prefix for the weights (its trainers' naming)
    help: str
    parts: Tuple[Tuple[str, str], ...] = ()  # (model trained beside the policy, MiniMind's file-name prefix for it)


STAGES: Dict[str, Stage] = {s.name: s for s in (
    Stage("pretrain", ("pretrain",), "Objective", "pretrain", "next-token pretraining on raw text"),
    Stage("sft", ("sft",), "SFTObjective", "full_sft", "full supervised fine-tuning on conversations"),
    Stage("lora", ("sft", "pretrain"), "LoRAObjective", "full_sft", "LoRA adapters on a frozen base"),
    Stage("dpo", ("dpo",), "DPOObjective", "dpo", "direct preference optimisation on chosen/rejected pairs"),
    Stage("distill", ("sft", "pretrain"), "DistillObjective", "full_dist", "distillation from a frozen teacher"),
    Stage("grpo", PROMPT_FORMATS, "GRPOObjective", "grpo", "GRPO/CISPO: sample completions, score them with "
          "rewards, reinforce the better ones"),
    Stage("ppo", PROMPT_FORMATS, "PPOObjective", "ppo_actor", "PPO: an actor and a critic, GAE advantages of the "
          "rewards, clipped policy and value losses", parts=(("critic", "ppo_critic"),)),
    Stage("agent", ("agent_rl",), "AgentObjective", "agent", "agentic tool-use RL: multi-turn GRPO/CISPO rollouts "
          "that call tools and read their results"),
)}
STAGE_NAMES: Tuple[str, ...] = tuple(STAGES)


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        raise KeyError(f"unknown stage {name!r}; one of {STAGE_NAMES}")
    return STAGES[name]
