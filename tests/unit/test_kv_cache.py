"""The static KV cache (model/kv_cache.py) and every decode path on it.

The tokens are checked against tests/fixtures/decode_golden.json: what the decode paths gave before the cache
existed (commit b090f53: a list of per-layer tensors grown with ``torch.cat``, batches left-padded), for
MiniMind2 and minimind-3, dense and MoE, with and without YaRN: ``generate`` alone (greedy and seeded
sampling), RL rollouts of a batch whose rows end at different steps (per-row seeds, and one generator), and the
serving engine with rows joining and leaving a running batch."""
from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch

from minimind_ray.model.kv_cache import KVCache

torch.set_num_threads(1)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = json.loads((FIXTURES / "decode_golden.json").read_text())
CASES = [(p, y) for p in ("tiny", "tiny-moe", "tiny3", "tiny3-moe") for y in (False, True)]


def _maker():
    spec = importlib.util.spec_from_file_location("make_decode_golden", FIXTURES / "make_decode_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make = _maker()


def case_id(preset, yarn):
    return f"{preset}{'+yarn' if yarn else ''}"


@pytest.fixture(scope="module", params=CASES, ids=[case_id(*c) for c in CASES])
def case(request):
    preset, yarn = request.param
    return make.model_for(preset, yarn), GOLDEN[case_id(preset, yarn)]


def test_generate_gives_the_old_paths_tokens(case):
    model, want = case
    assert make.solo(model, make.prompt_of(11, 21), 20) == want["greedy_11"]
    assert make.solo(model, make.prompt_of(30, 22), 20) == want["greedy_30"]
    assert make.solo(model, make.prompt_of(11, 21), 20, seed=7, **make.SAMPLING) == want["sampled_11"]
    assert make.solo(model, make.prompt_of(30, 22), 20, seed=8, **make.SAMPLING) == want["sampled_30"]


def test_rollouts_give_the_old_paths_tokens_and_logprobs(case):
    model, want = case
    prompts = [make.prompt_of(n, seed) for seed, n in enumerate(make.ROLLOUT_PROMPTS)]
    for kind, seeded in (("rollout_seeded", True), ("rollout_generator", False)):
        got = make.rollout(model, prompts, want["rollout_eos"], seeded)
        assert got["ids"] == want[kind]["ids"] and got["mask"] == want[kind]["mask"], kind
        torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(want[kind]["logprobs"]),
                                   atol=2e-5, rtol=0)
    lengths = {sum(m) for m in want["rollout_seeded"]["mask"]}
    assert len(lengths) > 1  # rows really left the batch at different steps


def test_the_serving_engine_gives_the_old_paths_tokens_while_rows_join_and_leave(case):
    """Four requests in a chain, each submitted when the one before has a few tokens: greedy and seeded, two
    prompt lengths, replies of different lengths (rows leave while others run, and a later one takes a freed
    slot)."""
    from minimind_ray.serve.engine import Engine, GenRequest

    model, want = case
    p11, p30 = make.prompt_of(11, 21), make.prompt_of(30, 22)
    plan = [(p11, 20, {}, "greedy_11"), (p30, 9, dict(seed=8, **make.SAMPLING), "sampled_30"),
            (p11, 14, dict(seed=7, **make.SAMPLING), "sampled_11"), (p30, 20, {}, "greedy_30")]
    engine = Engine(model, eos_id=2, max_batch=3, context=4096)
    tokens, done = [[] for _ in plan], [threading.Event() for _ in plan]
    reqs = []

    def on_event(i, event):
        if event[0] == "token":
            tokens[i].append(event[1])
            if len(tokens[i]) == 3 and i + 1 < len(plan):
                engine.submit(reqs[i + 1])
        else:
            assert event == ("end", "length"), event
            done[i].set()

    for i, (prompt, n, sampling, _) in enumerate(plan):
        reqs.append(GenRequest(prompt_ids=prompt, max_new_tokens=n, stop_at_eos=False,
                               on_event=lambda e, i=i: on_event(i, e), **sampling))
    try:
        engine.submit(reqs[0])
        for d in done:
            assert d.wait(60), engine.load()
        for (_, n, _, key), got in zip(plan, tokens):
            assert got == want[key][:n], key
        assert engine.load()["mean_batch"] > 2
    finally:
        engine.close()


# --------------------------------------------------------------------------- the cache itself


@pytest.fixture(scope="module")
def tiny():
    return make.model_for("tiny", False)


def test_rows_join_and_leave_without_moving_the_others(tiny):
    """Slots come and go; the buffers are written in place (same storage, step after step), and a row that
    leaves or joins leaves every other row's keys bit for bit as they were."""
    cache = KVCache.for_model(tiny, slots=3, capacity=64)
    ids = torch.randint(3, 6400, (3, 10))
    with torch.no_grad():
        assert cache.alloc(3) == [0, 1, 2]
        tiny(ids, kv_cache=cache, input_lengths=[10, 6, 8])
        storage = cache.k.data_ptr()
        for _ in range(5):
            tiny(ids[:, :1], kv_cache=cache)
        assert cache.lengths == [15, 11, 13] and cache.k.data_ptr() == storage
        before = cache.k[:, [0, 2]].clone(), cache.v[:, [0, 2]].clone()
        cache.release([1])
        assert cache.lengths[1] == 0 and cache.alloc(1) == [1]
        tiny(ids[1:2, :4], kv_cache=cache, slots=[1])  # a new row prefilled into the freed slot
        assert torch.equal(cache.k[:, [0, 2]], before[0]) and torch.equal(cache.v[:, [0, 2]], before[1])
        assert cache.lengths == [15, 4, 13] and cache.k.data_ptr() == storage
        with pytest.raises(ValueError, match="slots"):
            cache.alloc(1)


def test_a_forked_or_rewound_row_continues_as_the_sequence_would(tiny):
    x = torch.randint(3, 6400, (1, 12))
    with torch.no_grad():
        full = tiny(x).logits[0]  # (12, V)
        cache = KVCache.for_model(tiny, slots=3)
        tiny(x[:, :8], kv_cache=cache, slots=[0])
        cache.fork(0, [1, 2])
        out = tiny(x[:, 8:].expand(2, -1), kv_cache=cache, slots=[1, 2]).logits
        torch.testing.assert_close(out, full[8:].expand(2, -1, -1), atol=1e-5, rtol=0)
        tiny(torch.randint(3, 6400, (1, 3)), kv_cache=cache, slots=[0])  # another continuation of row 0
        cache.rewind(0, 8)
        torch.testing.assert_close(tiny(x[:, 8:], kv_cache=cache, slots=[0]).logits[0], full[8:], atol=1e-5,
                                   rtol=0)


@pytest.mark.parametrize("keys_first", [True, False], ids=["keys-first", "sdpa"])
def test_both_cpu_attentions_of_a_cached_step_give_each_rows_own_logits(tiny, monkeypatch, keys_first):
    """A CPU decode step's attention multiplies keys x queries from ``_KEYS_FIRST`` key positions over the batch
    on, SDPA below (model/minimind.py). Either way, each row of a batch of rows of different lengths (a mask) and
    of one length (no mask), after a joiner's prefill into a cache of other rows, gets the logits of its own
    sequence run alone without a cache (float32 sums in another order: within 5e-5 of logits of size ~10)."""
    import minimind_ray.model.minimind as mm

    monkeypatch.setattr(mm, "_KEYS_FIRST", 0 if keys_first else 1 << 40)
    sdpa, sdpa_calls = mm.F.scaled_dot_product_attention, []
    monkeypatch.setattr(mm.F, "scaled_dot_product_attention", lambda *a, **kw: sdpa_calls.append(1) or sdpa(*a, **kw))
    x = torch.randint(3, 6400, (3, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = tiny(x).logits  # (3, 24, V)
        cache = KVCache.for_model(tiny, slots=3)
        tiny(x[:2, :9], kv_cache=cache, input_lengths=[9, 5])  # rows 0, 1: prompts of 9 and 5
        tiny(x[1:2, 5:6], kv_cache=cache, slots=[1])  # row 1 catches up one token: lengths 9, 6
        joined = tiny(x[2:, :7], kv_cache=cache, slots=[2]).logits  # a joiner's prefill, a fresh row alone
        torch.testing.assert_close(joined[0], full[2, :7], atol=5e-5, rtol=0)
        uneven = tiny(torch.stack([x[0, 9:10], x[1, 6:7], x[2, 7:8]]), kv_cache=cache).logits[:, 0]  # masked
        torch.testing.assert_close(uneven, torch.stack([full[0, 9], full[1, 6], full[2, 7]]), atol=5e-5, rtol=0)
        for slot in range(3):
            cache.rewind(slot, 7)
        even = tiny(x[:, 7:12], kv_cache=cache).logits  # rows of one length: several new tokens, then one
        torch.testing.assert_close(even, full[:, 7:12], atol=5e-5, rtol=0)
        sdpa_calls.clear()
        one = tiny(x[:, 12:13], kv_cache=cache).logits[:, 0]  # one token per row, rows of one length: no mask
        torch.testing.assert_close(one, full[:, 12], atol=5e-5, rtol=0)
        assert len(sdpa_calls) == (0 if keys_first else tiny.cfg.num_hidden_layers)  # the path the test meant


def test_the_cache_grows_on_demand_and_refuses_past_its_limit(tiny):
    cache = KVCache.for_model(tiny, slots=1, max_len=200)
    x = torch.randint(3, 6400, (1, 200))
    with torch.no_grad():
        full = tiny(x).logits[0, -1]
        tiny(x[:, :10], kv_cache=cache)
        assert cache.capacity == 64  # the first need (10), at least 64
        for t in range(10, 199):
            tiny(x[:, t:t + 1], kv_cache=cache)
        last = tiny(x[:, 199:], kv_cache=cache).logits[0, -1]
        assert cache.capacity == 200 and cache.lengths == [200]  # 64 -> 128 -> 200 (the limit)
        torch.testing.assert_close(last, full, atol=1e-4, rtol=1e-5)  # logits of size ~10: float32 rounding
        with pytest.raises(ValueError, match="200 positions"):
            tiny(x[:, :1], kv_cache=cache)
        with pytest.raises(ValueError, match="attention_mask"):
            tiny(x[:, :1], kv_cache=cache, attention_mask=torch.ones(1, 1))


def test_rollouts_refuse_a_prompt_mask_that_is_not_a_left_padding():
    from minimind_ray.rl.rollout import right_aligned

    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    got, lengths = right_aligned(ids, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
    assert got[0, :2].tolist() == [5, 6] and got[1].tolist() == [7, 8, 9, 10] and lengths == [2, 4]
    with pytest.raises(ValueError, match="left-padded"):
        right_aligned(ids, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))


# --------------------------------------------------------------------------- admission


class RowCounter(torch.nn.Module):
    """The model, noting what the engine reports as held (``rows()``) at every forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.cfg, self.engine, self.seen = inner, inner.cfg, None, []

    def forward(self, *args, **kw):
        if self.engine is not None:
            self.seen.append(self.engine.rows())
        return self.inner(*args, **kw)


def test_rows_joining_together_are_counted_once_while_they_are_prefilled(tiny):
    """The count behind the replica's 429 (app.py: rows held + rows asked > max_batch + max_queued). Four
    requests that join together were counted twice while they were admitted (in the batch and still
    'joining'), so a replica at exactly its limit refused requests it had room for."""
    from minimind_ray.serve.engine import Engine, GenRequest

    counter = RowCounter(tiny)
    engine = Engine(counter, eos_id=2, max_batch=4, context=4096)
    counter.engine = engine
    ends = []
    done = threading.Event()

    def on_event(event):
        if event[0] == "end":
            ends.append(event)
            if len(ends) == 4:
                done.set()

    with engine._cond:  # the loop takes this lock to pick up work: all four are queued before it looks
        for seed in range(4):
            engine.submit(GenRequest(prompt_ids=make.prompt_of(5 + seed, seed), max_new_tokens=6, on_event=on_event,
                                     stop_at_eos=False))
        assert engine.rows() == 4
    try:
        assert done.wait(60)
        # one prefill of the four, then 5 decode steps (the 6th token of each ends it): 4 held at every forward
        assert counter.seen == [4] * 6 and engine.load()["prefills"] == 4 and engine.rows() == 0
    finally:
        engine.close()
