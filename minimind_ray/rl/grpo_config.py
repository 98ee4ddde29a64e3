"""GRPO's configuration (a TrainConfig's ``grpo`` section, also the agent stage's policy loss and sampling) and its
checks. Kept beside the rl room it configures; the grpo stage's record (stages/grpo.py) puts it in TrainConfig."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

from minimind_ray.config_checks import config_field as _f, need
from minimind_ray.rl.rewards import RewardConfig, validate_reward_terms
from minimind_ray.rl.rollout_config import RolloutConfig


@dataclass
class GRPOConfig:
    """Group relative policy optimisation (stage 'grpo'); defaults are MiniMind's train_grpo.py (lr there: 3e-7)."""

    num_generations: int = _f(6, "completions sampled per prompt: one group, whose rewards normalise each other")
    max_gen_len: int = _f(1024, "most new tokens per completion (one that reaches it counts in truncated_fraction)")
    temperature: float = _f(0.8, "sampling temperature of the rollouts")
    top_p: float = _f(1.0, "nucleus sampling: sample among the most likely tokens holding top_p of the mass (1 = off)")
    top_k: int = _f(0, "sample among the k most likely tokens only (0 = off)")
    loss_type: str = _f("cispo", "'cispo' (ratio clamped at epsilon_high, no gradient through it, times log p) or "
                                 "'grpo' (PPO-style ratio clipped to 1 +- epsilon)")
    epsilon: float = _f(0.2, "grpo: clip range of the probability ratio (below 1; above too unless clip_high)")
    clip_high: Optional[float] = _f(None, "grpo: the ratio's upper clip is 1 + clip_high (DAPO's clip-higher, e.g. "
                                          "0.28); None = epsilon", gt=0)
    epsilon_high: float = _f(5.0, "cispo: the ratio's upper clamp")
    beta: float = _f(0.1, "weight of the KL estimate to the frozen reference (a copy of the initial weights); "
                          "0 = no reference; the starting value when kl_target is set")
    kl_estimator: str = _f("k3", "KL(policy || reference) per token: k1 = log p - log ref, k2 = (log p - log ref)^2 / 2, "
                                 "k3 = exp(ref - log p) - (ref - log p) - 1 (Schulman's estimators; k3 is MiniMind's)")
    kl_target: Optional[float] = _f(None, "adaptive KL controller (Ziegler et al.): beta is moved each step toward "
                                          "keeping the KL at this value; None = a fixed beta", gt=0)
    kl_horizon: int = _f(100, "adaptive KL: steps over which beta may change by the controller's clipped error", ge=1)
    advantage: str = _f("grpo", "'grpo' (reward minus its group's mean) or 'rloo' (minus the mean of the group's "
                                "other completions, i.e. G/(G-1) times the former)")
    scale_rewards: str = _f("group", "divide advantages by the std of the 'group' (MiniMind, GRPO), of the whole "
                                     "global 'batch' (TRL), or 'none' (Dr. GRPO)")
    loss_agg: str = _f("seq-mean", "'seq-mean': each completion's token mean, then the mean over completions "
                                   "(MiniMind); 'token-mean': the mean over all completion tokens of the global batch "
                                   "(verl's default, DAPO); 'seq-sum-norm': token sums over max_gen_len, then the mean "
                                   "over completions (Dr. GRPO's constant normaliser)")
    num_iterations: int = _f(1, "optimizer passes over each batch of rollouts (TRL's num_iterations, verl's "
                                "ppo_epochs); from the second on, the ratio to the behaviour policy moves and the "
                                "clip acts", ge=1)
    mini_batches: int = _f(1, "optimizer steps per pass: the rollouts split into this many mini-batches", ge=1)
    dynamic_sampling: int = _f(0, "DAPO's dynamic sampling: groups whose rewards are all equal are sampled again, up "
                                  "to this many rounds; those still equal are dropped from the loss (0 = off)", ge=0)
    mask_truncated: bool = _f(False, "completions that reach max_gen_len without an EOS carry no loss (TRL)")
    # the rollout engine's keys before train.rollout: still read, into train.rollout (adopt_old_keys)
    rollout: str = _f("torch", "old name of train.rollout.engine ('torch' = worker, 'actors')")
    rollout_actors: int = _f(1, "old name of train.rollout.actors", ge=1)
    rollout_actor_cpus: float = _f(1.0, "old name of train.rollout.actor_cpus", gt=0)
    rollout_actor_gpus: float = _f(0.0, "old name of train.rollout.actor_gpus", ge=0)
    rollout_overlap: bool = _f(False, "old name of train.rollout.overlap")
    rewards: List[RewardConfig] = field(default_factory=lambda: [RewardConfig(n) for n in (
        "length", "think_format", "repetition")], metadata={
        "help": "reward terms, e.g. [{name: exact_answer}, {name: reward_model, path: DIR, weight: 0.5}]; "
                "default: MiniMind's rule rewards (length, think_format, repetition)"})


def validate_grpo(cfg) -> None:
    """The grpo stage's checks (its stage record's validate), naming the field."""
    g, d = cfg.train.grpo, cfg.data
    need(g.num_generations >= 2, "train.grpo.num_generations", "must be >= 2 (advantages compare a group's completions)")
    need(g.max_gen_len >= 1, "train.grpo.max_gen_len", "must be >= 1")
    need(d.max_seq_len + g.max_gen_len <= cfg.model.max_position_embeddings, "train.grpo.max_gen_len",
          f"data.max_seq_len {d.max_seq_len} + max_gen_len {g.max_gen_len} exceed model.max_position_embeddings "
          f"{cfg.model.max_position_embeddings}")
    for name, ok, rule in (("temperature", g.temperature > 0, "> 0"), ("top_p", 0 < g.top_p <= 1, "in (0, 1]"),
                           ("top_k", g.top_k >= 0, ">= 0"), ("epsilon", 0 < g.epsilon < 1, "in (0, 1)"),
                           ("epsilon_high", g.epsilon_high > 0, "> 0"), ("beta", g.beta >= 0, ">= 0")):
        need(ok, f"train.grpo.{name}", f"must be {rule}")
    need(g.loss_type in ("cispo", "grpo"), "train.grpo.loss_type", f"{g.loss_type!r} is not 'cispo' or 'grpo'")
    for name, value, allowed in (("kl_estimator", g.kl_estimator, ("k1", "k2", "k3")),
                                 ("advantage", g.advantage, ("grpo", "rloo")),
                                 ("scale_rewards", g.scale_rewards, ("group", "batch", "none")),
                                 ("loss_agg", g.loss_agg, ("seq-mean", "token-mean", "seq-sum-norm"))):
        need(value in allowed, f"train.grpo.{name}", f"{value!r} is not one of {allowed}")
    need(g.kl_target is None or g.beta > 0, "train.grpo.kl_target", "the adaptive controller scales beta: beta > 0")
    need(d.eval_fraction == 0, "data.eval_fraction", "must be 0 for grpo (there is no held-out loss of sampled "
                                                      "completions; measure rewards or accuracy instead)")
    need(cfg.train.init_from is not None, "train.init_from", "GRPO improves a trained policy: give its weights "
                                                            "(e.g. a demo SFT run: train.init_from=runs/<demo-sft-run>)")
    validate_reward_terms(g.rewards, "train.grpo.rewards")


# train.grpo's keys from before train.rollout -> (the new key, how an old value reads in it)
OLD_KEYS = {"rollout": ("engine", lambda v: {"torch": "worker"}.get(v, v)), "rollout_actors": ("actors", None),
            "rollout_actor_cpus": ("actor_cpus", None), "rollout_actor_gpus": ("actor_gpus", None),
            "rollout_overlap": ("overlap", None)}


def adopt_old_keys(cfg) -> List[str]:
    """Move ``train.grpo.rollout*`` values a recipe or an override set (those that differ from their defaults) into
    ``train.rollout``; returns one notice per key moved. A new key set to something else as well is refused. The
    record of each stage that reads train.grpo runs it (its ``old_keys``), before the config is validated."""
    grpo, rollout = cfg.train.grpo, cfg.train.rollout
    grpo_defaults = {f.name: f.default for f in dataclasses.fields(grpo)}
    new_defaults = RolloutConfig()
    notices = []
    need(grpo.rollout in ("torch", "actors"), "train.grpo.rollout", f"{grpo.rollout!r} is not one of ('torch', 'actors')")
    for old, (new, convert) in OLD_KEYS.items():
        value = getattr(grpo, old)
        if value == grpo_defaults[old]:
            continue
        value = convert(value) if convert else value
        current = getattr(rollout, new)
        need(current in (getattr(new_defaults, new), value), f"train.rollout.{new}",
             f"{current!r}, but the old train.grpo.{old} says {value!r}: set train.rollout.{new} only")
        setattr(rollout, new, value)
        notices.append(f"train.grpo.{old} is now train.rollout.{new} (read as train.rollout.{new}={value!r})")
    return notices
