"""The model: sizes, MiniMind key compatibility, causality, KV cache, .pth I/O, MoE, generation."""
from __future__ import annotations

import math

import pytest
import torch

from minimind_ray.config import ModelConfig
from minimind_ray.generate import generate_tokens as generate
from minimind_ray.model.minimind import MiniMindForCausalLM, RMSNorm, build_model, clean_state_dict
from minimind_ray.store.pth import load_pth, save_pth
from minimind_ray.model.presets import PRESETS, preset_values

torch.set_num_threads(2)

# Unique parameters (tied embedding counted once). The five full-size numbers are MiniMind's
# published sizes (25.83M, 104.0M, 145.0M, 63.9M, 198.4M) and equal MiniMind's own model's count.
PARAM_COUNTS = {
    "minimind2-small": 25_829_888,
    "minimind2": 104_030_976,
    "minimind2-moe": 145_029_760,
    "minimind3": 63_912_192,
    "minimind3-moe": 198_416_640,
    "tiny": 508_224,
    "tiny-moe": 680_768,
    "tiny3": 508_288,
    "tiny3-moe": 631_680,
    "demo": 1_606_784,
    "minimind2-0.5b": 505_345_536,  # no MiniMind release: MiniMind2's shapes scaled up (presets.py)
    "minimind2-1b": 987_850_752,
}


def cfg_of(preset: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**preset_values(preset), **overrides})


def meta_model(preset: str) -> MiniMindForCausalLM:
    """Shapes without memory or init time: full-size presets are built on the meta device."""
    with torch.device("meta"):
        return MiniMindForCausalLM(cfg_of(preset))


@pytest.fixture(scope="module")
def tiny():
    return build_model(cfg_of("tiny"), seed=0).eval()


def test_every_preset_has_a_count():
    assert set(PARAM_COUNTS) == set(PRESETS)


@pytest.mark.parametrize("preset", sorted(PARAM_COUNTS))
def test_param_count(preset):
    assert meta_model(preset).num_parameters() == PARAM_COUNTS[preset]


# --------------------------------------------------------------------------- MiniMind key layout


def minimind_keys(c: ModelConfig) -> list:
    """[(key, shape)] in the order MiniMind's own ``MiniMindForCausalLM.state_dict()`` lists them.

    Written by hand from MiniMind's model/model_minimind.py at 83e52f6 (minimind2) and d65ef2c
    (minimind3). Checked once by running MiniMind's file itself (from the mirror, in a
    temp dir, with this venv's transformers) for every preset: its state_dict keys,
    order and shapes, its parameter count, its weights under the same seed and its
    logits all equal ours. MiniMind's code is not part of this repository.
    """
    h, V, L, nh, nkv = c.hidden_size, c.vocab_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    hs = c.head_dim or h // nh
    inter = c.intermediate_size or (64 * math.ceil(int(h * 8 / 3) / 64) if c.generation == "minimind2"
                                    else 64 * math.ceil(h * math.pi / 64))  # the FFN-size rules, when unset

    def ffn(prefix, i):  # MiniMind creates gate, down, up in this order
        return [(f"{prefix}.gate_proj.weight", (i, h)), (f"{prefix}.down_proj.weight", (h, i)),
                (f"{prefix}.up_proj.weight", (i, h))]

    keys = [("model.embed_tokens.weight", (V, h))]
    for layer in range(L):
        p = f"model.layers.{layer}"
        keys += [(f"{p}.self_attn.q_proj.weight", (nh * hs, h)), (f"{p}.self_attn.k_proj.weight", (nkv * hs, h)),
                 (f"{p}.self_attn.v_proj.weight", (nkv * hs, h)), (f"{p}.self_attn.o_proj.weight", (h, nh * hs))]
        if c.generation == "minimind3":
            keys += [(f"{p}.self_attn.q_norm.weight", (hs,)), (f"{p}.self_attn.k_norm.weight", (hs,))]
        keys += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
        if not c.use_moe:
            keys += ffn(f"{p}.mlp", inter)
        elif c.generation == "minimind2":  # routed experts, gate (a bare Parameter), shared experts
            for e in range(c.num_experts):
                keys += ffn(f"{p}.mlp.experts.{e}", inter)
            keys.append((f"{p}.mlp.gate.weight", (c.num_experts, h)))
            for e in range(c.n_shared_experts):
                keys += ffn(f"{p}.mlp.shared_experts.{e}", inter)
        else:  # gate (nn.Linear), routed experts
            keys.append((f"{p}.mlp.gate.weight", (c.num_experts, h)))
            for e in range(c.num_experts):
                keys += ffn(f"{p}.mlp.experts.{e}", inter)
    keys += [("model.norm.weight", (h,)), ("lm_head.weight", (V, h))]
    return keys


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_state_dict_keys_are_minimind_keys(preset):
    got = [(k, tuple(v.shape)) for k, v in meta_model(preset).state_dict().items()]
    assert got == minimind_keys(cfg_of(preset))
    assert not any("freqs" in k for k, _ in got)  # RoPE tables are non-persistent buffers


def test_tied_embeddings(tiny):
    assert tiny.lm_head.weight is tiny.model.embed_tokens.weight


@pytest.mark.parametrize("preset,std", [("minimind2-small", None), ("minimind3", 0.02)])
def test_init_per_generation(preset, std):
    """minimind2: PyTorch defaults (lm_head's kaiming-uniform, shared with the embedding);
    minimind3: HF post_init, N(0, 0.02) for every matrix."""
    cfg = cfg_of(preset, num_hidden_layers=1)
    m = build_model(cfg, seed=0)
    w = m.model.layers[0].self_attn.q_proj.weight
    bound = 1 / math.sqrt(cfg.hidden_size)
    if std is None:
        assert w.abs().max() <= bound and m.lm_head.weight.abs().max() <= bound
    else:
        assert abs(w.std().item() - std) < 1e-3 and abs(m.lm_head.weight.std().item() - std) < 1e-3
    assert all(torch.equal(mod.weight, torch.ones_like(mod.weight)) for mod in m.modules() if isinstance(mod, RMSNorm))


def test_build_model_seed_is_reproducible_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b = build_model(cfg_of("tiny"), seed=5), build_model(cfg_of("tiny"), seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# --------------------------------------------------------------------------- attention and cache


@pytest.mark.parametrize("preset", ["tiny", "tiny3", "tiny3-moe"])
def test_causal_masking(preset):
    m = build_model(cfg_of(preset), seed=0).eval()
    x = torch.randint(0, 6400, (2, 16))
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 6400  # change one token: only positions >= 10 may move
    with torch.no_grad():
        a, b = m(x).logits, m(y).logits
    # Not bitwise: MoE experts run on whichever tokens route to them, and a different
    # group size changes the float summation order (~1e-7). A leak would be O(1).
    torch.testing.assert_close(a[:, :10], b[:, :10], atol=1e-6, rtol=0)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-2


@pytest.mark.parametrize("preset", ["tiny", "tiny3-moe", "tiny-moe"])
def test_cached_forward_equals_full_forward(preset):
    """Prefill 9 tokens, then a chunk of 4 (causal with an offset), then 1 at a time, in a static KV cache."""
    from minimind_ray.model.kv_cache import KVCache

    m = build_model(cfg_of(preset), seed=0).eval()
    x = torch.randint(0, 6400, (2, 16))
    cache = KVCache.for_model(m, slots=2)
    with torch.no_grad():
        full = m(x).logits
        parts = [m(x[:, :9], kv_cache=cache).logits, m(x[:, 9:13], kv_cache=cache).logits]
        for t in range(13, 16):
            parts.append(m(x[:, t:t + 1], kv_cache=cache).logits)
    assert cache.lengths == [16, 16] and cache.k.shape[:2] == (m.cfg.num_hidden_layers, 2)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_attention_mask_all_ones_is_no_mask_and_left_padding_stays_finite(tiny):
    x = torch.randint(3, 6400, (2, 12))
    mask = torch.ones_like(x)
    with torch.no_grad():
        torch.testing.assert_close(tiny(x, attention_mask=mask).logits, tiny(x).logits, atol=1e-5, rtol=1e-5)
        mask[0, :5] = 0  # left padding
        assert torch.isfinite(tiny(x, attention_mask=mask).logits).all()


def test_too_long_input_is_refused():
    m = build_model(cfg_of("tiny", max_position_embeddings=32), seed=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        m(torch.zeros(1, 33, dtype=torch.long))


# --------------------------------------------------------------------------- generation


def test_kv_cache_greedy_equals_uncached_greedy(tiny):
    prompt = torch.randint(3, 6400, (1, 7))
    cached = list(generate(tiny, prompt, 20, temperature=0, eos_token_id=None, use_cache=True))
    plain = list(generate(tiny, prompt, 20, temperature=0, eos_token_id=None, use_cache=False))
    assert len(cached) == 20 and cached == plain


def test_generate_streams_stops_at_eos_and_restores_mode(tiny):
    prompt = torch.randint(3, 6400, (1, 5))
    first = next(generate(tiny, prompt, 5, temperature=0))
    tiny.train()
    assert list(generate(tiny, prompt, 5, temperature=0, eos_token_id=first)) == [first]
    assert tiny.training
    tiny.eval()


def test_sampling_is_reproducible_with_a_generator(tiny):
    prompt = torch.randint(3, 6400, (1, 5))

    def run(seed, **kw):
        return list(generate(tiny, prompt, 12, eos_token_id=None, generator=torch.Generator().manual_seed(seed), **kw))

    assert run(1) == run(1)
    greedy = list(generate(tiny, prompt, 12, temperature=0, eos_token_id=None))
    assert run(2, top_k=1) == greedy
    assert all(0 <= t < 6400 for t in run(3, repetition_penalty=1.3, top_p=0.5))


# --------------------------------------------------------------------------- MiniMind .pth


def test_pth_round_trip_fp16_strict(tmp_path, tiny):
    path = tmp_path / "pretrain_64.pth"
    save_pth(tiny, str(path))
    sd = torch.load(path, weights_only=True)
    assert list(sd) == list(tiny.state_dict())  # both tied keys, no prefixes
    assert all(v.dtype == torch.float16 for v in sd.values())
    assert not list(tmp_path.glob("*.tmp"))
    fresh = build_model(cfg_of("tiny"), seed=1)
    load_pth(fresh, str(path), strict=True)
    for k, v in tiny.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v.half().float()), k
    # DDP / torch.compile prefixes are stripped
    wrapped = {f"module._orig_mod.{k}": v for k, v in sd.items()}
    assert clean_state_dict(wrapped).keys() == sd.keys()
    load_pth(fresh, wrapped, strict=True)


# --------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny3-moe"])
def test_moe_idle_experts_still_get_gradients(preset):
    """One token routes to k < E experts: the idle ones must still get a (zero) gradient, or DDP hangs."""
    m = build_model(cfg_of(preset), seed=0).train()
    out = m(torch.randint(0, 6400, (1, 1)))
    (out.logits.float().mean() + out.aux_loss).backward()
    experts = [p for n, p in m.named_parameters() if ".experts." in n]
    assert all(p.grad is not None for p in m.parameters())
    assert any(torch.count_nonzero(p.grad) == 0 for p in experts)  # the idle path was exercised


@pytest.mark.parametrize("preset,overrides,k_factor", [
    ("tiny-moe", {"seq_aux": True}, False),
    ("tiny-moe", {"seq_aux": False}, False),
    ("tiny3-moe", {}, True),
    ("tiny3-moe", {"num_experts_per_tok": 2}, True),
])
def test_moe_aux_loss(preset, overrides, k_factor):
    """A zeroed router gives uniform scores, where each generation's formula has a closed form:
    alpha (minimind2, both variants) and k * alpha (minimind3 sums over the k slots)."""
    cfg = cfg_of(preset, **overrides)
    m = build_model(cfg, seed=0).train()
    x = torch.randint(0, 6400, (2, 8))
    aux = m(x).aux_loss
    assert aux.ndim == 0 and aux.item() > 0
    for layer in m.model.layers:
        torch.nn.init.zeros_(layer.mlp.gate.weight)
    want = cfg.aux_loss_alpha * (cfg.num_experts_per_tok if k_factor else 1) * cfg.num_hidden_layers
    assert m(x).aux_loss.item() == pytest.approx(want, rel=1e-5)
    assert m.eval()(x).aux_loss.item() == 0.0


def test_dense_aux_loss_is_zero(tiny):
    assert tiny.train()(torch.randint(0, 6400, (1, 4))).aux_loss.item() == 0.0
    tiny.eval()


# --------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("preset", ["tiny", "tiny3"])
def test_flops_per_token_dense(preset):
    """Dense + tied: every non-norm parameter is one multiply-add per token (the tied matrix as lm_head)."""
    m = meta_model(preset)
    norms = sum(p.numel() for mod in m.modules() if isinstance(mod, RMSNorm) for p in mod.parameters())
    c = m.cfg
    attn = 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * 256
    assert m.flops_per_token(256) == 6 * (m.num_parameters() - norms) + attn


def test_flops_per_token_moe_counts_active_experts_only():
    m = meta_model("tiny-moe")
    c = m.cfg
    dense_equiv = meta_model("tiny").flops_per_token(64)  # same attention; FFN 192 wide
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    ffn_dense = 3 * c.hidden_size * 192
    moe_ffn = c.hidden_size * c.num_experts + (c.num_experts_per_tok + c.n_shared_experts) * expert
    assert m.flops_per_token(64) == dense_equiv + 6 * c.num_hidden_layers * (moe_ffn - ffn_dense)
