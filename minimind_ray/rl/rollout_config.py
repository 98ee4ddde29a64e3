"""Where an RL stage's completions are generated (``train.rollout``): in each training worker, or on a pool of Ray
actors that generates for every rank (rl/actors.py). One section for every RL stage (GRPO, PPO, the agent), as
verl's rollout workers serve every algorithm. GRPO's old ``train.grpo.rollout*`` keys still work: its stage record moves
them here (stages/grpo.py:adopt_old_keys), with a notice naming the new key."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from minimind_ray.config_checks import config_field as _f, need

ENGINES = ("worker", "actors")


@dataclass
class RolloutConfig:
    """The rollout engine of every RL stage (a record with ``rl=True``)."""

    engine: str = _f("worker", "'worker' = each training worker samples its own prompts (KV cache); 'actors' = a pool of "
                               "Ray actors generates for every rank, the workers only train")
    actors: int = _f(1, "actors: how many rollout actors", ge=1)
    actor_cpus: float = _f(1.0, "actors: CPUs per rollout actor (its torch threads)", gt=0)
    actor_gpus: float = _f(0.0, "actors: GPUs per rollout actor", ge=0)
    overlap: bool = _f(False, "actors: generate step t+1's rollouts from the weights before step t's update while that "
                              "update runs (one step off-policy; not across a checkpoint)")
    prefix_cache_mb: float = _f(0.0, "MiB of prompt keys/values a sampler keeps so that prompts of one step that "
                                     "start alike (a system prompt, few-shot examples) compute their shared blocks "
                                     "once (a group's G samples share one prefill anyway); emptied at every weight "
                                     "update; 0 = off", ge=0)
    placement_timeout_s: float = _f(120.0, "actors: a pool the cluster cannot place within this fails the run, naming "
                                           "train.rollout.actors (a pending actor would wait for ever)", gt=0)


def validate_rollout(r: RolloutConfig) -> None:
    need(r.engine in ENGINES, "train.rollout.engine", f"{r.engine!r} is not one of {ENGINES}")
    need(not r.overlap or r.engine == "actors", "train.rollout.overlap",
         "overlaps generation with the update on a pool of actors: needs train.rollout.engine=actors")


def actor_resources(cfg) -> Dict[str, float]:
    """What the pool of rollout actors takes beside the workers (nothing when the workers generate)."""
    r = cfg.train.rollout
    if r.engine != "actors":
        return {}
    return {"CPU": r.actors * r.actor_cpus, "GPU": r.actors * r.actor_gpus}
