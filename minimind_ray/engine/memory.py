"""How much memory one training worker needs, and what to say when it did not have it.

:func:`estimate` adds up, for the model, sequence length, precision and micro-batch of a run, what one
worker holds at the peak of a micro-step (the start of backward, with AdamW's state from earlier steps):

    parameters      every weight in fp32 (frozen ones too: LoRA's base, DPO/GRPO's reference copy)
    gradients       4 bytes per trained weight
    AdamW           8 bytes per trained weight (exp_avg, exp_avg_sq)
    activations     what autograd saves per token and layer (counted below, per precision); with
                    train.activation_checkpointing=blocks each block's input only, plus one block's worth
                    while backward runs it again
    logits          the (tokens x vocab) tensors around the loss: the logits, log_softmax and its gradients
    runtime         the process itself: torch, Python, the Ray worker (CPU); the CUDA context (GPU)

Under train.parallelism=fsdp over W workers (engine/parallel.py) the weights, gradients and AdamW state are
1/W each, and a worker holds besides them what FSDP gathers whole:

    gathered        the root's weights (embedding = lm_head, final norm), gathered for the forward and again for
                    backward, and two blocks' (the one running and the next, prefetched), in the compute dtype;
                    with reshard_after_forward=false every block's, from its forward until its backward
    gradients       + one block's (or the root's, the larger) whole gradients in the compute dtype and their fp32
                    copy for the reduce-scatter
    heap slack      on CPU only: what glibc's heap keeps of the whole model each rank builds and frees as it
                    shards it, and of the chunks FSDP gathers and frees (CPU_HEAP_SLACK, measured)

It is arithmetic on the config (no model is built), so the driver can check a run before any worker
starts (:func:`minimind_ray.raytrain.oom.warn_if_short`) and suggest a micro-batch after an
out-of-memory failure (:func:`suggest_micro_batch`). ``tests/unit/test_memory_estimate.py`` holds it
against the measured peak (``peak_mem_gb``) of CPU runs; under ``torch.compile`` the fused kernels save
less than eager, so there it is an upper bound.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional

from minimind_ray.stages import get_stage

GiB = float(2 ** 30)
# What a worker process holds before its first tensor (measured: a CPU Ray Train worker with torch and
# the engine imported, RSS ~0.45 GiB; CUDA context + cuBLAS workspace ~0.5-1 GiB outside torch's allocator).
RUNTIME_BYTES = {"cpu": 0.5 * GiB, "cuda": 1.0 * GiB}
# FSDP on CPU, measured rather than counted: each rank builds the whole fp32 model (the same seeded init as DDP's) and
# frees it as it shards it, and every micro-batch gathers and frees each block's weights and gradients; glibc keeps
# freed chunks under its mmap threshold (at most 32 MiB each) in its heap, so the peak RSS sits above what is live: by
# about 0.2 GiB on the 26M model (tests/unit/test_memory_estimate.py) and about half the whole fp32 weights on the
# 0.5B preset (bench/bench_fsdp.py). CUDA's caching allocator reuses its blocks for the same sizes: no such term.
CPU_HEAP_SLACK = {"floor": 0.2 * GiB, "per_parameter": 2.0}


@dataclass
class MemoryEstimate:
    micro_batch_size: int
    sequences: int  # sequences in one forward (DPO: chosen + rejected; GRPO: completions)
    seq_len: int
    precision: str  # what the activations are counted in: fp32 | bf16
    parts: Dict[str, float] = field(default_factory=dict)  # bytes
    strategy: str = "ddp"  # how the workers share the model, for messages: "ddp", "fsdp over 4 workers", ...

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        """'12.3 GiB (parameters 0.10, AdamW 0.21, ...)': one clause for a one-line message."""
        detail = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.parts.items())
        return f"{self.total / GiB:.1f} GiB ({detail})"


def _activation_bytes_per_token_layer(c, precision: str) -> float:
    """Bytes autograd keeps per token and layer, counted from model/minimind.py's eager ops.

    h = hidden, q = heads x head_dim, kv = kv heads x head_dim, I = FFN width (MoE: top-k routed + shared):
      fp32: residual in/out (2h), each RMSNorm's normalised input and output (4h), q/k projections and
            their RoPE rotations (2q + 2kv), SDPA's q, repeated k and v, output (4q), o_proj's input (q),
            logsumexp (nh), SwiGLU's gate, silu, up and product (4I)
      bf16: the residual stream and the norms stay fp32 (4 x 4h); autocast casts a linear's input per
            call (q, k, v, gate, up: 5h in bf16); every projection output and SDPA tensor is bf16
      bf16-weights (FSDP's bf16, no autocast): the fp32 counts in bf16, but each RMSNorm's fp32 normalised
            input (2h); not measured here (GPU), so an upper bound by construction rather than a check
    """
    h, hs, nh, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    q, kv = nh * hs, nkv * hs
    if c.use_moe:
        shared = c.n_shared_experts if c.generation == "minimind2" else 0
        inter = c.num_experts_per_tok * c.moe_intermediate_size + shared * c.intermediate_size
        moe_extra = 2 * c.num_experts_per_tok * h + c.num_experts  # the slots' permuted inputs and outputs, scores
    else:
        inter, moe_extra = c.intermediate_size, 0
    qk_norm = 2 * (q + kv) if c.qk_norm else 0
    if precision == "bf16":
        return 4 * (4 * h + nh) + 2 * (5 * h + 7 * q + 2 * kv + 4 * inter + qk_norm + moe_extra)
    if precision == "bf16-weights":  # FSDP's bf16: every tensor bf16 but the norms' fp32 math and the logsumexp
        return 4 * (2 * h + nh) + 2 * (6 * h + 7 * q + 2 * kv + 4 * inter + qk_norm + moe_extra)
    return 4 * (6 * h + 7 * q + 2 * kv + 4 * inter + nh + qk_norm + moe_extra)


def _parameter_counts(c) -> Dict[str, int]:
    """All weights, one transformer block's, the root's (embedding, lm_head if untied, final norm), and the square
    linears' of one block, of a resolved ModelConfig."""
    h, hs = c.hidden_size, c.head_dim
    attn = h * hs * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + (2 * hs if c.qk_norm else 0)
    if c.use_moe:
        shared = c.n_shared_experts if c.generation == "minimind2" else 0
        ffn = c.num_experts * 3 * h * c.moe_intermediate_size + h * c.num_experts + shared * 3 * h * c.intermediate_size
    else:
        ffn = 3 * h * c.intermediate_size
    embed = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    block = attn + ffn + 2 * h
    return {"all": embed + c.num_hidden_layers * block + h, "block": block, "root": embed + h,
            "square_linears": 2 * h * h}


def activation_precision(cfg, device_type: str) -> str:
    """What autocast will compute in: train.precision, with 'auto' = bf16 on CUDA (GPUs that have it)."""
    p = cfg.train.precision
    return "bf16" if p == "bf16" or (p == "auto" and device_type == "cuda") else "fp32"


def estimate(cfg, micro_batch_size: Optional[int] = None, device_type: str = "cpu",
             world: Optional[int] = None) -> MemoryEstimate:
    """One worker's peak memory for ``cfg`` at ``micro_batch_size`` (default: the config's) among ``world`` workers
    (default: cluster.num_workers; it matters under FSDP only). What the stage adds (a second sequence per row,
    generated tokens, a frozen reference or teacher, a critic, adapters) comes from its record's memory terms
    (stages/stage.py:MemoryTerms)."""
    from minimind_ray.model.minimind import resolve_config  # lazy: the model module imports torch

    c = resolve_config(cfg.model)
    t = cfg.train
    terms = get_stage(t.stage).memory(cfg, c, lambda m: _parameter_counts(resolve_config(m))["all"])
    mb = micro_batch_size or t.micro_batch_size
    sequences, seq_len = mb * terms.sequences, cfg.data.max_seq_len + terms.extra_tokens
    precision = activation_precision(cfg, device_type)
    n_all = _parameter_counts(c)["all"]
    adapters = terms.trained_params or 0  # LoRA: the adapters train, on top of a frozen base
    trained = (terms.trained_params if terms.trained_params is not None else n_all) + terms.trained_models * n_all
    tokens = sequences * seq_len
    # logits, log_softmax and two gradients of that size at the start of backward (fp32); bf16 adds
    # the bf16 logits before .float(). Distillation adds the teacher's logits and the KL's log_softmaxes.
    per_logit = 12 + (2 if precision == "bf16" else 0) + terms.extra_logit_bytes
    models_forward = 1 + terms.trained_models  # a critic runs its own forward and backward over the same tokens
    world = world or cfg.cluster.num_workers
    sharded = t.parallelism == "fsdp"  # one worker too: a Ray Train run has a process group of one to shard over
    shard = world if sharded else 1  # under FSDP each worker keeps 1/world of the policy's state
    if sharded and precision == "bf16":  # FSDP computes in bf16 weights: the residual stream is bf16 too
        precision = "bf16-weights"
    per_layer = _activation_bytes_per_token_layer(c, precision)
    if t.activation_checkpointing == "blocks":  # each block's input (the residual stream), and one block run again
        per_block = tokens * c.num_hidden_layers * (2 if precision == "bf16-weights" else 4) * c.hidden_size
        per_block += tokens * per_layer
    else:
        per_block = tokens * c.num_hidden_layers * per_layer
    parts = {
        "parameters": 4.0 * ((n_all + adapters) / shard + (terms.frozen_models + terms.trained_models) * n_all),
        "gradients": 4.0 * (trained - terms.trained_models * n_all) / shard + 4.0 * terms.trained_models * n_all,
        "AdamW": 8.0 * (trained - terms.trained_models * n_all) / shard + 8.0 * terms.trained_models * n_all,
        "activations": models_forward * float(per_block + tokens * 3 * 4 * c.hidden_size),  # + final norm, lm_head's input
        "logits": float(tokens * c.vocab_size * per_logit),
        "runtime": RUNTIME_BYTES["cuda" if device_type == "cuda" else "cpu"],
    }
    strategy = f"fsdp over {world} worker{'s' if world > 1 else ''}" if sharded else "ddp"
    if sharded:
        counts = _parameter_counts(c)
        wbytes = 2 if precision == "bf16-weights" else 4
        held = c.num_hidden_layers if not t.reshard_after_forward else 2
        parts["gathered"] = float(wbytes * (counts["root"] + held * counts["block"]))
        parts["gradients"] += (wbytes + 4) * max(counts["root"], counts["block"])
        if device_type != "cuda":  # see CPU_HEAP_SLACK
            parts["heap slack"] = max(CPU_HEAP_SLACK["floor"], CPU_HEAP_SLACK["per_parameter"] * n_all)
    if t.activation_checkpointing == "blocks":
        strategy += ", activation checkpointing"
    return MemoryEstimate(mb, sequences, seq_len, precision, parts, strategy)


def suggest_micro_batch(cfg, world: int, budget_bytes: float, device_type: str = "cpu") -> Optional[int]:
    """The largest micro-batch below the config's whose estimate fits ``budget_bytes`` (with 10% slack)
    and that still splits the global batch (``global = world x micro x accumulation``); None if even 1
    does not fit. When the estimate says the current micro-batch fits (it was wrong this time), half."""
    g, current = cfg.train.global_batch_size, cfg.train.micro_batch_size
    per_rank = g // world if g % world == 0 else g
    choices = [m for m in range(current - 1, 0, -1) if per_rank % m == 0]
    if not choices:
        return None
    if estimate(cfg, current, device_type, world).total <= budget_bytes:
        return next((m for m in choices if m <= current // 2), choices[-1])
    return next((m for m in choices if estimate(cfg, m, device_type, world).total <= 0.9 * budget_bytes), None)


def batch_fields(cfg) -> str:
    """The settings that size a micro-batch, for messages."""
    return ", ".join(("train.micro_batch_size", "data.max_seq_len", *_stage_batch_fields(cfg)))


def _stage_batch_fields(cfg):
    """What the stage adds to the settings that size a micro-batch (its record's memory terms)."""
    from minimind_ray.model.minimind import resolve_config  # lazy: the model module imports torch

    c = resolve_config(cfg.model)
    return get_stage(cfg.train.stage).memory(cfg, c, lambda m: _parameter_counts(resolve_config(m))["all"]).batch_fields


def _outgrow(cfg, world: int, device_type: str) -> str:
    """', or set train.activation_checkpointing=blocks (about 9.8 GiB) ...': the settings that save memory whatever
    the micro-batch, where the run does not use them yet and its stage allows them, with the estimate under each."""
    t, options = cfg.train, []
    if t.activation_checkpointing == "none":
        options.append({"activation_checkpointing": "blocks"})
    if t.parallelism == "ddp" and world > 1 and get_stage(t.stage).fsdp_refusal is None:
        options.append({"parallelism": "fsdp", **options[0]} if options else {"parallelism": "fsdp"})
    said = []
    for option in options:
        e = estimate(dataclasses.replace(cfg, train=dataclasses.replace(t, micro_batch_size=1, **option)), 1,
                     device_type, world)
        said.append(" ".join(f"train.{k}={v}" for k, v in option.items()) + f" (about {e.total / GiB:.1f} GiB)")
    return "".join(f", or set {s}" for s in said)


def advice(cfg, world: int, budget_bytes: float, device_type: str) -> str:
    """'lower train.micro_batch_size to 16 (the global batch of 512 stays, by accumulation 32)', or why not."""
    m = suggest_micro_batch(cfg, world, budget_bytes, device_type)
    g = cfg.train.global_batch_size
    if m is None:
        one = estimate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=1)), 1,
                       device_type, world)
        lengths = [f for f in _stage_batch_fields(cfg) if f.endswith("_len")]
        return (f"even train.micro_batch_size=1 needs about {one.total / GiB:.1f} GiB by the estimate: lower "
                f"data.max_seq_len" + "".join(f" or {f}" for f in lengths) + _outgrow(cfg, world, device_type)
                + ", or use machines with more memory")
    extra = _stage_batch_fields(cfg)
    return (f"set train.micro_batch_size={m} (the global batch of {g} stays, by accumulation {g // (world * m)})"
            + (f" or lower {' / '.join(extra)}" if extra else " or lower data.max_seq_len"))
