"""Log-probabilities of sampled completions, for every RL algorithm: which of a completion's tokens count (through
its first EOS) and the policy's (or the reference's) log-prob of each, with its entropy when asked."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from minimind_ray.rl.rollout import token_logprobs

def eos_mask(completion_ids: Tensor, eos_id: int, valid: Optional[Tensor] = None) -> Tensor:
    """1.0 on each completion's tokens up to and including its first EOS (every token when it has none),
    0.0 after it and wherever ``valid`` (N, R) is False (an engine's padding)."""
    valid = torch.ones_like(completion_ids, dtype=torch.bool) if valid is None else valid.bool()
    is_eos = completion_ids.eq(eos_id) & valid
    last = completion_ids.shape[1] - 1
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full_like(is_eos[:, 0], last,
                                                                                       dtype=torch.long))
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    return ((positions[None, :] <= first[:, None]) & valid).float()


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_len: int,
                        with_entropy: bool = False):
    """(log p of each of the last ``completion_len`` tokens (N, R) float32, the forward's MoE aux loss), and with
    ``with_entropy`` the policy's entropy at each of those positions (N, R), without gradient."""
    out = model(input_ids, attention_mask=attention_mask)
    logits = out.logits[:, -completion_len - 1:-1]  # the positions that predict the completion
    logp = token_logprobs(logits, input_ids[:, -completion_len:])
    if not with_entropy:
        return logp, out.aux_loss
    with torch.no_grad():
        lf = logits.float()
        entropy = torch.logsumexp(lf, dim=-1) - (torch.softmax(lf, dim=-1) * lf).sum(dim=-1)
    return logp, out.aux_loss, entropy
