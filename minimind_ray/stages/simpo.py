"""SimPO (Meng, Xia and Chen, 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward"): a
preference loss on DPO's chosen/rejected pairs with no reference model. The implicit reward of a response is its
length-normalised log-likelihood times beta, and the chosen one must beat the rejected one by a margin gamma:

    loss = -log sigmoid(beta * (mean log p(chosen) - mean log p(rejected)) - gamma)

(means over each response's target tokens; ``train.simpo``). The worked example of docs/architecture.md, "Where to
add things": this module, stages/simpo_objective.py and one line of stages/__init__.py."""
from __future__ import annotations

from dataclasses import dataclass

from minimind_ray.config_checks import config_field as _f
from minimind_ray.stages.stage import MemoryTerms, Stage


@dataclass
class SimPOConfig:
    """Simple preference optimisation (stage 'simpo'); defaults are the paper's recommended range's middle."""

    beta: float = _f(2.0, "scale of the implicit reward, beta x the mean log-likelihood of a response", gt=0)
    gamma: float = _f(1.0, "target reward margin: the chosen response must beat the rejected one by this", ge=0)


def objective(cfg):
    from minimind_ray.stages.simpo_objective import SimPOObjective  # lazy: torch, when a run builds its state

    return SimPOObjective(cfg)


def memory(cfg, policy, count) -> MemoryTerms:
    return MemoryTerms(sequences=2)  # chosen and rejected in one forward; no reference model


STAGE = Stage("simpo", "SimPO: reference-free preference optimisation on chosen/rejected pairs", formats=("dpo",),
              objective=objective, export_prefix="simpo", section=SimPOConfig, memory=memory,
              headline=("reward_margin", "reward_accuracy"),
              fsdp_refusal="it is not run under FSDP yet (no test of it there)")
