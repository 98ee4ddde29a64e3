"""The model room's configuration: the architecture (``model:``) and the LoRA adapters put on it (``train.lora``).
Beside the model it configures, as nanoGPT's GPTConfig sits beside its GPT; minimind_ray/config.py composes it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional

from minimind_ray.config_checks import config_field as _f, need


@dataclass
class ModelConfig:
    """Architecture of a MiniMind-family causal LM. Names follow MiniMind's own config."""

    preset: str = _f("minimind2-small", "named preset whose values fill the fields left unset (see minimind_ray/model/presets.py)")
    generation: str = _f("minimind2", "MiniMind generation: 'minimind2' (83e52f6 layout) or 'minimind3' (d65ef2c layout: QK-norm, MoE router as nn.Linear)")
    hidden_size: int = _f(512, "model width", ge=1)
    num_hidden_layers: int = _f(8, "number of transformer blocks", ge=1)
    num_attention_heads: int = _f(8, "query heads", ge=1)
    num_key_value_heads: int = _f(2, "key/value heads (GQA); must divide num_attention_heads", ge=1)
    head_dim: Optional[int] = _f(None, "per-head width; None = hidden_size // num_attention_heads", ge=1)
    vocab_size: int = _f(6400, "tokenizer vocabulary size", ge=1)
    intermediate_size: Optional[int] = _f(None, "SwiGLU width; None = the generation's rule (64*ceil(int(8h/3)/64) or 64*ceil(pi*h/64))", ge=1)
    rms_norm_eps: float = _f(1e-5, "RMSNorm epsilon", gt=0)
    rope_theta: float = _f(1e6, "RoPE base", gt=0)
    max_position_embeddings: int = _f(32768, "length of the precomputed RoPE table", ge=1)
    inference_rope_scaling: bool = _f(False, "apply YaRN scaling (factor 16 over 2048) to the RoPE table")
    qk_norm: bool = _f(False, "per-head RMSNorm on q and k (minimind-3)")
    dropout: float = _f(0.0, "dropout on embeddings, attention and residuals", ge=0, lt=1)
    tie_word_embeddings: bool = _f(True, "lm_head shares the embedding matrix")
    use_moe: bool = _f(False, "replace the FFN by a mixture of experts")
    num_experts: int = _f(4, "routed experts per MoE layer", ge=1)
    num_experts_per_tok: int = _f(2, "experts each token is routed to (top-k)", ge=1)
    n_shared_experts: int = _f(1, "always-on shared experts (minimind2 layout only)", ge=0)
    moe_intermediate_size: Optional[int] = _f(None, "expert FFN width; None = intermediate_size", ge=1)
    norm_topk_prob: bool = _f(True, "renormalise the top-k routing weights to sum to 1")
    aux_loss_alpha: float = _f(0.01, "weight of the load-balancing loss", ge=0)
    seq_aux: bool = _f(True, "sequence-level balancing loss (minimind2); minimind3 uses the batch-level one")


@dataclass
class LoRAConfig:
    """Low-rank adapters (stage 'lora')."""

    rank: int = _f(16, "adapter rank", ge=1)
    alpha: Optional[float] = _f(None, "scale = alpha/rank; None = no scaling (MiniMind's behaviour)", gt=0)
    targets: List[str] = _f(["square"], "module name suffixes to adapt, or 'square' for every square nn.Linear (MiniMind)")


def validate_model(m: ModelConfig) -> None:
    """The model section's own rules (bounds are checked before, by config_checks.check_bounds)."""
    need(m.generation in ("minimind2", "minimind3"), "model.generation", f"unknown generation {m.generation!r}")
    need(m.num_attention_heads % m.num_key_value_heads == 0, "model.num_key_value_heads",
         f"{m.num_key_value_heads} does not divide num_attention_heads {m.num_attention_heads}")
    need(m.head_dim is not None or m.hidden_size % m.num_attention_heads == 0, "model.num_attention_heads",
         f"does not divide hidden_size {m.hidden_size}")
    if m.use_moe:
        need(1 <= m.num_experts_per_tok <= m.num_experts, "model.num_experts_per_tok", "must be in [1, num_experts]")


LORA_KEY = ".lora."  # in the key of every LoRA adapter tensor: ``<module>.lora.{A,B}.weight`` (model/lora.py)


def is_lora_key(key: str) -> bool:
    """Whether a state-dict key (or parameter name) is a LoRA adapter's."""
    return LORA_KEY in key


def holds_lora(keys: Iterable[str]) -> bool:
    """Whether weights with these state-dict keys (or parameter names) hold LoRA adapters: the one test of it."""
    return any(is_lora_key(k) for k in keys)
