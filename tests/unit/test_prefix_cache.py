"""The prefix cache (model/prefix_cache.py) and the decode paths that use it, without Ray: a hit gives the logits of
a miss (within 1e-5) and the same greedy tokens, at block boundaries too; the memory bound holds under LRU; a weight
update empties it; two requests with one new prefix compute it once; rollouts sample what they sample without it."""
from __future__ import annotations

import copy
import threading

import pytest
import torch

from minimind_ray.generate import generate_tokens
from minimind_ray.model.kv_cache import KVCache
from minimind_ray.model.prefix_cache import PrefixCache
from minimind_ray.model.sampling import SamplingParams
from minimind_ray.rl.rollout import row_seeds, sample_completions
from minimind_ray.serve.engine import Engine, GenRequest

from tests.unit.test_kv_cache import make  # the decode golden tests' models and prompts (tests/fixtures)

torch.set_num_threads(1)

BLOCK = 16
CASES = [("tiny", False), ("tiny", True), ("tiny3-moe", True)]  # MiniMind2, minimind-3 MoE; YaRN on and off


@pytest.fixture(scope="module", params=CASES, ids=[f"{p}{'+yarn' if y else ''}" for p, y in CASES])
def model(request):
    return make.model_for(*request.param)


@pytest.fixture(scope="module")
def tiny():
    return make.model_for("tiny", False)


def big_cache() -> PrefixCache:
    return PrefixCache(64 * 2 ** 20, BLOCK)


@torch.no_grad()
def last_logits(model, prompt, pc=None):
    """The logits after ``prompt`` (V,) in the model's dtype, its prefix from ``pc`` when given (and its blocks
    stored there) -> (logits, positions copied from the cache)."""
    cache = KVCache.for_model(model, slots=2)
    cache.alloc(2)
    slot = 1  # not row 0: a hit lands in the request's own row
    n = pc.load(cache, slot, prompt) if pc is not None else 0
    rest = torch.tensor([prompt[n:]])
    out = model(rest, kv_cache=cache, slots=[slot], logits_at=torch.tensor([rest.shape[1] - 1])).logits[0, -1]
    if pc is not None:
        pc.save(cache, slot, prompt)
    return out, n


@pytest.mark.parametrize("length, cached", [(10, 0), (16, 0), (32, 16), (33, 32), (47, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_hit_gives_the_logits_of_a_miss_at_block_boundaries(model, length, cached, dtype):
    """Shorter than a block: nothing cached; an exact multiple: the last block holds the last token, which is
    always computed (its logits pick the next token), so one block less; the whole prompt seen before: all but the
    last token's block. The logits (RoPE at the cached positions, the mask of a continuing row, YaRN) match: within
    1e-5 in float64, where a wrong position or mask would still show and float rounding does not; in float32 the
    two attention kernels (a fresh causal prefill, a continuing row's) round apart by up to 1.1e-5 on these test
    models' enlarged weights (tests/fixtures/make_decode_golden.py), within 2e-5 as the decode golden tests allow."""
    model = copy.deepcopy(model).to(dtype)
    prompt = make.prompt_of(length, length)
    pc = big_cache()
    miss, n0 = last_logits(model, prompt, pc)
    hit, n1 = last_logits(model, prompt, pc)
    assert (n0, n1) == (0, cached)
    atol = 1e-5 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(hit, miss, atol=atol, rtol=0)
    alone, _ = last_logits(model, prompt)  # no prefix cache at all
    torch.testing.assert_close(miss, alone, atol=atol, rtol=0)


def test_a_shared_prefix_is_reused_by_another_prompt_and_generate_gives_the_same_tokens(model):
    system = make.prompt_of(40, 1)
    a, b = system + make.prompt_of(7, 2), system + make.prompt_of(12, 3)
    pc = big_cache()
    with_cache = [list(generate_tokens(model, torch.tensor([p]), 20, temperature=0, eos_token_id=None,
                                       prefix_cache=pc)) for p in (a, b)]
    assert pc.hit_tokens == 32  # b took a's first two blocks (40 shared tokens: 2 whole blocks)
    plain = [list(generate_tokens(model, torch.tensor([p]), 20, temperature=0, eos_token_id=None)) for p in (a, b)]
    assert with_cache == plain
    hit, n = last_logits(model, b, pc)
    torch.testing.assert_close(hit, last_logits(model, b)[0], atol=1e-5, rtol=0)
    assert n == 48


def test_the_memory_bound_holds_and_the_least_recently_used_go_first(tiny):
    one = KVCache.for_model(tiny, slots=1)
    per_block = 2 * tiny.cfg.num_hidden_layers * tiny.cfg.num_key_value_heads * BLOCK * tiny.cfg.head_dim * 4
    pc = PrefixCache(3 * per_block, BLOCK)
    prompts = [make.prompt_of(33, 100 + i) for i in range(4)]  # two blocks each (the 33rd token is computed)
    for p in prompts[:2]:
        last_logits(tiny, p, pc)
        assert pc.bytes_used <= pc.budget_bytes
    assert pc.blocks == 3 and pc.evicted_blocks == 1  # the first prompt's second block went (its chain's end)
    assert pc.cached_blocks(prompts[0]) == 1 and pc.cached_blocks(prompts[1]) == 2
    last_logits(tiny, prompts[0], pc)  # a hit on its first block makes it recent, and stores its second again
    for p in prompts[2:]:
        last_logits(tiny, p, pc)
        assert pc.bytes_used <= pc.budget_bytes and pc.blocks <= 3
    assert pc.cached_blocks(prompts[3]) == 2 and pc.cached_blocks(prompts[1]) == 0
    tight = PrefixCache(per_block - 1, BLOCK)  # not even one block fits: nothing stored, nothing breaks
    one.alloc(1)
    with torch.no_grad():
        tiny(torch.tensor([prompts[0]]), kv_cache=one)
    assert tight.save(one, 0, prompts[0]) == 0 and tight.bytes_used == 0


def _engine_run(model, prompts, pc, logprobs=5, together=False, tokens=12):
    """Greedy replies of ``prompts`` on a serving engine, one after another (or all queued before the loop looks):
    -> ([(token, logprob) per reply], [cached_tokens per request], engine stats)."""
    engine = Engine(model, eos_id=2, max_batch=4, context=4096, prefix_cache=pc)
    got = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def on_event(i, event):
        if event[0] == "token":
            got[i].append((event[1], event[2][0]))
        elif event[0] == "end":
            done[i].set()
        else:
            raise AssertionError(event)

    reqs = [GenRequest(prompt_ids=p, max_new_tokens=tokens, stop_at_eos=False, logprobs=logprobs,
                       on_event=lambda e, i=i: on_event(i, e)) for i, p in enumerate(prompts)]
    try:
        if together:
            with engine._cond:  # the loop takes this lock to pick up work: all are queued before it looks
                for r in reqs:
                    engine.submit(r)
        for r, d in zip(reqs, done):
            if not together:
                engine.submit(r)
            assert d.wait(60), engine.load()
        return got, [r.cached_tokens for r in reqs], engine.load()
    finally:
        engine.close()


def _assert_same_replies(got, want):
    for g, w in zip(got, want):
        assert [t for t, _ in g] == [t for t, _ in w]
        torch.testing.assert_close(torch.tensor([lp for _, lp in g]), torch.tensor([lp for _, lp in w]),
                                   atol=1e-5, rtol=0)


def test_the_serving_engine_reports_cached_tokens_and_replies_as_without_the_cache(model):
    system = make.prompt_of(50, 5)
    prompts = [system + make.prompt_of(6, 6), system + make.prompt_of(9, 7), system + make.prompt_of(6, 6)]
    got, cached, load = _engine_run(model, prompts, big_cache())
    want, none, _ = _engine_run(model, prompts, None)
    _assert_same_replies(got, want)
    assert cached == [0, 48, 48] and none == [0, 0, 0]  # the third: the whole prompt seen, its last block computed
    assert load["cached_tokens"] == 96 and load["prefix_cache_hit_tokens"] == 96


def test_two_requests_with_one_new_prefix_compute_it_once(tiny):
    """Queued together, the second waits one prefill for the first to store the shared blocks (PrefixCache.waves),
    then copies them: 48 of its tokens are not computed again, and both replies are what they are alone."""
    system = make.prompt_of(50, 8)
    prompts = [system + make.prompt_of(5, 9), system + make.prompt_of(8, 10), make.prompt_of(20, 11)]
    got, cached, load = _engine_run(tiny, prompts, big_cache(), together=True)
    want, _, _ = _engine_run(tiny, prompts, None, together=True)
    _assert_same_replies(got, want)
    assert cached == [0, 48, 0] and load["prefills"] == 3
    assert PrefixCache(2 ** 20, BLOCK).waves(prompts) == [[0, 2], [1]]  # an empty cache: one new block twice
    many = [system + make.prompt_of(30, 12 + i) for i in range(5)] + [system + make.prompt_of(30, 12)]
    assert PrefixCache(2 ** 20, BLOCK).waves(many) == [[0], [1, 2, 3, 4, 5]]  # the 6th: the 1st again, all stored


def test_a_weight_update_empties_the_cache(tiny):
    """Stale keys would give the old weights' replies: after an in-place update (an optimizer step, a weight sync's
    load_state_dict) the engine, generate and rollouts recompute, and reply as a cache-less run on the new weights."""
    model = make.model_for("tiny", False)
    system = make.prompt_of(40, 12)
    prompts = [system + make.prompt_of(4, 13)]
    pc = big_cache()
    _engine_run(model, prompts, pc)
    assert pc.blocks == 2
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    got, cached, _ = _engine_run(model, prompts, pc)
    want, _, _ = _engine_run(model, prompts, None)
    _assert_same_replies(got, want)
    assert cached == [0] and pc.clears == 1
    model.load_state_dict(tiny.state_dict())  # a weight sync
    assert list(generate_tokens(model, torch.tensor([prompts[0]]), 8, temperature=0, eos_token_id=None,
                                prefix_cache=pc)) == \
        list(generate_tokens(tiny, torch.tensor([prompts[0]]), 8, temperature=0, eos_token_id=None))
    assert pc.clears == 2 and pc.hit_tokens == 0


def test_rollouts_sample_the_same_with_the_cache(model):
    """GRPO's shape: 3 prompts sharing a system prompt, G = 4 completions each, per-row seeds. With the cache the
    shared blocks are computed once (one prompt, then the other two on top of them), and every sample, mask and
    log-prob is what it is without."""
    system = make.prompt_of(48, 20)
    prompts = [system + make.prompt_of(n, 21 + n) for n in (5, 9, 3)]
    G, width = 4, max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts]).repeat_interleave(G, 0)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(G, 0)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, eos_id=2, pad_id=0)
    seeds = row_seeds(7, 3, torch.arange(3), G)
    pc = big_cache()
    got = sample_completions(model, ids, mask, params, seeds=seeds, prefix_cache=pc)
    want = sample_completions(model, ids, mask, params, seeds=seeds)
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.completion_mask, want.completion_mask)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    assert pc.hit_tokens == 2 * 48  # the second wave's two prompts took the 3 shared blocks


def _grpo_batch(system_len=48, G=4, seed=7, step=3):
    system = make.prompt_of(system_len, 20)
    prompts = [system + make.prompt_of(n, 21 + n) for n in (5, 9, 3)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts]).repeat_interleave(G, 0)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(G, 0)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, eos_id=2, pad_id=0)
    return ids, mask, params, row_seeds(seed, step, torch.arange(3), G)


def test_train_rollout_prefix_cache_mb_gives_the_worker_sampler_a_cache_emptied_at_each_update(tiny):
    from types import SimpleNamespace

    from minimind_ray.rl.plan import build_rollout
    from minimind_ray.rl.rollout_config import RolloutConfig

    def engine(mb):
        return build_rollout(SimpleNamespace(train=SimpleNamespace(rollout=RolloutConfig(prefix_cache_mb=mb))),
                             SimpleNamespace(autocast=None))

    on, off = engine(8), engine(0)
    assert off.prefix_cache is None and on.prefix_cache.budget_bytes == 8 * 2 ** 20
    batch = _grpo_batch()
    for e in (on, off):
        e.update_policy(tiny, 0)
    got, want = on.generate(*batch[:3], seeds=batch[3]), off.generate(*batch[:3], seeds=batch[3])
    assert torch.equal(got.completion_ids, want.completion_ids) and on.prefix_cache.blocks == 3
    on.update_policy(tiny, 1)
    assert on.prefix_cache.blocks == 0


def test_a_rollout_actor_with_the_cache_samples_what_one_without_does_across_weight_versions(tiny):
    """The actor class itself, without Ray: each version's weights are loaded into its model in place
    (load_state_dict), which empties its cache, so version 2 never samples from version 1's keys."""
    import dataclasses

    from minimind_ray.rl.actors import RolloutActor

    other = make.model_for("tiny", True)  # other weights of the same shapes (drawn with YaRN's config)
    versions = {1: tiny.state_dict(), 2: other.state_dict()}
    cached, plain = (RolloutActor(dataclasses.asdict(tiny.cfg), 1, mb) for mb in (8, 0))
    batch = _grpo_batch()
    for v, weights in versions.items():
        for actor in (cached, plain):
            actor.load(v, weights)
        got, want = (a.generate(v, *batch) for a in (cached, plain))
        assert torch.equal(got.completion_ids, want.completion_ids), v
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    assert cached.prefix_cache.clears == 1 and cached.prefix_cache.hit_tokens == 2 * 2 * 48


@pytest.mark.parametrize("verb, extra", [("generate", ["--prompt", "hi"]), ("chat", [])])
def test_a_negative_prefix_cache_flag_is_refused_in_one_line_before_any_weights_load(capsys, verb, extra):
    from tests.unit.test_cli_main import refused

    line = refused(capsys, verb, "no-such-weights.pth", *extra, "--prefix-cache-mb", "-1")
    assert line == "error: --prefix-cache-mb: must be >= 0 (got -1)"
