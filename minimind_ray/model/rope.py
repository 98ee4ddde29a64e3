"""Rotary position embeddings (RoPE) of the MiniMind family, with MiniMind's YaRN scaling at inference."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

# The YaRN settings MiniMind hard-codes behind `inference_rope_scaling` (32768 = 16 x 2048).
YARN = dict(factor=16.0, original_max_position_embeddings=2048, beta_fast=32.0, beta_slow=1.0, attention_factor=1.0)


def rope_tables(head_dim: int, max_pos: int, theta: float, yarn: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """cos and sin tables, each (max_pos, hs), in the half-split layout of HF's ``rotate_half``.

    With ``yarn`` (MiniMind's ``inference_rope_scaling``) the frequencies are blended
    between the original ones (high-frequency dims, which already resolve positions
    well) and ones slowed down by ``factor`` (low-frequency dims), with a linear ramp
    between the dims that rotate ``beta_fast`` and ``beta_slow`` times over the
    original context. As in MiniMind, the blend only applies when the table is longer
    than the original context.
    """
    half = head_dim // 2
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[:half].float() / head_dim))  # (hs/2,)
    attn_factor = 1.0
    if yarn is not None and max_pos > yarn["original_max_position_embeddings"]:
        orig = yarn["original_max_position_embeddings"]

        def dim_of(rotations: float) -> float:  # the dim index that turns `rotations` times over `orig` positions
            return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo = max(math.floor(dim_of(yarn["beta_fast"])), 0)
        hi = min(math.ceil(dim_of(yarn["beta_slow"])), half - 1)
        ramp = ((torch.arange(half).float() - lo) / max(hi - lo, 0.001)).clamp(0, 1)  # 0: keep, 1: interpolate
        freqs = freqs * (1 - ramp + ramp / yarn["factor"])
        attn_factor = yarn["attention_factor"]
    angles = torch.outer(torch.arange(max_pos).float(), freqs)  # (max_pos, hs/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1) * attn_factor  # (max_pos, hs)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1) * attn_factor
    return cos, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, T, n, hs) by position; cos/sin are (T, hs), or (B, T, hs) when each row has its own
    positions (decoding with a KV cache). Result keeps x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, hs) or (B, T, 1, hs): broadcast over heads
    return (x * cos + rotated * sin).to(x.dtype)
