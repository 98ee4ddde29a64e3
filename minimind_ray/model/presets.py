"""Named model configurations.

Parameter counts (tied embeddings counted once) are asserted in tests/unit/test_model.py.
They match MiniMind's published sizes: 25.83M, 104.0M, 145.0M, 63.9M, 198.4M.

``minimind2-0.5b`` and ``minimind2-1b`` have no MiniMind release behind them: they are MiniMind2's architecture
scaled up for runs that outgrow one GPU (train.parallelism=fsdp, docs/training.md), with MiniMind2's rules (FFN width
64*ceil(int(8h/3)/64), 6,400-token vocabulary, tied embeddings, 4 query heads per key-value head), so that the .pth,
HF (Llama layout) and GGUF exports hold them as they hold the released sizes.
"""
from __future__ import annotations

from typing import Dict

PRESETS: Dict[str, dict] = {
    # MiniMind2 generation (jingyaogong/minimind @ 83e52f6)
    "minimind2-small": dict(generation="minimind2", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=2, vocab_size=6400, intermediate_size=1408, rms_norm_eps=1e-5),
    "minimind2": dict(generation="minimind2", hidden_size=768, num_hidden_layers=16, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=6400, rms_norm_eps=1e-5),
    "minimind2-moe": dict(generation="minimind2", hidden_size=640, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=6400, rms_norm_eps=1e-5, use_moe=True, num_experts=4,
                          n_shared_experts=1, num_experts_per_tok=2, aux_loss_alpha=0.01, seq_aux=True),
    # minimind-3 generation (jingyaogong/minimind @ d65ef2c)
    "minimind3": dict(generation="minimind3", hidden_size=768, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=6400, intermediate_size=2432, rms_norm_eps=1e-6, qk_norm=True),
    "minimind3-moe": dict(generation="minimind3", hidden_size=768, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=4, vocab_size=6400, intermediate_size=2432, rms_norm_eps=1e-6,
                          qk_norm=True, use_moe=True, num_experts=4, n_shared_experts=0, num_experts_per_tok=1,
                          aux_loss_alpha=5e-4, seq_aux=False),
    # larger than any MiniMind release (no MiniMind weights exist for them): 0.505B and 0.988B parameters
    "minimind2-0.5b": dict(generation="minimind2", hidden_size=1536, num_hidden_layers=20, num_attention_heads=16,
                           num_key_value_heads=4, vocab_size=6400, rms_norm_eps=1e-5),
    "minimind2-1b": dict(generation="minimind2", hidden_size=2048, num_hidden_layers=22, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=6400, rms_norm_eps=1e-5),
    # test-sized models: a few hundred thousand parameters
    "tiny": dict(generation="minimind2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=6400, intermediate_size=192, rms_norm_eps=1e-5),
    "tiny-moe": dict(generation="minimind2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=6400, intermediate_size=128, rms_norm_eps=1e-5,
                     use_moe=True, num_experts=4, n_shared_experts=1, num_experts_per_tok=2),
    "tiny3": dict(generation="minimind3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=6400, intermediate_size=192, rms_norm_eps=1e-6, qk_norm=True),
    "tiny3-moe": dict(generation="minimind3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=6400, intermediate_size=128, rms_norm_eps=1e-6, qk_norm=True,
                      use_moe=True, num_experts=4, n_shared_experts=0, num_experts_per_tok=1, aux_loss_alpha=5e-4,
                      seq_aux=False),
    # CPU demo: small enough to learn the demo corpus in minutes on 2 cores
    "demo": dict(generation="minimind2", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=6400, intermediate_size=384, rms_norm_eps=1e-5),
}


def preset_values(name: str) -> dict:
    """The field values of a preset, with the rest of ModelConfig's defaults for that generation."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    v = dict(PRESETS[name])
    v["preset"] = name
    v.setdefault("intermediate_size", None)
    if v.get("generation") == "minimind3":
        v.setdefault("qk_norm", True)
    return v
