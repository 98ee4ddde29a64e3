"""What every RL stage's record shares (stages/grpo.py, ppo.py, agent.py, rloo.py): the rollout engine's section
(``train.rollout``, rl/rollout_config.py), which the engine's config composes once for all of them, and what the pool
of rollout actors takes beside the workers, with the sentence that says what to change when the cluster cannot hold
it."""
from __future__ import annotations

from typing import Tuple

from minimind_ray.rl.rollout_config import RolloutConfig, actor_resources, validate_rollout
from minimind_ray.stages.stage import Section

ROLLOUT = Section("rollout", RolloutConfig, validate_rollout)


def actors_shortfall(cfg) -> Tuple[str, str, str]:
    """The cluster holds the workers but not the rollout actors beside them: (the field, what it lacks, what to
    change)."""
    r = cfg.train.rollout
    return ("train.rollout.actors", f"{r.actors} rollout actor(s) of {r.actor_cpus:g} CPU / {r.actor_gpus:g} GPU",
            "Lower train.rollout.actors or actor_cpus/actor_gpus, use train.rollout.engine=worker, or add nodes.")


# the fields every RL record sets alike
RL_RECORD = dict(shares=(ROLLOUT,), beside=actor_resources, beside_shortfall=actors_shortfall, metric_group="rl",
                 rl=True, fsdp_refusal="its rollouts sample from the policy on each worker alone, which a sharded "
                                       "policy cannot do")
