"""Policy losses and KL estimates, per token, the same for every RL algorithm that asks for them (docs/rl.md):
Schulman's k1/k2/k3 estimates of KL(policy || reference); the clipped (GRPO, PPO-style) or clamped (CISPO) policy
loss with beta times the KL; PPO's clipped policy and value losses; and how a micro-batch's per-token losses add up to
its share of the step's loss (``seq-mean``, ``token-mean``, ``seq-sum-norm``) and over how many units the engine
divides it. Tensors in, tensors out."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(policy || reference) per token: exp(d) - d - 1 with d = ref - logp (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """KL(policy || reference) per token by Schulman's k1 (log p - log ref, unbiased, may be negative), k2
    ((log p - log ref)^2 / 2) or k3 (:func:`k3_kl`) estimator, on tokens sampled from the policy."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if estimator == "k3":
        return k3_kl(logp, ref_logp)
    raise ValueError(f"train.grpo.kl_estimator: unknown {estimator!r}; one of ('k1', 'k2', 'k3')")


def per_token_loss(logp: Tensor, old_logp: Tensor, ref_logp: Optional[Tensor], advantages: Tensor, loss_type: str,
                   epsilon: float, epsilon_high: float, beta: float, clip_high: Optional[float] = None,
                   kl_estimator: str = "k3") -> Tuple[Tensor, Tensor, Tensor]:
    """(loss, clipped, kl), each (N, R). ``clipped``: the token's ratio was cut off (cispo: above
    ``epsilon_high``; grpo: the clipped term was the smaller one and differs). grpo clips the ratio to
    [1 - epsilon, 1 + (clip_high or epsilon)] (DAPO's clip-higher when clip_high > epsilon)."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    if loss_type == "cispo":
        gain = torch.clamp(ratio, max=epsilon_high).detach() * adv * logp
        clipped = ratio.detach() > epsilon_high
    elif loss_type == "grpo":
        high = epsilon if clip_high is None else clip_high
        unclipped, clipped_gain = ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + high) * adv
        gain = torch.min(unclipped, clipped_gain)
        clipped = (clipped_gain < unclipped).detach()
    else:
        raise ValueError(f"train.grpo.loss_type: unknown {loss_type!r}; one of ('cispo', 'grpo')")
    kl = kl_estimate(logp, ref_logp, kl_estimator) if ref_logp is not None else torch.zeros_like(logp)
    return -(gain - beta * kl), clipped, kl


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


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` (N, R) over each row's masked-in tokens (N,); 0 for a row with none."""
    return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)


def aggregate_loss(loss: Tensor, mask: Tensor, mode: str, max_gen_len: int) -> Tensor:
    """The micro-batch's share of the step's loss, a sum the engine divides by :func:`loss_units`' all-reduced
    total: ``seq-mean`` sums each completion's token mean (MiniMind), ``token-mean`` sums every token (the mean
    over all tokens of the global batch, verl), ``seq-sum-norm`` sums each completion's token sum over
    ``max_gen_len`` (Dr. GRPO's constant normaliser, no length bias)."""
    if mode == "seq-mean":
        return sequence_mean(loss, mask).sum()
    if mode == "token-mean":
        return (loss * mask).sum()
    if mode == "seq-sum-norm":
        return (loss * mask).sum() / max_gen_len
    raise ValueError(f"train.grpo.loss_agg: unknown {mode!r}; one of ('seq-mean', 'token-mean', 'seq-sum-norm')")


def loss_units(mask: Tensor, mode: str) -> int:
    """What the step's loss is a mean over: completion tokens (token-mean) or completions that carry any token."""
    return int(mask.sum()) if mode == "token-mean" else int(mask.sum(dim=1).gt(0).sum())
