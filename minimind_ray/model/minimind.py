"""The MiniMind-family causal LM in one file, nanoGPT style.

One implementation serves both MiniMind generations; ``ModelConfig.generation``
picks the few places where they differ (minimind2 = MiniMind @83e52f6, minimind3 =
MiniMind @d65ef2c):

- FFN width when unset: 64*ceil(int(8h/3)/64) vs 64*ceil(pi*h/64).
- QK-norm: none vs per-head RMSNorm ``q_norm``/``k_norm`` (the ``qk_norm`` flag).
- MoE top-k weights renormalised: only when k > 1 vs whenever ``norm_topk_prob``.
- MoE aux loss: sequence- or batch-level vs batch-level summed over the k slots.
- MoE shared experts (``mlp.shared_experts.{j}``): minimind2 only.
- Init: PyTorch defaults vs HF ``post_init`` (N(0, 0.02), norms 1).

The ``state_dict`` keys and shapes are exactly MiniMind's for each generation (and
modules are created in MiniMind's order, so the same seed gives the same weights),
hence MiniMind ``.pth`` files load here with ``strict=True`` and ours load there.
Shapes in comments: B batch, T new tokens, S = past + T key positions, h hidden,
nh / nkv query / key-value heads, hs head size, E experts, k experts per token,
N = B*T tokens.

Decoding keeps keys and values in a :class:`~minimind_ray.model.kv_cache.KVCache` (``kv_cache=``): written in
place, one length per row. Its attention reads the nkv cached heads as they are: each kv head's query heads as
rows of one attention (``_grouped_attention``), or SDPA's ``enable_gqa`` for a causal prefill of fresh rows;
training's path (no cache) still copies them out to every query head (``repeat_kv``), because GQA's backward
sums the query heads' key/value gradients in another order, and training results stay bit for bit as they were.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minimind_ray.model.config import ModelConfig
from minimind_ray.model.kv_cache import CacheStep, KVCache
from minimind_ray.model.rope import YARN, apply_rope, rope_tables

# SDPA attends nkv key/value heads from nh query heads itself since torch 2.5 (enable_gqa); older: repeat_kv
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
# From this many key positions over a cached step's rows (B * S) on, a CPU multiplies keys x queries in attention
# (``Attention._grouped_attention``): SDPA was faster at B * S <= 2048 (bench/bench_decode.py --kernels)
_KEYS_FIRST = 4096


# --------------------------------------------------------------------------- config resolution


def resolve_config(cfg: ModelConfig) -> ModelConfig:
    """A copy of ``cfg`` with the derived sizes (head_dim, FFN widths) filled in.

    MiniMind derives these inside its modules; doing it once here means every reader
    of ``model.cfg`` (export, FLOPs, checkpoints) sees concrete numbers.
    """
    h = cfg.hidden_size
    inter = cfg.intermediate_size
    if inter is None:
        if cfg.generation == "minimind2":
            inter = 64 * math.ceil(int(h * 8 / 3) / 64)
        else:
            inter = 64 * math.ceil(h * math.pi / 64)
    return dataclasses.replace(
        cfg,
        head_dim=cfg.head_dim or h // cfg.num_attention_heads,
        intermediate_size=inter,
        moe_intermediate_size=cfg.moe_intermediate_size or inter,
    )


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back to the input dtype.

    This is minimind3's order of operations; minimind2 casts before multiplying by
    the weight. Both are identical in fp32, and under autocast the residual stream
    is fp32 anyway.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).type_as(x)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, S, nkv, hs) -> (B, S, nkv*n_rep, hs): each kv head serves n_rep query heads (GQA)."""
    if n_rep == 1:
        return x
    B, S, nkv, hs = x.shape
    return x[:, :, :, None, :].expand(B, S, nkv, n_rep, hs).reshape(B, S, nkv * n_rep, hs)


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE, optional QK-norm and a KV cache."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # which layer of a KV cache is this one's
        h, hs = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hs = cfg.num_attention_heads, cfg.num_key_value_heads, hs
        self.q_proj = nn.Linear(h, self.nh * hs, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hs, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hs, bias=False)
        self.o_proj = nn.Linear(self.nh * hs, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hs, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hs, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor],
                cache: Optional[CacheStep] = None) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hs)  # (B, T, nh, hs)
        k = self.k_proj(x).view(B, T, self.nkv, self.hs)  # (B, T, nkv, hs)
        v = self.v_proj(x).view(B, T, self.nkv, self.hs)  # (B, T, nkv, hs)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = self.nh // self.nkv
        if cache is None:  # training's path: a fresh sequence, causal unless a padding mask says more
            causal, gqa = mask is None and T > 1, False
            k, v = repeat_kv(k, n_rep).transpose(1, 2), repeat_kv(v, n_rep).transpose(1, 2)  # (B, nh, S, hs)
        else:  # the new keys go into the cache in place; attend to the row's cached ones: (B, nkv, S, hs)
            k, v, causal = cache.update(self.layer_idx, k, v)
            if n_rep > 1 and not causal:  # a decode step (or a joiner's prefill): no copy of the cached heads
                return self.resid_dropout(self.o_proj(self._grouped_attention(q, k, v, cache.grouped_mask(n_rep))))
            gqa = n_rep > 1 and SDPA_GQA  # a causal prefill of fresh rows
            if n_rep > 1 and not gqa:
                k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)  # (B, nh, S, hs), as repeat_kv
        q = q.transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=causal, **({"enable_gqa": True} if gqa else {}))  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.nh * self.hs)  # (B, T, nh*hs)
        return self.resid_dropout(self.o_proj(y))

    def _grouped_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """Attention of a cached step (not causal: the mask, or none, says what each query sees) with each key/value
        head's n_rep query heads as n_rep x T query rows of one attention over that head's keys: the cache is read
        once per kv head as it lies, with no copy (on a CPU 1.6-2.6x faster than SDPA's ``enable_gqa`` at T = 1).
        Query head h = g * n_rep + r reads kv head g, as repeat_kv lays them out. On a CPU with many keys the scores
        are keys x queries, (S, hs) @ (hs, n_rep*T), a product CPU matrix kernels do well, where SDPA's queries x
        keys has n_rep*T rows (4 at decode): 8 layers at batch 16 and 2048 keys, 30 ms against SDPA's 40.
        q (B, T, nh, hs), k / v (B, nkv, S, hs), mask (B, 1, n_rep*T, S) or None -> (B, T, nh*hs)."""
        B, T = q.shape[:2]
        n_rep = self.nh // self.nkv
        qg = q.transpose(1, 2).reshape(B, self.nkv, n_rep * T, self.hs)  # row r*T + t: head g*n_rep + r, token t
        if k.device.type == "cpu" and B * k.shape[2] >= _KEYS_FIRST and not (self.training and self.dropout > 0):
            scores = torch.matmul(k, qg.transpose(-1, -2)).transpose(-1, -2) * self.hs ** -0.5  # (B, nkv, n_rep*T, S)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            y = torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(v.dtype), v)  # (B, nkv, n_rep*T, hs)
        else:
            y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask,
                                               dropout_p=self.dropout if self.training else 0.0)
        return y.reshape(B, self.nh, T, self.hs).transpose(1, 2).reshape(B, T, self.nh * self.hs)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Created gate, down, up: MiniMind's order and key order."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, cfg.hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, intermediate_size, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (+ always-on shared experts in the minimind2 layout).

    Both layouts keep the router as ``mlp.gate.weight`` of shape (E, h). MiniMind2
    stores it as a bare Parameter with kaiming-uniform init, which is exactly what
    ``nn.Linear(h, E, bias=False)`` holds and how it initialises, so one nn.Linear
    serves both. Training and inference share one dispatch (:meth:`experts_forward`).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gen = cfg.generation
        self.E, self.k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob, self.alpha, self.seq_aux = cfg.norm_topk_prob, cfg.aux_loss_alpha, cfg.seq_aux

        def expert() -> FeedForward:
            return FeedForward(cfg, cfg.moe_intermediate_size)

        if self.gen == "minimind2":  # creation order = MiniMind2's: experts, gate, shared experts
            self.experts = nn.ModuleList([expert() for _ in range(self.E)])
            self.gate = nn.Linear(cfg.hidden_size, self.E, bias=False)
            if cfg.n_shared_experts > 0:
                self.shared_experts = nn.ModuleList(
                    [FeedForward(cfg, cfg.intermediate_size) for _ in range(cfg.n_shared_experts)])
        else:  # minimind3: gate, experts; no shared experts
            self.gate = nn.Linear(cfg.hidden_size, self.E, bias=False)
            self.experts = nn.ModuleList([expert() for _ in range(self.E)])

    def route(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """-> softmax scores (N, E), top-k weights (N, k), top-k expert ids (N, k)."""
        scores = F.softmax(self.gate(x), dim=-1)  # (N, E)
        weight, idx = torch.topk(scores, self.k, dim=-1, sorted=False)  # (N, k)
        renorm = self.norm_topk_prob and (self.k > 1 or self.gen == "minimind3")
        if renorm:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weight, idx

    def aux_loss(self, scores: Tensor, idx: Tensor, B: int, T: int) -> Tensor:
        """Load-balancing loss: E * sum_e (fraction routed to e) * (mean score of e), times alpha.

        Written the way each generation writes it, so that the numbers match MiniMind's logs.
        """
        E, k = self.E, self.k
        if self.gen == "minimind3":
            load = F.one_hot(idx, E).float().mean(0)  # (k, E): per top-k slot, fraction of tokens
            return (load * scores.mean(0)).sum() * E * self.alpha
        if self.seq_aux:  # minimind2, per sequence then averaged
            counts = torch.zeros(B, E, device=scores.device)
            counts.scatter_add_(1, idx.view(B, T * k), torch.ones(B, T * k, device=scores.device))
            ce = counts / (T * k / E)  # (B, E)
            return (ce * scores.view(B, T, E).mean(dim=1)).sum(dim=1).mean() * self.alpha
        fi = F.one_hot(idx.view(-1), E).float().mean(0) * E  # (E,)
        return (scores.mean(0) * fi).sum() * self.alpha

    def experts_forward(self, xf: Tensor, weight: Tensor, idx: Tensor) -> Tensor:
        """sum_j weight[n, j] * experts[idx[n, j]](xf[n]) for every token n: (N, h).

        Slots (token, choice) sorted by expert make one run per expert. In bf16, grouped GEMMs take the
        run ends on the device: no host sync per layer, no graph break under torch.compile. An expert
        with no tokens runs on an empty run and keeps a (zero) gradient, as DDP needs. Each token sums
        its k slots: no scatter-add, so GPUs add in a fixed order."""
        (N, k), h = idx.shape, xf.shape[1]
        order = idx.reshape(-1).argsort(stable=True)  # (N*k,) slots by expert; slot s = token s // k
        ends = torch.searchsorted(idx.reshape(-1)[order], torch.arange(self.E, device=xf.device), right=True)
        xs = xf.unsqueeze(1).expand(N, k, h).reshape(N * k, h)[order]  # a permutation: no repeated index
        dtype = torch.get_autocast_dtype(xf.device.type) if torch.is_autocast_enabled(xf.device.type) else xf.dtype
        # F.grouped_mm: a bf16 kernel (compile traces no other dtype), reading `ends` on the device on CPU and sm 9/10
        # GPUs; elsewhere torch's fallback copies them to the host in each of 9 calls, so loop and read once instead.
        sm = torch.cuda.get_device_capability(xf.device)[0] if xf.device.type == "cuda" else None
        aligned = h % 8 == 0 and self.experts[0].up_proj.out_features % 8 == 0  # 16-byte rows
        if dtype == torch.bfloat16 and aligned and (xf.device.type == "cpu" or sm in (9, 10)):
            def grouped(inputs: Tensor, name: str) -> Tensor:  # every expert's `name` Linear on its run
                w = torch.stack([getattr(e, name).weight for e in self.experts]).to(dtype)  # (E, out, in)
                return F.grouped_mm(inputs.to(dtype), w.transpose(-2, -1), offs=ends.to(torch.int32))
            out = grouped(F.silu(grouped(xs, "gate_proj")) * grouped(xs, "up_proj"), "down_proj")
            out = self.experts[0].dropout(out)  # (N*k, h)
        else:
            bounds = [0] + ends.tolist()  # the one host sync of this path
            out = torch.cat([e(xs[a:b]) for e, a, b in zip(self.experts, bounds[:-1], bounds[1:])])
        out = (out * weight.reshape(-1, 1)[order]).to(xf.dtype)  # the k slots add up in the residual's dtype
        return out.new_zeros(out.shape).index_copy(0, order, out).view(N, k, h).sum(dim=1)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        B, T, h = x.shape
        xf = x.reshape(-1, h)  # (N, h)
        scores, weight, idx = self.route(xf)
        y = self.experts_forward(xf, weight, idx).view(B, T, h)
        for shared in getattr(self, "shared_experts", []):
            y = y + shared(x)
        aux = self.aux_loss(scores, idx, B, T) if self.training and self.alpha > 0 else scores.new_zeros(())
        return y, aux


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.use_moe
        self.mlp = MoE(cfg) if cfg.use_moe else FeedForward(cfg, cfg.intermediate_size)

    def forward(self, x, cos, sin, mask, cache: Optional[CacheStep] = None):
        """-> (x (B, T, h), MoE aux loss or None)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        if self.is_moe:
            m, aux = self.mlp(self.post_attention_layernorm(x))
        else:
            m, aux = self.mlp(self.post_attention_layernorm(x)), None
        return x + m, aux


class MiniMindModel(nn.Module):
    """Embedding, blocks, final norm: MiniMind's ``model.`` submodule."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                               YARN if cfg.inference_rope_scaling else None)
        self.register_buffer("freqs_cos", cos, persistent=False)  # (max_pos, hs)
        self.register_buffer("freqs_sin", sin, persistent=False)


def attention_mask_for(T: int, attention_mask: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    """Boolean (B, 1, T, T) mask of fresh sequences, True = may attend: causal, and only to the real keys that
    ``attention_mask`` (B, T) marks; None without padding (SDPA's own causal handling). A query row with no
    visible key (a left pad) is let see every key: its output is garbage but finite, not NaN."""
    if attention_mask is None:
        return None
    pos = torch.arange(T, device=device)
    mask = (pos[None, :] <= pos[:, None])[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
    return mask | ~mask.any(dim=-1, keepdim=True)


@dataclass
class ModelOutput:
    logits: Tensor  # (B, T, V)
    aux_loss: Tensor  # scalar: MoE load-balancing loss, already weighted by aux_loss_alpha; 0 when dense or in eval


class MiniMindForCausalLM(nn.Module):
    """The causal LM. ``cfg`` is the resolved ModelConfig (derived sizes filled in)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg = resolve_config(cfg)
        self.model = MiniMindModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight  # MiniMind ties this way round
        if cfg.generation == "minimind3":
            self.apply(_hf_init)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, kv_cache: Optional[KVCache] = None,
                slots: Optional[Sequence[int]] = None, input_lengths: Optional[Sequence[int]] = None,
                logits_at: Optional[Tensor] = None) -> ModelOutput:
        """input_ids (B, T). Without ``kv_cache``: a fresh sequence per row; attention_mask (B, T), 1 = real token,
        marks padding (left or right). With ``kv_cache``: row b continues cache slot ``slots[b]`` (default b) from
        its cached length; the first ``input_lengths[b]`` (default T) tokens are real, the rest right padding.
        ``logits_at`` (B,): the one position per row whose logits are wanted (logits (B, 1, V)); None = all."""
        B, T = input_ids.shape
        m = self.model
        step = None
        if kv_cache is None:
            if T > m.freqs_cos.shape[0]:
                raise ValueError(f"sequence of {T} tokens exceeds max_position_embeddings={m.freqs_cos.shape[0]}")
            cos, sin = m.freqs_cos[:T], m.freqs_sin[:T]  # (T, hs)
            mask = attention_mask_for(T, attention_mask, input_ids.device)
        else:
            if attention_mask is not None:
                raise ValueError("with a kv_cache, padding is input_lengths (right padding), not attention_mask")
            step = kv_cache.step(B, T, slots, input_lengths, input_ids.device)
            at = step.positions.clamp_max(m.freqs_cos.shape[0] - 1)  # (B, T): pads may run past the table
            cos, sin, mask = m.freqs_cos[at], m.freqs_sin[at], step.mask  # (B, T, hs)
        x = m.dropout(m.embed_tokens(input_ids))  # (B, T, h)
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in m.layers:
            x, layer_aux = layer(x, cos, sin, mask, step)
            if layer_aux is not None:
                aux = aux + layer_aux
        if step is not None:
            step.advance()
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at].unsqueeze(1)  # (B, 1, h)
        logits = self.lm_head(m.norm(x))  # (B, T|1, V)
        return ModelOutput(logits=logits, aux_loss=aux)

    def num_parameters(self) -> int:
        """Unique parameters: the tied embedding/lm_head matrix counts once."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B style:

            6 * N + 12 * L * nh * hs * seq_len

        N counts the weights a token multiplies through: q/k/v/o, the dense FFN or, for
        MoE, the router, its top-k routed experts and the shared experts, and the output
        head (a matmul even when tied; the input embedding is a lookup and is left out;
        norms are negligible). The second term is QK^T and AV over the full window, as
        PaLM counts it (no discount for the causal mask). Used for MFU.
        """
        c = self.cfg
        h, hs, L = c.hidden_size, c.head_dim, c.num_hidden_layers
        attn = h * hs * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        if c.use_moe:
            shared = c.n_shared_experts if c.generation == "minimind2" else 0
            ffn = h * c.num_experts + 3 * h * (c.num_experts_per_tok * c.moe_intermediate_size
                                                 + shared * c.intermediate_size)
        else:
            ffn = 3 * h * c.intermediate_size
        n = L * (attn + ffn) + h * c.vocab_size
        return 6.0 * n + 12.0 * L * c.num_attention_heads * hs * seq_len


@torch.no_grad()
def _hf_init(module: nn.Module) -> None:
    """minimind3's weights come from HF ``post_init``: Linear/Embedding ~ N(0, 0.02), norms = 1.

    Applied post-order with ``nn.Module.apply`` like HF's ``smart_apply``, so the tied
    matrix is drawn twice (as embedding, then as lm_head) exactly as there.
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)


def build_model(cfg: ModelConfig, seed: Optional[int] = None) -> MiniMindForCausalLM:
    """A freshly initialised model. With ``seed`` the init is reproducible and leaves the
    global RNG untouched; MiniMind's own model under ``torch.manual_seed(seed)`` gets the
    same weights."""
    if seed is None:
        return MiniMindForCausalLM(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MiniMindForCausalLM(cfg)


# --------------------------------------------------------------------------- wrappers and keys

_PREFIXES = ("module.", "_orig_mod.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP (``.module``) and/or torch.compile (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def clean_state_dict(sd: dict) -> dict:
    """Strip DDP (``module.``) and torch.compile (``_orig_mod.``) prefixes, in any nesting."""
    out = {}
    for key, value in sd.items():
        while key.startswith(_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out
