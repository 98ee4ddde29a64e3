"""A critic: MiniMind's ``CriticModel`` of ``trainer/train_ppo.py`` (d65ef2c), a value head on a copy of the policy,
with MiniMind's state-dict keys, trained beside the policy (PPO's; its advantages are rl/advantages.py's
``token_rewards``, ``gae`` and ``whiten``, its losses rl/losses.py's ``ppo_token_losses``)."""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor, nn

from minimind_ray.model.minimind import attention_mask_for, unwrap_model


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


