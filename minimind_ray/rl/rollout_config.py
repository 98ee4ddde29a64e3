"""Where an RL stage's completions are generated (``train.rollout``): in each training worker, or on a pool of Ray
actors that generates for every rank (rl/actors.py). One section for every RL stage (GRPO, PPO, the agent), as
verl's rollout workers serve every algorithm. The old ``train.grpo.rollout*`` keys still work: :func:`adopt_old_keys`
moves them here, with a notice naming the new key."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List

from minimind_ray.config_checks import config_field as _f, need

ENGINES = ("worker", "actors")


@dataclass
class RolloutConfig:
    """The rollout engine of the RL stages (grpo, ppo, agent)."""

    engine: str = _f("worker", "'worker' = each training worker samples its own prompts (KV cache); 'actors' = a pool of "
                               "Ray actors generates for every rank, the workers only train")
    actors: int = _f(1, "actors: how many rollout actors", ge=1)
    actor_cpus: float = _f(1.0, "actors: CPUs per rollout actor (its torch threads)", gt=0)
    actor_gpus: float = _f(0.0, "actors: GPUs per rollout actor", ge=0)
    overlap: bool = _f(False, "actors: generate step t+1's rollouts from the weights before step t's update while that "
                              "update runs (one step off-policy; not across a checkpoint)")
    placement_timeout_s: float = _f(120.0, "actors: a pool the cluster cannot place within this fails the run, naming "
                                           "train.rollout.actors (a pending actor would wait for ever)", gt=0)


# train.grpo's keys from before train.rollout -> (the new key, how an old value reads in it)
OLD_KEYS = {"rollout": ("engine", lambda v: {"torch": "worker"}.get(v, v)), "rollout_actors": ("actors", None),
            "rollout_actor_cpus": ("actor_cpus", None), "rollout_actor_gpus": ("actor_gpus", None),
            "rollout_overlap": ("overlap", None)}


def adopt_old_keys(train) -> List[str]:
    """Move ``train.grpo.rollout*`` values a recipe or an override set (those that differ from their defaults) into
    ``train.rollout``; returns one notice per key moved. A new key set to something else as well is refused."""
    grpo_defaults = {f.name: f.default for f in dataclasses.fields(train.grpo)}
    new_defaults = RolloutConfig()
    notices = []
    need(train.grpo.rollout in ("torch", "actors"), "train.grpo.rollout",
         f"{train.grpo.rollout!r} is not one of ('torch', 'actors')")
    for old, (new, convert) in OLD_KEYS.items():
        value = getattr(train.grpo, old)
        if value == grpo_defaults[old]:
            continue
        value = convert(value) if convert else value
        current = getattr(train.rollout, new)
        need(current in (getattr(new_defaults, new), value), f"train.rollout.{new}",
             f"{current!r}, but the old train.grpo.{old} says {value!r}: set train.rollout.{new} only")
        setattr(train.rollout, new, value)
        notices.append(f"train.grpo.{old} is now train.rollout.{new} (read as train.rollout.{new}={value!r})")
    return notices


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
