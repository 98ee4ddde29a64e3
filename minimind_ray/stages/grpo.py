"""GRPO / CISPO (MiniMind's ``trainer/train_grpo.py``, d65ef2c, with the options of verl, TRL and DAPO; docs/rl.md):
sample ``num_generations`` completions of each prompt, score them with reward terms, reinforce the better ones
(``train.grpo``). One module, as every RL algorithm: its section and checks, its plan (which is its objective) and its
record, on the neutral RL toolkit of minimind_ray/rl/ (the plan base's group sampling, rl/advantages.py,
rl/losses.py, rl/logprobs.py):

    advantages()    the reward minus its group's mean (``advantage='rloo'``: the leave-one-out mean, RLOO's), over the
                    group's, the global batch's (one all-reduce of the rewards' sums) or no std
    passes          num_iterations passes, each of mini_batches optimizer updates over row slices of the rollouts
    loss_sum()      per token ``-(min(r A, clip(r, 1-eps, 1+eps_high) A) - beta KL)`` (grpo) or
                    ``-(sg(min(r, eps_high)) A log p - beta KL)`` (cispo), r = p / p_behaviour, KL Schulman's k1, k2 or
                    k3 (MiniMind's), aggregated by ``loss_agg``; the engine divides by the all-reduced loss units
    end_step()      kl_target: beta *= 1 + clip(KL / target - 1, -0.2, 0.2) / kl_horizon (Ziegler et al., verl)

The group policy's fields (:class:`GroupPolicyConfig`) are also the agent's (stages/agent.py). Light: torch is
imported where a run uses it, since the CLI and the config read the record.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional

from minimind_ray.config_checks import config_field as _f, need
from minimind_ray.data.config import PROMPT_FORMATS
from minimind_ray.rl.constraints import json_schema_field, validate_json_schema
from minimind_ray.rl.plan import Batch, GroupPlan, all_reduced
from minimind_ray.rl.rewards import RewardConfig, reward_terms_field, user_reward_names, validate_reward_terms
from minimind_ray.rl.rollout_config import RolloutConfig
from minimind_ray.stages.rl_stage import (RL_RECORD, need_no_held_out, need_room_for_completions,
                                          need_trained_policy)
from minimind_ray.stages.stage import MemoryTerms, Stage


@dataclass
class GroupPolicyConfig:
    """A group of completions per prompt and the GRPO/CISPO policy loss over them: GRPO's section and the agent's."""

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


@dataclass
class GRPOConfig(GroupPolicyConfig):
    """Group relative policy optimisation (stage 'grpo'); defaults are MiniMind's train_grpo.py (lr there: 3e-7)."""

    dynamic_sampling: int = _f(0, "DAPO's dynamic sampling: groups whose rewards are all equal are sampled again, up "
                                  "to this many rounds; those still equal are dropped from the loss (0 = off)", ge=0)
    mask_truncated: bool = _f(False, "completions that reach max_gen_len without an EOS carry no loss (TRL)")
    json_schema: Optional[str] = json_schema_field()
    # the rollout engine's keys before train.rollout: still read, into train.rollout (adopt_old_keys)
    rollout: str = _f("torch", "old name of train.rollout.engine ('torch' = worker, 'actors')")
    rollout_actors: int = _f(1, "old name of train.rollout.actors", ge=1)
    rollout_actor_cpus: float = _f(1.0, "old name of train.rollout.actor_cpus", gt=0)
    rollout_actor_gpus: float = _f(0.0, "old name of train.rollout.actor_gpus", ge=0)
    rollout_overlap: bool = _f(False, "old name of train.rollout.overlap")
    rewards: List[RewardConfig] = reward_terms_field(
        "reward terms, e.g. [{name: exact_answer}, {name: reward_model, path: DIR, weight: 0.5}]; "
                "default: MiniMind's rule rewards (length, think_format, repetition)")


def validate_group_policy(cfg, g: GroupPolicyConfig, where: str) -> None:
    """The checks of a group policy's fields, ``where``: its section (train.grpo, train.agent), naming the field."""
    need(g.num_generations >= 2, f"{where}.num_generations", "must be >= 2 (advantages compare a group's completions)")
    need(g.max_gen_len >= 1, f"{where}.max_gen_len", "must be >= 1")
    need_room_for_completions(cfg, where, g.max_gen_len)
    for name, ok, rule in (("temperature", g.temperature > 0, "> 0"), ("top_p", 0 < g.top_p <= 1, "in (0, 1]"),
                           ("top_k", g.top_k >= 0, ">= 0"), ("epsilon", 0 < g.epsilon < 1, "in (0, 1)"),
                           ("epsilon_high", g.epsilon_high > 0, "> 0"), ("beta", g.beta >= 0, ">= 0")):
        need(ok, f"{where}.{name}", f"must be {rule}")
    need(g.loss_type in ("cispo", "grpo"), f"{where}.loss_type", f"{g.loss_type!r} is not 'cispo' or 'grpo'")
    for name, value, allowed in (("kl_estimator", g.kl_estimator, ("k1", "k2", "k3")),
                                 ("advantage", g.advantage, ("grpo", "rloo")),
                                 ("scale_rewards", g.scale_rewards, ("group", "batch", "none")),
                                 ("loss_agg", g.loss_agg, ("seq-mean", "token-mean", "seq-sum-norm"))):
        need(value in allowed, f"{where}.{name}", f"{value!r} is not one of {allowed}")
    need(g.kl_target is None or g.beta > 0, f"{where}.kl_target", "the adaptive controller scales beta: beta > 0")
    need_no_held_out(cfg)


def validate(cfg) -> None:
    """The grpo stage's checks, naming the field."""
    validate_group_policy(cfg, cfg.train.grpo, "train.grpo")
    need_trained_policy(cfg, "GRPO")
    validate_reward_terms(cfg.train.grpo.rewards, "train.grpo.rewards")
    validate_json_schema(cfg.train.grpo.json_schema, "train.grpo.json_schema")


# train.grpo's keys from before train.rollout -> (the new key, how an old value reads in it)
OLD_KEYS = {"rollout": ("engine", lambda v: {"torch": "worker"}.get(v, v)), "rollout_actors": ("actors", None),
            "rollout_actor_cpus": ("actor_cpus", None), "rollout_actor_gpus": ("actor_gpus", None),
            "rollout_overlap": ("overlap", None)}


def adopt_old_keys(cfg) -> List[str]:
    """Move ``train.grpo.rollout*`` values a recipe or an override set (those that differ from their defaults) into
    ``train.rollout``; returns one notice per key moved. A new key set to something else as well is refused. The
    record runs it (its ``old_keys``), before the config is validated; the agent's moves them too (stages/agent.py)."""
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


# --------------------------------------------------------------------------- the plan and the record


class AdaptiveKL:
    """The KL weight: fixed, or moved toward ``target`` each step (Stateful: checkpoints hold it)."""

    def __init__(self, beta: float, target: Optional[float], horizon: int):
        self.beta, self.target, self.horizon = beta, target, horizon

    def update(self, kl: float, steps: int = 1) -> None:
        if self.target is None or not math.isfinite(kl):
            return
        error = max(-0.2, min(0.2, kl / self.target - 1.0))
        self.beta *= 1.0 + error * steps / self.horizon

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, sd: dict) -> None:
        self.beta = float(sd.get("beta", self.beta))


class GRPOPlan(GroupPlan):
    """GRPO / CISPO on the plan base: group advantages, the clipped or clamped loss with beta * KL, the adaptive KL
    controller (its beta is the plan's checkpointed state)."""

    def __init__(self, cfg, section):  # section: a GroupPolicyConfig (train.grpo; the agent's train.agent)
        super().__init__(cfg, section)
        self.g = self.section
        self.kl = AdaptiveKL(self.g.beta, self.g.kl_target, self.g.kl_horizon)

    @property
    def dynamic_rounds(self) -> int:
        return self.g.dynamic_sampling

    def advantages(self, state, out: List[Batch]) -> None:
        from minimind_ray.rl.advantages import group_advantages  # lazy: torch, when a run trains

        g = self.g
        batch_std = self._batch_std(out, state) if g.scale_rewards == "batch" else None
        for b in out:
            b["advantages"] = group_advantages(b["rewards"], g.num_generations, g.scale_rewards, g.advantage,
                                               batch_std)

    def step_metrics(self, first: Batch, scale: float, state) -> None:
        import torch

        first["metric_beta"] = torch.tensor(self.kl.beta * scale, dtype=torch.float64, device=state.device)

    @staticmethod
    def _batch_std(out: List[Batch], state) -> float:
        """The population std of every reward of the global batch (one all-reduce of count, sum, sum of squares)."""
        import torch

        r = torch.cat([b["rewards"].double() for b in out])
        stats = all_reduced(state, torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device),
                                                r.sum(), (r * r).sum()]))
        n, s, sq = (float(x) for x in stats)
        return math.sqrt(max(sq / n - (s / n) ** 2, 0.0))

    def weight(self, batch: Batch) -> int:
        from minimind_ray.rl.losses import loss_units  # lazy: torch, when a run trains

        return loss_units(batch["completion_mask"], self.g.loss_agg)

    def loss_sum(self, model, batch: Batch):
        """(the loss summed as ``loss_agg`` says at the controller's beta, MoE aux loss, metric sums). The per-update
        metrics (clip_fraction, kl, entropy) are scaled by 1 / num_iterations: summed over the step's passes, a
        mean."""
        from minimind_ray.rl.logprobs import completion_logprobs  # lazy: torch, when a run trains
        from minimind_ray.rl.losses import aggregate_loss, per_token_loss, sequence_mean  # lazy: torch

        g, mask, beta = self.g, batch["completion_mask"], self.kl.beta
        logp, aux, entropy = completion_logprobs(model, batch["input_ids"], batch["attention_mask"], mask.shape[1],
                                                 with_entropy=True)
        ref = batch.get("ref_logp")
        loss, clipped, kl = per_token_loss(logp, batch["old_logp"], ref, batch["advantages"], g.loss_type,
                                           g.epsilon, g.epsilon_high, beta, g.clip_high, g.kl_estimator)
        extras = {k[len("metric_"):]: v for k, v in batch.items() if k.startswith("metric_")}
        per_pass = 1.0 / g.num_iterations
        extras["clip_fraction"] = sequence_mean(clipped.float(), mask).sum() * per_pass
        extras["entropy"] = sequence_mean(entropy, mask).sum() * per_pass
        if ref is not None:
            extras["kl"] = sequence_mean(kl.detach(), mask).sum() * per_pass
        return aggregate_loss(loss, mask, g.loss_agg, g.max_gen_len), aux, extras

    def end_step(self, state, out) -> None:
        if self.g.kl_target is None or "kl" not in out.extras:
            return
        kl_sum = all_reduced(state, out.extras["kl"].double().clone())  # this rank's completions; metric_weight: all
        self.kl.update(float(kl_sum / out.metric_weight.clamp_min(1.0)))

    def state_dict(self) -> dict:
        return {"kl": self.kl.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kl"):
            self.kl.load_state_dict(sd["kl"])


def objective(cfg):
    return GRPOPlan(cfg, cfg.train.grpo)


def memory(cfg, policy, count) -> MemoryTerms:
    g = cfg.train.grpo
    return MemoryTerms(sequences=g.num_generations, extra_tokens=g.max_gen_len, frozen_models=1.0 if g.beta > 0 else 0.0,
                       batch_fields=("train.grpo.num_generations", "train.grpo.max_gen_len"))


def plugins(cfg) -> List[str]:
    return user_reward_names(cfg.train.grpo.rewards)


STAGE = Stage("grpo", "GRPO/CISPO: sample completions, score them with rewards, reinforce the better ones",
              formats=PROMPT_FORMATS, objective=objective, export_prefix="grpo", section=GRPOConfig,
              validate=validate, memory=memory, plugins=plugins, old_keys=adopt_old_keys,
              headline=("reward", "reward_exact_answer", "kl"), **RL_RECORD)
