"""PPO with a critic, as MiniMind's ``trainer/train_ppo.py`` (d65ef2c) defines it, written anew (docs/rl.md): GAE
advantages of the rewards, clipped policy and value losses (``train.ppo``). One module, as every RL algorithm: its
section and checks, its plan (which is its objective) and its record, on the neutral RL toolkit of minimind_ray/rl/
(the plan base, rl/critic.py, rl/advantages.py: token_rewards, gae, whiten; rl/losses.py: ppo_token_losses):

    setup()         the plan base's, and the critic: a value head on a copy of the initial policy, a trained part
    requests()      one completion per prompt from the current policy (its own seed, rollout.row_seeds)
    score()         the reward terms' sum, the behaviour and reference log-probs, the critic's values, per-token
                    rewards, GAE
    advantages()    whitened over the global batch's tokens
    passes          ppo_update_iters passes, each of mini_batches optimizer updates over row slices of the rollouts
    loss_sum()      policy + kl_coef * KL + vf_coef * value loss, summed over the update's completion tokens (the
                    engine divides by their all-reduced count: MiniMind's token means, at any world size)
    keep_update()   the update's approximate KL, all-reduced; above early_stop_kl this update and the rest are dropped
    end_step()      the applied updates' means of each loss term, as metrics

Light: torch is imported where a run uses it, since the CLI and the config read the record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from minimind_ray.config_checks import config_field as _f, need
from minimind_ray.data.config import PROMPT_FORMATS
from minimind_ray.rl.constraints import json_schema_field, validate_json_schema
from minimind_ray.rl.plan import Batch, RolloutPlan, all_reduced
from minimind_ray.rl.rewards import RewardConfig, reward_terms_field, user_reward_names, validate_reward_terms
from minimind_ray.stages.rl_stage import (RL_RECORD, need_no_held_out, need_room_for_completions,
                                          need_trained_policy)
from minimind_ray.stages.stage import MemoryTerms, Stage


@dataclass
class PPOConfig:
    """Proximal policy optimisation with a critic (stage 'ppo'); the actor's lr is train.lr (MiniMind: 3e-7)."""

    max_gen_len: int = _f(1024, "most new tokens per completion (one per prompt, as MiniMind samples)", ge=1)
    temperature: float = _f(0.8, "sampling temperature of the rollouts", gt=0)
    top_p: float = _f(1.0, "nucleus sampling mass (1 = off)", gt=0, le=1)
    top_k: int = _f(0, "sample among the k most likely tokens (0 = off)", ge=0)
    critic_lr: float = _f(5e-7, "peak lr of the critic (a value head on a copy of the policy); same schedule as "
                                "train.lr", gt=0)
    clip_epsilon: float = _f(0.2, "clip range of the probability ratio in the policy loss", gt=0, lt=1)
    vf_coef: float = _f(0.5, "weight of the value loss in the combined loss", ge=0)
    cliprange_value: float = _f(0.2, "a new value estimate may move this far from the rollout's before the clipped "
                                     "value loss takes over", gt=0)
    kl_coef: float = _f(0.02, "weight of the KL to the frozen reference (a copy of the initial weights); 0 = none",
                        ge=0)
    kl_penalty: str = _f("loss", "where the KL goes: 'loss' = k3 estimate added to the policy loss (MiniMind); "
                                 "'reward' = -kl_coef * (log p - log ref) on each token's reward before GAE "
                                 "(Ziegler et al., TRL, verl)")
    gamma: float = _f(1.0, "GAE discount", ge=0, le=1)
    lam: float = _f(0.95, "GAE lambda", ge=0, le=1)
    whiten_advantages: bool = _f(True, "advantages to mean 0, variance 1 over the global batch's tokens (MiniMind)")
    ppo_update_iters: int = _f(2, "passes over each batch of rollouts", ge=1)
    mini_batches: int = _f(1, "optimizer updates per pass: the rollouts split into this many mini-batches "
                              "(MiniMind: batch_size / mini_batch_size, 2 / 2)", ge=1)
    early_stop_kl: Optional[float] = _f(0.25, "an update whose approximate KL to the rollout policy (mean of "
                                              "(log p - log p_old)^2 / 2 over its tokens) exceeds this is dropped, "
                                              "with every later update of the step; None = never", gt=0)
    json_schema: Optional[str] = json_schema_field()
    rewards: List[RewardConfig] = reward_terms_field(
        "reward terms (docs/rl.md: a rule's name, 'module:function' or reward_model); the sum is the "
                "reward of a completion's last token. Default: MiniMind's rules; its recipe adds its reward model")


def validate(cfg) -> None:
    """The ppo stage's checks (its stage record's validate), naming the field."""
    p = cfg.train.ppo
    need_room_for_completions(cfg, "train.ppo", p.max_gen_len)
    need(p.kl_penalty in ("loss", "reward"), "train.ppo.kl_penalty", f"{p.kl_penalty!r} is not 'loss' or 'reward'")
    need_no_held_out(cfg)
    need_trained_policy(cfg, "PPO")
    validate_reward_terms(p.rewards, "train.ppo.rewards")
    validate_json_schema(p.json_schema, "train.ppo.json_schema")


# --------------------------------------------------------------------------- the plan and the record


TERMS = ("policy_loss", "value_loss", "kl", "approx_kl", "clip_fraction")  # summed per update, in this order


class PPOPlan(RolloutPlan):
    """PPO on the plan base: one completion per prompt, the critic trained beside the policy, GAE, the early stop."""

    kl_field, passes_field = "kl_coef", "ppo_update_iters"

    def __init__(self, cfg, section):  # section: a PPOConfig (train.ppo)
        import torch

        super().__init__(cfg, section)
        self.p = self.section
        self.critic = self.critic_forward = None  # the critic, and what loss_sum runs it through (its DDP wrapper)
        self._update = None  # this update's sums (TERMS, tokens), this rank
        self._applied = torch.zeros(len(TERMS) + 1, dtype=torch.float64)  # the step's applied updates, all ranks
        self._updates, self._stopped = 0, False

    def setup(self, model, device) -> None:
        from minimind_ray.rl.critic import CriticModel  # lazy: torch, when a run trains

        super().setup(model, device)
        self.critic = self.critic_forward = CriticModel(model, seed=self.cfg.train.seed)

    def trained_parts(self) -> dict:
        return {"critic": (self.critic, self.p.critic_lr)}

    def bind_parts(self, forward_modules: dict) -> None:
        self.critic_forward = forward_modules["critic"]

    def requests(self, state, batches: List[Batch], step: int) -> list:
        from minimind_ray.rl.rollout import row_seeds  # lazy: torch, when a run trains

        dev = state.device
        return [(mb["prompt_ids"].to(dev), mb["prompt_mask"].to(dev), self.params(),
                 row_seeds(self.cfg.train.seed, step, mb["sample_ids"], 1).to(dev)) for mb in batches]

    def score(self, state, mb: Batch, step: int, roll) -> Batch:
        import torch

        from minimind_ray.rl.advantages import gae, token_rewards  # lazy: torch, when a run trains
        from minimind_ray.rl.completions import score_rollouts  # lazy: torch, when a run trains
        from minimind_ray.rl.logprobs import completion_logprobs, eos_mask  # lazy: torch, when a run trains
        from minimind_ray.rl.losses import sequence_mean  # lazy: torch, when a run trains

        p, dev, reference = self.p, state.device, self.reference
        prompt_ids, prompt_mask = mb["prompt_ids"].to(dev), mb["prompt_mask"].to(dev)
        ids = roll.completion_ids
        mask = eos_mask(ids, self.tokenizer.eos_id, roll.completion_mask)
        scores, per_term = score_rollouts(self.tokenizer, self.rewards, mb, ids, mask, 1)
        b = {"input_ids": torch.cat([prompt_ids, ids], dim=1),
             "attention_mask": torch.cat([prompt_mask.long(), mask.long()], dim=1),
             "completion_mask": mask, "old_logp": roll.logprobs.float() * mask}
        R = mask.shape[1]
        with torch.no_grad(), state.autocast():
            if reference is not None:
                b["ref_logp"] = completion_logprobs(reference, b["input_ids"], b["attention_mask"], R)[0] * mask
            b["old_values"] = self.critic(b["input_ids"], b["attention_mask"])[:, -R - 1:-1].float() * mask
        kl = b["old_logp"] - b["ref_logp"] if p.kl_penalty == "reward" and reference is not None else None
        b["advantages"], b["returns"] = gae(token_rewards(scores, mask, kl, p.kl_coef), b["old_values"], mask,
                                            p.gamma, p.lam)
        metrics = {"reward": scores.sum(), "completion_len": mask.sum(), "truncated_fraction": roll.truncated.sum(),
                   "value": sequence_mean(b["old_values"], mask).sum(),
                   "returns": sequence_mean(b["returns"], mask).sum()}
        metrics.update({f"reward_{k}": v.sum() for k, v in per_term.items()})
        b.update({f"metric_{k}": v.double() for k, v in metrics.items()})
        return b

    def advantages(self, state, out: List[Batch]) -> None:
        """GAE's advantages (score) whitened over the global batch's tokens."""
        from minimind_ray.rl.advantages import whiten  # lazy: torch, when a run trains

        if self.p.whiten_advantages:
            mean, var = self._global_moments(out, state)
            for b in out:
                b["advantages"] = whiten(b["advantages"], b["completion_mask"], mean, var)

    @staticmethod
    def _global_moments(out: List[Batch], state):
        """Mean and population variance of every completion token's advantage in the global batch (one all-reduce)."""
        import torch

        stats = torch.zeros(3, dtype=torch.float64, device=state.device)
        for b in out:
            a, m = b["advantages"].double(), b["completion_mask"].double()
            stats += torch.stack([m.sum(), (a * m).sum(), (a * a * m).sum()])
        n, s, sq = (float(x) for x in all_reduced(state, stats))
        mean = s / max(n, 1.0)
        return mean, max(sq / max(n, 1.0) - mean * mean, 0.0)

    def weight(self, batch: Batch) -> int:
        return int(batch["completion_mask"].sum())  # MiniMind's losses are means over the completion tokens

    def loss_sum(self, model, batch: Batch):
        import torch

        from minimind_ray.rl.logprobs import completion_logprobs  # lazy: torch, when a run trains
        from minimind_ray.rl.losses import ppo_token_losses  # lazy: torch, when a run trains

        p, mask = self.p, batch["completion_mask"]
        R = mask.shape[1]
        logp, aux = completion_logprobs(model, batch["input_ids"], batch["attention_mask"], R)
        values = self.critic_forward(batch["input_ids"], batch["attention_mask"])[:, -R - 1:-1]
        t = ppo_token_losses(logp, batch["old_logp"], batch.get("ref_logp"), batch["advantages"], values,
                             batch["old_values"], batch["returns"], p.clip_epsilon, p.cliprange_value)
        kl_weight = p.kl_coef if p.kl_penalty == "loss" else 0.0  # kl_penalty: reward put it into the rewards
        per_token = t["policy"] + kl_weight * t["kl"] + p.vf_coef * t["value"]
        sums = torch.stack([(t[k] * mask).sum().detach() for k in ("policy", "value", "kl", "approx_kl", "clipped")]
                           + [mask.sum()]).double()
        self._update = sums if self._update is None else self._update + sums
        extras = {k[len("metric_"):]: v for k, v in batch.items() if k.startswith("metric_")}
        return (per_token * mask).sum(), aux, extras

    def keep_update(self, state) -> bool:
        import torch

        sums, self._update = self._update, None
        if sums is None:
            sums = torch.zeros(len(TERMS) + 1, dtype=torch.float64, device=state.device)
        sums = all_reduced(state, sums).cpu()
        approx_kl = float(sums[3] / sums[-1].clamp_min(1.0))
        if self.p.early_stop_kl is not None and approx_kl > self.p.early_stop_kl:
            self._stopped = True
            return False
        self._applied += sums
        self._updates += 1
        return True

    def end_step(self, state, out) -> None:
        """The applied updates' token means of each loss term, as metric sums the interval meter averages over
        completions (each rank adds its share of the step's completions)."""
        import torch

        share = float(out.metric_weight) / state.world
        means = self._applied[:-1] / self._applied[-1].clamp_min(1.0)
        values = dict(zip(TERMS, means.tolist()))
        if self.p.kl_coef == 0:
            values.pop("kl")
        values.update(updates=float(self._updates), early_stopped=float(self._stopped))
        for k, v in values.items():
            out.extras[k] = torch.tensor(v * share, dtype=torch.float64, device=state.device)
        self._applied.zero_()
        self._updates, self._stopped = 0, False


def objective(cfg):
    return PPOPlan(cfg, cfg.train.ppo)


def memory(cfg, policy, count) -> MemoryTerms:
    """One completion per prompt; the critic (a copy of the policy with a value head) trains beside it; the reference
    when kl_coef > 0."""
    p = cfg.train.ppo
    return MemoryTerms(extra_tokens=p.max_gen_len, frozen_models=1.0 if p.kl_coef > 0 else 0.0, trained_models=1.0,
                       batch_fields=("train.ppo.max_gen_len",))


def plugins(cfg) -> List[str]:
    return user_reward_names(cfg.train.ppo.rewards)


STAGE = Stage("ppo", "PPO: an actor and a critic, GAE advantages of the rewards, clipped policy and value losses",
              formats=PROMPT_FORMATS, objective=objective, export_prefix="ppo_actor", parts=(("critic", "ppo_critic"),),
              section=PPOConfig, validate=validate, memory=memory, plugins=plugins, headline=("reward", "kl"),
              **dict(RL_RECORD, fsdp_refusal=RL_RECORD["fsdp_refusal"] + ", and its critic has a DDP wrapper of its "
                                                                         "own"))
