"""PPO with a critic, as MiniMind's ``trainer/train_ppo.py`` (d65ef2c) defines it, in the pieces PPO's plan
(rl/ppo_step.py:PPOPlan) calls; written anew (docs/rl.md):

* :class:`CriticModel`: MiniMind's critic, a value head on a copy of the policy, with MiniMind's state-dict keys;
* :func:`token_rewards`: each completion's reward on its last token (through its EOS), and, with
  ``kl_penalty: reward``, minus ``kl_coef * (log p - log ref)`` on every token;
* :func:`gae`: generalised advantage estimation (gamma, lambda) and the returns the critic regresses to;
* :func:`ppo_token_losses`: per token, the clipped policy loss ``max(-A r, -A clip(r, 1 - eps, 1 + eps))``, the k3 KL
  to the reference (``kl_penalty: loss``, MiniMind's), the clipped value loss
  ``0.5 max((V - R)^2, (clip(V, V_old +- cliprange_value) - R)^2)``, the approximate KL ``(log r)^2 / 2`` that stops
  the step's updates early, and which ratios were clipped.

The step itself (rollouts, whitening, passes and mini-batches, early stop) is :class:`minimind_ray.rl.ppo_step.PPOPlan`.
"""
from __future__ import annotations

import copy
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from minimind_ray.model.minimind import attention_mask_for, unwrap_model
from minimind_ray.rl.grpo import k3_kl


class CriticModel(nn.Module):
    """MiniMind's ``CriticModel``: the policy's trunk (``model.*``, copied from the policy's initial weights), its
    ``lm_head`` kept but not used, and ``value_head = nn.Linear(hidden_size, 1)``, so its state dict loads into
    MiniMind's class with ``strict=True``. As there, the value is read from the trunk's output normed once more
    (MiniMind's ``MiniMindModel`` returns normed hidden states and its critic applies ``model.norm`` again); kept
    so that a critic computes the same values in both projects. The value head is initialised from ``seed`` alone
    (``nn.Linear``'s default init), leaving the global RNG where it was."""

    def __init__(self, policy: nn.Module, seed: int):
        super().__init__()

        body = copy.deepcopy(unwrap_model(policy))  # keeps the tie of embed_tokens and lm_head inside the copy
        self.cfg = body.cfg
        self.model, self.lm_head = body.model, body.lm_head
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.value_head = nn.Linear(self.cfg.hidden_size, 1, device=self.lm_head.weight.device)
        for p in self.parameters():
            p.requires_grad_(True)
        if not self.cfg.tie_word_embeddings:  # an unused parameter would stall DDP's gradient reduction
            self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """The value estimate at every position (B, T), float32: the expected reward to come after the token there."""
        m, T = self.model, input_ids.shape[1]
        if T > m.freqs_cos.shape[0]:
            raise ValueError(f"sequence of {T} tokens exceeds max_position_embeddings={m.freqs_cos.shape[0]}")
        mask = attention_mask_for(T, attention_mask, input_ids.device)
        x = m.dropout(m.embed_tokens(input_ids))
        for layer in m.layers:  # the causal LM's trunk (MiniMindForCausalLM.forward) without the lm_head
            x, _ = layer(x, m.freqs_cos[:T], m.freqs_sin[:T], mask)
        return self.value_head(m.norm(m.norm(x))).squeeze(-1).float()


def token_rewards(scores: Tensor, mask: Tensor, kl: Optional[Tensor] = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards (N, R): each completion's score (N,) on its last token under ``mask`` (a prefix through
    the EOS), and ``-kl_coef * kl`` on every token when ``kl`` (N, R) is given; 0 outside the mask."""
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    last = (mask.sum(dim=1).long() - 1).clamp_min(0)
    rows = torch.arange(mask.shape[0], device=mask.device)
    has = mask.sum(dim=1) > 0
    rewards[rows[has], last[has]] = scores.float()[has]
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.float() * mask
    return rewards * mask


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float):
    """(advantages, returns), each (N, R): delta_t = r_t + gamma V_{t+1} - V_t with V = 0 after a completion's last
    token, A_t = delta_t + gamma lam A_{t+1}, returns = A + V (MiniMind's loop, one column at a time)."""
    values, rewards = values.float() * mask, rewards.float() * mask
    R = values.shape[1]
    last = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(R)):
        next_value = values[:, t + 1] if t < R - 1 else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    advantages = torch.stack(out[::-1], dim=1) * mask
    return advantages, advantages + values


def whiten(advantages: Tensor, mask: Tensor, mean: float, var: float) -> Tensor:
    """Advantages to mean 0 and variance 1 by statistics of the whole global batch (MiniMind: of its batch)."""
    return (advantages - mean) * (var + 1e-8) ** -0.5 * mask


def ppo_token_losses(logp: Tensor, old_logp: Tensor, ref_logp: Optional[Tensor], advantages: Tensor, values: Tensor,
                     old_values: Tensor, returns: Tensor, clip_epsilon: float, cliprange_value: float
                     ) -> Dict[str, Tensor]:
    """Each term per token (N, R): ``policy``, ``kl`` (k3 to the reference, 0 without one), ``value``,
    ``approx_kl`` and ``clipped`` (|r - 1| > clip_epsilon, MiniMind's clipfrac)."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    policy = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon))
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    value = 0.5 * torch.max((values - returns) ** 2, (clipped_values - returns) ** 2)
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    return {"policy": policy, "kl": kl, "value": value, "approx_kl": 0.5 * log_ratio.detach() ** 2,
            "clipped": ((ratio.detach() - 1.0).abs() > clip_epsilon).float()}
