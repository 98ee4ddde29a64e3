"""Advantages, the same for every RL algorithm that asks for them (docs/rl.md): a group's (GRPO: the reward minus
its group's mean, over the group's, the global batch's or no std), the leave-one-out baseline (RLOO, and GRPO's
``advantage='rloo'``: the reward minus the mean of the group's other members), and per-token ones from a critic's
values (PPO: the completion's reward on its last token, GAE, whitening). Tensors in, tensors out."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

ADV_EPS = 1e-4  # MiniMind's: (r - mean) / (std + 1e-4); a group of equal rewards gets advantage 0


def group_std(values: Tensor, group_size: int) -> Tensor:
    """The population std of each group of ``group_size`` consecutive values, repeated for each member (N,)."""
    grouped = values.view(-1, group_size)
    return grouped.std(dim=1, unbiased=False, keepdim=True).expand_as(grouped).reshape(-1)


def leave_one_out(rewards, k: int):
    """Each of consecutive groups of ``k`` rewards (N,) minus the mean of the group's other k - 1 (N,)."""
    grouped = rewards.view(-1, k)
    return (grouped - (grouped.sum(dim=1, keepdim=True) - grouped) / (k - 1)).reshape(-1)


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", kind: str = "grpo",
                     batch_std: Optional[float] = None) -> Tensor:
    """Advantages of consecutive groups of ``group_size`` rewards (N,): the reward minus its group's mean
    (``kind='grpo'``) or minus the mean of the group's other members (``'rloo'``, :func:`leave_one_out`: G/(G-1) times
    the former), divided by the group's std + 1e-4 (``scale='group'``, MiniMind), by the global batch's std +
    1e-4 (``'batch'``, ``batch_std``) or not at all (``'none'``, Dr. GRPO)."""
    grouped = rewards.view(-1, group_size)
    if kind == "rloo":  # the one leave-one-out baseline, RLOO's
        centred = leave_one_out(rewards, group_size).view(-1, group_size)
    else:
        centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + ADV_EPS)
    elif scale == "batch":
        centred = centred / (batch_std + ADV_EPS)
    return centred.reshape(-1)


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
