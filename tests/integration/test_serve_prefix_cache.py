"""The prefix cache through the API: a real Serve app on the session's Ray serving the suite's one trained tiny model
(tiny_baseline), the official `openai` client, and Ray's Prometheus endpoint. Two chats that share a system prompt:
the second reports the shared whole blocks as ``usage.prompt_tokens_details.cached_tokens`` (streamed or not) and
replies, greedy, exactly as ``generate`` does; the replica's hit-rate gauge and cached-token counter reach
Prometheus. The engine-level checks (logits within 1e-5, the memory bound, weight updates, block boundaries) are in
tests/unit/test_prefix_cache.py."""
from __future__ import annotations

import socket
import time

import openai
import pytest
import torch

from .test_serve import metric, scrape

pytestmark = pytest.mark.integration

SYSTEM = ("You are a careful assistant for a small shop that sells bicycles, their parts and repairs. Answer in "
          "one short sentence, name prices in euros, and never promise a repair date you cannot keep.")
BLOCK = 16  # model/prefix_cache.py's DEFAULT_BLOCK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cached_app(tiny_baseline):
    from ray import serve
    from ray.serve.api import RunTarget

    from minimind_ray.serve.app import build_app

    shared, res = tiny_baseline[:2]
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run_many([RunTarget(build_app({"weights": res.run_dir, "model_name": "tiny-cached", "cpus_per_replica": 1,
                                         "prefix_cache_mb": 8}),
                              name="serve-prefix-cache", route_prefix="/", logging_config={"log_level": "WARNING"})])
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0), res.run_dir
    finally:
        serve.shutdown()


def test_a_second_chat_sharing_a_system_prompt_reports_its_cached_tokens(cached_app):
    from minimind_ray.generate import generate_tokens, render_prompt
    from minimind_ray.store.weights import build_inference_model
    from minimind_ray.tokenizer import resolve_tokenizer

    client, run_dir = cached_app
    model, lw = build_inference_model(run_dir)
    data = lw.run_config["data"]
    tok = resolve_tokenizer(data["tokenizer"], data["cache_dir"], lw.model_cfg.generation)
    turns = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
             for q in ("How much is a new chain?", "Can you fix a flat tyre today?")]
    ids = [tok.encode(render_prompt(tok, m)) for m in turns]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shared >= 2 * BLOCK, "the system prompt must cover whole blocks for this test to say anything"

    first = client.chat.completions.create(model="tiny-cached", messages=turns[0], temperature=0, max_tokens=16)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model="tiny-cached", messages=turns[1], temperature=0, max_tokens=16)
    assert second.usage.prompt_tokens == len(ids[1])
    assert second.usage.prompt_tokens_details.cached_tokens == shared // BLOCK * BLOCK
    want = list(generate_tokens(model, torch.tensor([ids[1]]), 16, temperature=0, eos_token_id=tok.eos_id))
    assert second.choices[0].message.content == tok.decode([t for t in want if t != tok.eos_id],
                                                           skip_special_tokens=True)
    again = list(client.chat.completions.create(model="tiny-cached", messages=turns[1], temperature=0, max_tokens=16,
                                                stream=True, stream_options={"include_usage": True}))
    whole = (len(ids[1]) - 1) // BLOCK * BLOCK  # the same prompt again: all of it but its last token's block
    assert again[-1].usage.prompt_tokens_details.cached_tokens == whole
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == \
        second.choices[0].message.content


def test_the_hit_rate_reaches_prometheus(cached_app):
    """Two chats sharing the system prompt: cached prompt tokens counted, and the hit-rate gauge between 0 and 1
    (the agent reads the replica every few seconds)."""
    client = cached_app[0]
    for q in ("Do you sell helmets?", "Do you sell lights?"):
        client.chat.completions.create(model="tiny-cached", max_tokens=2, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
    app = {"application": "serve-prefix-cache"}
    deadline, samples = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        samples = scrape()
        if metric(samples, "ray_minimind_serve_prompt_cached_tokens_total", **app) >= 2 * BLOCK and \
                metric(samples, "ray_minimind_serve_prefix_cache_hit_rate", **app) > 0:
            break
        time.sleep(1)
    assert metric(samples, "ray_minimind_serve_prompt_cached_tokens_total", **app) >= 2 * BLOCK
    assert 0 < metric(samples, "ray_minimind_serve_prefix_cache_hit_rate", **app) < 1
