"""The one token sampler: temperature, then top-k, then the top-p nucleus, then a draw.

``generate``/``chat``, the serving engine, RL rollouts and the ``gen``/``toolcall`` evaluations all pick their
tokens here, so a seed means the same draw everywhere. MiniMind's order: the logits are divided by the
temperature, tokens outside the k most likely and outside the smallest set whose probability passes ``top_p``
(the token that crosses it is kept) are dropped, and the rest are renormalised.

:class:`SamplingParams` is the one description of how to sample a completion, for every caller: ``generate``/``chat``
(the CLI's flags, whose defaults are MiniMind's 0.85 / 0.85 / 50), the RL rollouts (an algorithm's section) and the
generation evals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. The defaults sample the model's own distribution (nothing filtered)."""

    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    eos_id: int = 2  # the batched samplers stop a row at it (generate/chat: the tokenizer's)
    pad_id: int = 0  # what the batched samplers put after a row's EOS
    repetition_penalty: float = 1.0  # generate/chat only (MiniMind's); the batched samplers refuse another value
    seed: Optional[int] = None  # generate/chat: the draws' generator; the batched samplers take a seed per row
    grammar: Optional[str] = None  # the RL rollouts' sampler (rl/rollout.py): llguidance grammar text each row
    # follows (model/grammar.py; an RL section's json_schema, rl/constraints.py); generate/chat/serve take a
    # RowConstraint per reply instead. None = free


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``logits`` (N, V) with every token outside the top ``top_k`` (0 = all) and outside the ``top_p`` nucleus
    (1.0 = all) set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        drop = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p  # (N, V) in sorted order
        drop[:, 1:] = drop[:, :-1].clone()  # keep the token that crosses top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def sample_tokens(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                  generator: Optional[torch.Generator] = None, uniforms: Optional[Tensor] = None) -> Tensor:
    """One token per row of ``logits`` (N, V) -> (N,). ``temperature == 0`` is greedy (argmax, no draw).
    Draws from ``generator`` (None = the global RNG, which training checkpoints save and restore), or, when
    ``uniforms`` (N,) are given, by inverse CDF from one number per row (rl.rollout.counter_uniform: a row's
    token then depends on its logits and its own seed alone)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = F.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)  # (N, V)
    if uniforms is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    cdf = probs.double().cumsum(dim=-1)  # (N, V)
    pick = torch.searchsorted(cdf, (uniforms.to(cdf.device) * cdf[:, -1])[:, None]).squeeze(1)
    return pick.clamp_max(logits.shape[-1] - 1)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """``logits`` (N, V) with every token whose bit is 0 in ``bitmask`` (N, ceil(V / 32)) int32 set to -inf: bit
    ``i % 32`` of word ``i // 32`` allows token ``i`` (llguidance's layout, model/grammar.py). Ids past the mask's
    width are refused too. In place; returns ``logits``."""
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little")  # (N, 32 W): 0 or 1
    n = min(logits.shape[-1], bits.shape[1])
    allowed = torch.zeros(logits.shape, dtype=torch.bool)
    allowed[:, :n] = torch.from_numpy(bits[:, :n].view(bool))
    return logits.masked_fill_(allowed.logical_not_().to(logits.device), float("-inf"))
