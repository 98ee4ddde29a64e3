"""One PPO step's plan, on the plan base (rl/plan.py: the step's skeleton, the rollout engine of train.rollout, in
the worker or on a pool of actors, the reference and the reward terms); the math is in rl/ppo.py.

    build()         the plan base's, and the critic: a value head on a copy of the initial policy, a trained part
    requests()      one completion per prompt from the current policy (its own seed, rollout.row_seeds)
    score()         the reward terms' sum, the behaviour and reference log-probs, the critic's values, per-token
                    rewards, GAE
    advantages()    whitened over the global batch's tokens
    passes          ppo_update_iters passes, each of mini_batches optimizer updates over row slices of the rollouts
    loss_sum()      policy + kl_coef * KL + vf_coef * value loss, summed over the update's completion tokens (the
                    engine divides by their all-reduced count: MiniMind's token means, at any world size)
    keep_update()   the update's approximate KL, all-reduced; above early_stop_kl this update and the rest are dropped
    end_step()      the applied updates' means of each loss term, as metrics
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import Tensor

from minimind_ray.rl.grpo import completion_logprobs, eos_mask, score_rollouts, sequence_mean
from minimind_ray.rl.plan import RolloutPlan, all_reduced
from minimind_ray.rl.ppo import CriticModel, gae, ppo_token_losses, token_rewards, whiten
from minimind_ray.rl.rollout import row_seeds

Batch = Dict[str, Tensor]
TERMS = ("policy_loss", "value_loss", "kl", "approx_kl", "clip_fraction")  # summed per update, in this order


class PPOPlan(RolloutPlan):
    def __init__(self, cfg, section):  # section: a PPOConfig (train.ppo)
        super().__init__(cfg, section)
        self.p = self.section
        self.critic = self.critic_forward = None  # the critic, and what loss_sum runs it through (its DDP wrapper)
        self._update = None  # this update's sums (TERMS, tokens), this rank
        self._applied = torch.zeros(len(TERMS) + 1, dtype=torch.float64)  # the step's applied updates, all ranks
        self._updates, self._stopped = 0, False

    @property
    def kl_weight(self) -> float:
        return self.p.kl_coef

    @property
    def passes(self) -> int:
        return self.p.ppo_update_iters

    def build(self, model, device) -> None:
        super().build(model, device)
        self.critic = self.critic_forward = CriticModel(model, seed=self.cfg.train.seed)

    def trained_parts(self) -> dict:
        return {"critic": (self.critic, self.p.critic_lr)}

    def bind_parts(self, forward_modules: dict) -> None:
        self.critic_forward = forward_modules["critic"]

    def requests(self, state, batches: List[Batch], step: int) -> list:
        dev = state.device
        return [(mb["prompt_ids"].to(dev), mb["prompt_mask"].to(dev), self.params(),
                 row_seeds(self.cfg.train.seed, step, mb["sample_ids"], 1).to(dev)) for mb in batches]

    def score(self, state, mb: Batch, step: int, roll) -> Batch:
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
        if self.p.whiten_advantages:
            mean, var = self._global_moments(out, state)
            for b in out:
                b["advantages"] = whiten(b["advantages"], b["completion_mask"], mean, var)

    @staticmethod
    def _global_moments(out: List[Batch], state):
        """Mean and population variance of every completion token's advantage in the global batch (one all-reduce)."""
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
