"""What every RL stage's record shares (stages/grpo.py, ppo.py, agent.py, rloo.py): the rollout engine's section
(``train.rollout``, rl/rollout_config.py), which the engine's config composes once for all of them, and what the pool
of rollout actors takes beside the workers, with the sentence that says what to change when the cluster cannot hold
it."""
from __future__ import annotations

from typing import Tuple

from minimind_ray.config_checks import need
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


# the checks every RL stage makes of its run, each naming the field (one wording for all of them)
def need_room_for_completions(cfg, where: str, max_gen_len: int) -> None:
    """A prompt of data.max_seq_len and a completion of ``where``.max_gen_len fit the model's positions."""
    d = cfg.data
    need(d.max_seq_len + max_gen_len <= cfg.model.max_position_embeddings, f"{where}.max_gen_len",
         f"data.max_seq_len {d.max_seq_len} + max_gen_len {max_gen_len} exceed model.max_position_embeddings "
         f"{cfg.model.max_position_embeddings}")


def need_no_held_out(cfg) -> None:
    need(cfg.data.eval_fraction == 0, "data.eval_fraction",
         f"must be 0 for {cfg.train.stage} (there is no held-out loss of sampled completions; measure rewards or "
         f"accuracy instead)")


def need_trained_policy(cfg, who: str, example: str = "a demo SFT run: train.init_from=runs/<demo-sft-run>") -> None:
    need(cfg.train.init_from is not None, "train.init_from", f"{who} improves a trained policy: give its weights "
                                                            f"(e.g. {example})")
