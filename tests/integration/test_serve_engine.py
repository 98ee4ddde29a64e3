"""The serving engine and reply text, without Ray: the real model, the real tokenizers.

The batching loop must give every request what ``generate`` gives it alone, while requests join
(prefilled alone, their cached keys moved to where the batch puts them) and leave (the shared
padding cut off) between decode steps.
"""
from __future__ import annotations

import threading

import pytest
import torch

from minimind_ray.config import ModelConfig
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.serve.engine import Engine, GenRequest


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model(ModelConfig(**preset_values("tiny")), seed=3).eval()


def solo(model, prompt, n, seed=None, temperature=0.0, **sampling):
    """What ``generate`` gives this prompt alone (the reference)."""
    from minimind_ray.generate import generate_tokens

    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return list(generate_tokens(model, torch.tensor([prompt]), n, temperature=temperature, eos_token_id=None,
                                generator=gen, **sampling))


class Collector:
    """A request's events, and a hook that runs when its k-th token arrives (on the engine thread)."""

    def __init__(self, prompt, n, at_token=None, then=None, **kw):
        self.tokens, self.logprobs, self.events, self.end, self.done = [], [], [], None, threading.Event()
        self.at_token, self.then = at_token, then
        self.req = GenRequest(prompt_ids=prompt, max_new_tokens=n, on_event=self.on_event, stop_at_eos=False, **kw)

    def on_event(self, event):
        self.events.append(event)
        if event[0] == "token":
            self.tokens.append(event[1])
            if len(event) > 2:
                self.logprobs.append(event[2])
            if self.then is not None and len(self.tokens) == self.at_token:
                self.then()
        else:
            self.end = event
            self.done.set()


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 6400, (n,), generator=g).tolist() for n in lengths]


def test_a_lone_request_gets_exactly_generates_tokens(model):
    engine = Engine(model, eos_id=2, max_batch=8, context=4096)
    try:
        p = prompts([11])[0]
        greedy = Collector(p, 24)
        engine.submit(greedy.req)
        assert greedy.done.wait(60) and greedy.end == ("end", "length")
        assert greedy.tokens == solo(model, p, 24)
        sampled = Collector(p, 24, temperature=0.9, top_k=40, top_p=0.8, seed=7)
        engine.submit(sampled.req)
        assert sampled.done.wait(60)
        assert sampled.tokens == solo(model, p, 24, temperature=0.9, top_k=40, top_p=0.8, seed=7)
        assert sampled.tokens != greedy.tokens
    finally:
        engine.close()


def test_requests_joining_and_leaving_mid_batch_match_their_solo_runs(model):
    """A chain: each request is submitted when the one before has a few tokens, so it joins a running
    batch; longer and shorter prompts than the batch's length (both shift directions), rows that leave
    early (the common padding is cut), and one aborted mid-way."""
    engine = Engine(model, eos_id=2, max_batch=8, context=4096)
    try:
        ps = prompts([5, 30, 3, 12, 40])
        lengths = [30, 8, 26, 12, 10]
        cs = [Collector(p, n) for p, n in zip(ps, lengths)]
        for c, nxt in zip(cs, cs[1:]):
            c.at_token, c.then = 3, (lambda r=nxt.req: engine.submit(r))
        aborted = Collector(prompts([9], seed=1)[0], 50, at_token=4)
        aborted.then = lambda: aborted.req.abort("test")
        cs[2].then = lambda a=aborted.req, n=cs[3].req: (engine.submit(n), engine.submit(a))
        engine.submit(cs[0].req)
        for c in cs:
            assert c.done.wait(120), engine.load()
        for i, (c, p, n) in enumerate(zip(cs, ps, lengths)):
            assert c.end == ("end", "length")
            assert c.tokens == solo(model, p, n), f"request {i} (prompt {len(p)} tokens) differs from its solo run"
        stats = engine.load()
        assert stats["requests_aborted"] == {"test": 1} and stats["running"] == 0
        assert 4 <= len(aborted.tokens) < 50
        assert stats["mean_batch"] > 2  # they really ran together
    finally:
        engine.close()


def test_the_context_limit_ends_a_reply_like_generate(model):
    engine = Engine(model, eos_id=2, max_batch=4, context=20)
    try:
        c = Collector(prompts([15])[0], 100)
        engine.submit(c.req)
        assert c.done.wait(60)
        assert c.end == ("end", "length") and len(c.tokens) == 5  # prompt 15 + 5 = the 20-token context
        full = Collector(prompts([20])[0], 100)  # no room left: no token, as generate yields none
        engine.submit(full.req)
        assert full.done.wait(60) and full.end == ("end", "length") and full.tokens == []
    finally:
        engine.close()


def test_n_samples_share_one_prefill_and_each_draws_what_it_would_alone(model):
    """The n rows of one API request: one prefill of their common prompt, then each row samples with its
    own seeded generator exactly what the same request alone would (the rows have no padding)."""
    engine = Engine(model, eos_id=2, max_batch=8, context=4096)
    try:
        p = prompts([13], seed=4)[0]
        cs = [Collector(p, 20, temperature=0.9, top_k=40, top_p=0.9, seed=s) for s in (5, 6, 7)]
        engine.submit([c.req for c in cs])
        for c in cs:
            assert c.done.wait(60)
        stats = engine.load()
        assert stats["prefills"] == 1 and stats["prompt_tokens"] == 13 and stats["mean_batch"] == 3
        for s, c in zip((5, 6, 7), cs):
            assert c.tokens == solo(model, p, 20, seed=s, temperature=0.9, top_k=40, top_p=0.9), s
        assert len({tuple(c.tokens) for c in cs}) == 3
        with pytest.raises(ValueError, match="one prompt"):
            engine.submit([Collector(p, 2).req, Collector(p[:-1], 2).req])
    finally:
        engine.close()


def reference_logprobs(model, ids, temperature=1.0):
    """log_softmax of the model's logits at every position of ``ids`` (one plain forward, no cache)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / temperature, dim=-1)


def test_logprobs_of_generated_and_prompt_tokens_are_the_models(model):
    """A token's log-prob (at the request's temperature, the model's own at 0) and the top k, from the decode
    steps; the prompt's from its one prefill (completions' echo), with max_new_tokens 0 generating nothing."""
    engine = Engine(model, eos_id=2, max_batch=4, context=4096)
    try:
        p = prompts([9], seed=5)[0]
        greedy = Collector(p, 6, logprobs=3)
        hot = Collector(p, 6, logprobs=0, temperature=0.7, seed=1)
        scored = Collector(p, 0, prompt_logprobs=2)
        for c in (greedy, hot, scored):
            engine.submit(c.req)
        for c in (greedy, hot, scored):
            assert c.done.wait(60)
        for c, t in ((greedy, 1.0), (hot, 0.7)):
            ref = reference_logprobs(model, p + c.tokens, t)
            for j, (token, (lp, top)) in enumerate(zip(c.tokens, c.logprobs)):
                assert abs(lp - float(ref[len(p) - 1 + j, token])) < 1e-4
            assert all(len(top) == (3 if c is greedy else 0) for _, top in c.logprobs)
        assert all(top[0][0] == token and top[0][1] == lp for token, (lp, top) in zip(greedy.tokens, greedy.logprobs))
        assert scored.tokens == [] and scored.end == ("end", "length")
        (kind, rows), = [e for e in scored.events if e[0] == "prompt_logprobs"]
        ref = reference_logprobs(model, p)
        assert rows[0] == (None, None) and len(rows) == len(p)
        for j, (lp, top) in enumerate(rows[1:], start=1):
            assert abs(lp - float(ref[j - 1, p[j]])) < 1e-4 and len(top) == 2
    finally:
        engine.close()


def test_rows_counts_running_and_waiting_and_forgets_requests_that_left_while_waiting(model):
    engine = Engine(model, eos_id=2, max_batch=1, context=4096)
    try:
        started = threading.Event()
        running = Collector(prompts([5])[0], 400, at_token=1, then=started.set)
        engine.submit(running.req)
        assert started.wait(60)
        waiting = [Collector(prompts([4], seed=i)[0], 3) for i in range(3)]
        for c in waiting:
            engine.submit(c.req)
        assert engine.rows() == 4 and engine.load()["waiting_peak"] == 3
        waiting[0].req.abort("timeout")  # timed out while waiting: its place is freed at the next submit
        extra = Collector(prompts([4], seed=9)[0], 3)
        engine.submit(extra.req)
        assert engine.rows() == 4
        running.req.abort("disconnected")
        for c in (*waiting[1:], extra):
            assert c.done.wait(60)
        assert engine.load()["requests_aborted"] == {"timeout": 1, "disconnected": 1} and engine.rows() == 0
        assert waiting[0].tokens == []
    finally:
        engine.close()


# --------------------------------------------------------------------------- reply text


@pytest.fixture(scope="module")
def tokenizers():
    from minimind_ray.tokenizer import load_tokenizer
    from tests.conftest import minimind_tokenizer_dir

    return {g: load_tokenizer(str(minimind_tokenizer_dir(g))) for g in ("minimind2", "minimind3")}


def replay(tok, text, stop=(), reasoning=False):
    """Feed ``text``'s tokens one by one; returns (deltas, ReplyText)."""
    from minimind_ray.generate import StreamDecoder
    from minimind_ray.serve.replies import ReplyText

    reply = ReplyText(StreamDecoder(tok), list(stop), reasoning)
    deltas = []
    for t in tok.encode(text):
        deltas += reply.push(t)
        if reply.stopped:
            break
    return deltas + reply.finish(), reply


def test_a_stop_string_across_tokens_ends_the_reply_before_it(tokenizers):
    tok = tokenizers["minimind2"]
    deltas, reply = replay(tok, "The capital is Paris.\nUser: and Spain?", stop=["\nUser:"])
    assert reply.stopped and "".join(t for _, t in deltas) == "The capital is Paris."
    # nothing was sent that the stop string later took back
    deltas, reply = replay(tok, "北京是中国的首都。", stop=["首都"])
    assert "".join(t for _, t in deltas) == "北京是中国的" and reply.stopped
    deltas, reply = replay(tok, "no stop here", stop=["zzz"])
    assert "".join(t for _, t in deltas) == "no stop here" and not reply.stopped


def test_minimind3_thinking_splits_reasoning_from_content(tokenizers):
    """With thinking on, minimind-3's template opens a <think> block; the reply's reasoning and its
    answer come back apart, as MiniMind's own server returns them."""
    from minimind_ray.generate import render_prompt

    tok = tokenizers["minimind3"]
    msgs = [{"role": "user", "content": "2+2?"}]
    assert render_prompt(tok, msgs, True).endswith("<think>\n")
    assert render_prompt(tok, msgs, False).endswith("<think>\n\n</think>\n\n")
    deltas, reply = replay(tok, "Two plus two.\nThat is 4.</think>\n\nIt is 4.", reasoning=True)
    assert "".join(reply.reasoning) == "Two plus two.\nThat is 4."
    assert "".join(reply.content) == "It is 4."
    assert {f for f, _ in deltas} == {"reasoning_content", "content"}
    _, plain = replay(tok, "It is 4.", reasoning=False)
    assert "".join(plain.content) == "It is 4." and not plain.reasoning
