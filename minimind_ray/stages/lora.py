"""LoRA (MiniMind's train_lora.py): adapters on a frozen base, trained with the cross-entropy (``train.lora``)."""
from __future__ import annotations

from minimind_ray.model.config import LoRAConfig
from minimind_ray.stages.stage import MemoryTerms, Stage


def objective(cfg):
    from minimind_ray.stages.lora_objective import LoRAObjective  # lazy: torch, when a run builds its state

    return LoRAObjective(cfg)


def adapter_parameters(cfg, policy) -> int:
    """Parameters of the adapters train.lora puts on the resolved model ``policy`` (model/lora.py's choice)."""
    r, h = cfg.train.lora.rank, policy.hidden_size
    q, kv = policy.num_attention_heads * policy.head_dim, policy.num_key_value_heads * policy.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, policy.intermediate_size), "up_proj": (h, policy.intermediate_size),
              "down_proj": (policy.intermediate_size, h)}
    chosen = set()
    for t in cfg.train.lora.targets:
        if t == "square":
            chosen |= {n for n, (i, o) in shapes.items() if i == o}
        else:
            chosen |= {n for n in shapes if n.endswith(t) or t.endswith(n)}
    return policy.num_hidden_layers * sum(r * (shapes[n][0] + shapes[n][1]) for n in chosen)


def adapters(cfg) -> LoRAConfig:
    return cfg.train.lora


def memory(cfg, policy, count) -> MemoryTerms:
    return MemoryTerms(trained_params=adapter_parameters(cfg, policy))


STAGE = Stage("lora", "LoRA adapters on a frozen base", formats=("sft", "pretrain"), objective=objective,
              export_prefix="full_sft", section=LoRAConfig, memory=memory, adapters=adapters, cross_entropy=True,
              fsdp_refusal="its adapters are a few MB that DDP already holds on every worker; a sharded frozen "
                           "base with adapters is not built")
