"""Serving on Ray Serve with real parts: a tiny SFT model trained and registered in MLflow here (a real
`mlflow server`), the real Serve app on the session's Ray, the official `openai` client, raw HTTP for
what a client library would not send, Ray's Prometheus endpoint, and a real Chromium driven by Selenium
for the chat page.

Three apps run side by side: one from the run directory (``/``), one from the registry
(``models:/serve-tiny/1`` at ``/registry``), and a guarded one (``/guarded``: an API key, a batch of 2
with 2 more waiting, a 3 s timeout) serving a tiny model trained here, without Ray, on the demo
corpus's calculator tool-call chats. Greedy replies are compared with what the library's ``generate``
gives for the same weights and prompt.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch


from .browser import chromium
from .helpers import new_shared, run_tiny
from .serve_fuzz import chat_body, completion_body, raw_bodies

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PROMPT = "What is the capital of France?"
CONTEXT, CAP = 4096, 4000  # room for a long stream in the disconnect test
REGISTERED = "serve-tiny"
KEY = f"test-key-{uuid.uuid4().hex}"  # the guarded app's API key
GUARD = {"max_batch": 2, "max_queued": 2, "request_timeout_s": 3.0}
TOOL_MAX_STEPS = 200  # engine-level SFT steps on the tool-call chats at most (about 40-100 suffice)
SYSTEM = "You are MiniMind, a helpful assistant."  # the demo corpus's tool chats' system turn
RESULT = json.dumps({"result": 16})  # what the calculator returns for 3 + 8 + 5


def tool_turn(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def trained(ray_session, mlflow_server, tmp_path_factory):
    shared = new_shared(tmp_path_factory, "serve")
    # A few small steps: the model stays near its random init, whose greedy replies vary with the prompt.
    # (Trained further, a tiny model first learns to answer every prompt with newlines, which would
    # make equal replies prove little.)
    res = run_tiny(shared, "serve-sft", "train.stage=sft", "data.format=sft", "train.lr=1e-4", "cluster.num_workers=1",
                   f"tracking.uri={mlflow_server.uri}", f"tracking.registered_model={REGISTERED}", steps=4)
    assert res.metrics.get("model_version") == "1", res.metrics
    return res


def tool_replies(model, tok):
    """Greedy, as generate runs it: the reply to a calculator question with the tool offered; then, with that
    reply's first call and the tool's result sent back as a client would, the answer and whether it ended."""
    from minimind_ray.data.demo import CALCULATOR_TOOL
    from minimind_ray.generate import generate_tokens
    from minimind_ray.serve.model_io import render_chat

    def reply(messages):
        ids = tok.encode(render_chat(tok, messages, tools=[CALCULATOR_TOOL]))
        out = list(generate_tokens(model, torch.tensor([ids]), 100, temperature=0, eos_token_id=tok.eos_id))
        return tok.decode(out, skip_special_tokens=True), bool(out) and out[-1] == tok.eos_id

    msgs = tool_turn("What is 3 plus 8 plus 5?")
    first, _ = reply(msgs)
    calls = calls_in(first)
    if not calls:
        return first, "", False
    answer, ended = reply(msgs + [{"role": "assistant", "content": "", "tool_calls": calls[:1]},
                                  {"role": "tool", "content": RESULT}])
    return first, answer, ended


def calls_in(text):
    from minimind_ray.serve.replies import ToolCallText

    p = ToolCallText(["calculate"])
    events = p.push(text) + p.finish()
    return [v for f, v in events if f == "tool_call"]


def train_tool_model(tok, cache_dir, out: Path, max_steps=TOOL_MAX_STEPS):
    """The tiny preset trained on the demo corpus's calculator chats (demo:tool_sft) at engine level, without
    Ray, until its greedy reply to a question is one well-formed tool call and its reply after the tool's result
    is text: SFT's loss on the assistant tokens, the tied head run only on those (92 of 645 per chat).
    Returns (the .pth, the steps it took)."""
    from minimind_ray.data.demo import resolve_demo_path
    from minimind_ray.data.formats import Encoder

    with open(resolve_demo_path("demo:tool_sft", "sft", str(cache_dir))) as f:
        records = [json.loads(line) for line in f][:400]
    enc = Encoder("sft", tok, 672)
    assert enc.add(records) == []
    rows = enc._rows
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: a second thread costs more CPU than it saves time
    try:
        return _train(rows, tok, out, max_steps)
    finally:
        torch.set_num_threads(threads)


def _train(rows, tok, out, max_steps):
    import numpy as np
    import torch.nn.functional as F

    from minimind_ray.config import ModelConfig
    from minimind_ray.data.formats import collate
    from minimind_ray.model.minimind import build_model
    from minimind_ray.model.presets import preset_values
    from minimind_ray.store.pth import save_pth

    model = build_model(ModelConfig(**preset_values("tiny")), seed=0)
    head = model.lm_head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    B, n = 8, len(rows["ids"])
    for step in range(1, max_steps + 1):
        model.train()
        model.lm_head = torch.nn.Identity()  # hidden states out; the head only on the labelled positions
        idx = [(step * B + i) % n for i in range(B)]
        batch = collate("sft", {k: [v[i] for i in idx] for k, v in rows.items()}, np.array(idx), tok.pad_id, 672)
        hidden, y = model(batch["input_ids"]).logits, batch["targets"]
        loss = F.cross_entropy(head(hidden[y != -100]), y[y != -100])
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.lm_head = head
        if step >= 40 and step % 20 == 0:
            call, answer, ended = tool_replies(model.eval(), tok)
            calls = calls_in(call)
            if len(calls) == 1 and "expression" in json.loads(calls[0]["function"]["arguments"]) \
                    and ended and answer.strip() and "<tool_call>" not in answer:
                save_pth(model, str(out), dtype=torch.float32)
                return out, step
    raise AssertionError(f"no well-formed tool call after {max_steps} steps: {tool_replies(model.eval(), tok)}")


@pytest.fixture(scope="module")
def tool_model(trained, reference, tmp_path_factory):
    """(model, tokenizer, .pth) of the tool-calling model, with the run's builtin tokenizer."""
    from minimind_ray.store.weights import build_inference_model

    tok = reference[1]
    t0, cpu0 = time.monotonic(), time.process_time()
    pth, steps = train_tool_model(tok, Path(trained.run_dir).parents[1] / "data_cache",
                                  tmp_path_factory.mktemp("tool-model") / "tool_tiny.pth")
    print(f"tool model: {steps} steps, {time.monotonic() - t0:.1f} s ({time.process_time() - cpu0:.1f} CPU s)")
    return build_inference_model(str(pth))[0].eval(), tok, pth


@pytest.fixture(scope="module")
def served(trained, mlflow_server, tool_model):
    from ray import serve
    from ray.serve.api import RunTarget

    from minimind_ray.serve.app import build_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = {"context": CONTEXT, "max_tokens_cap": CAP, "cpus_per_replica": 1}
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    guarded = {"weights": str(tool_model[2]), "tokenizer": tool_model[1].path, "model_name": "tool-tiny",
               "api_key_sha256": hashlib.sha256(KEY.encode()).hexdigest(), **common, **GUARD}
    serve.run_many([
        RunTarget(build_app({"weights": trained.run_dir, "model_name": "tiny-sft", **common}), name="serve-run",
                  route_prefix="/", logging_config=quiet),
        RunTarget(build_app({"weights": f"models:/{REGISTERED}/1", "tracking_uri": mlflow_server.uri, **common}),
                  name="serve-registry", route_prefix="/registry", logging_config=quiet),
        RunTarget(build_app(guarded), name="serve-guarded", route_prefix="/guarded", logging_config=quiet),
    ])
    base = f"http://127.0.0.1:{port}"
    try:
        yield {"base": base, "client": openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0),
               "guarded": openai.OpenAI(base_url=f"{base}/guarded/v1", api_key=KEY, max_retries=0)}
    finally:
        serve.shutdown()  # later tests get their CPUs back


@pytest.fixture(scope="module")
def reference(trained):
    """The run's model and tokenizer, loaded the way `minimind-ray generate` loads them."""
    from minimind_ray.store.weights import build_inference_model
    from minimind_ray.tokenizer import resolve_tokenizer

    model, lw = build_inference_model(trained.run_dir)
    data = lw.run_config["data"]
    tok = resolve_tokenizer(data["tokenizer"], data["cache_dir"], lw.model_cfg.generation)
    return model, tok


def greedy_text(reference, messages, n, **sampling):
    """What the library's generate loop replies (the chat template, greedy unless told otherwise)."""
    from minimind_ray.generate import render_prompt, stream_reply
    from minimind_ray.model.sampling import SamplingParams

    model, tok = reference
    cfg = SamplingParams(max_new_tokens=n, **{"temperature": 0.0, **sampling})
    return "".join(stream_reply(model, tok, render_prompt(tok, messages), cfg))


def post(base, path, body: bytes, content_type="application/json", headers=None):
    req = urllib.request.Request(base + path, data=body, headers={"Content-Type": content_type, **(headers or {})},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(base):
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        return json.loads(r.read())


def chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny-sft", messages=messages, **kw)


def test_models_and_health(served, trained):
    models = served["client"].models.list().data
    assert [m.id for m in models] == ["tiny-sft"]
    h = health(served["base"])
    assert h["status"] == "ok" and h["model"] == "tiny-sft" and h["engine"]["running"] == 0
    # issue 47: the context the run trained at (data.max_seq_len: 64) beside the one served (--context)
    with urllib.request.urlopen(served["base"] + "/v1/models", timeout=30) as r:
        entry = json.loads(r.read())["data"][0]
    assert (entry["context_length"], entry["trained_context_length"]) == (CONTEXT, 64)
    # what `minimind-ray serve` prints once the app is up: the replica's own account, through Serve's handle
    from minimind_ray.serve.serve_verb import served_info, startup_line

    info = served_info("serve-run")
    assert info == {"model": "tiny-sft", "weights": trained.run_dir, "context_length": CONTEXT,
                    "trained_context_length": 64}
    assert startup_line(info) == f"serving tiny-sft ({trained.run_dir}): context {CONTEXT} tokens, trained at 64"


def test_greedy_replies_equal_generate_streamed_or_not(served, reference):
    msgs = [{"role": "user", "content": PROMPT}]
    want = greedy_text(reference, msgs, 32)
    assert want.strip(), "the model's greedy reply is blank: equality would prove little"
    reply = chat(served["client"], msgs, temperature=0, max_tokens=32)
    assert reply.choices[0].message.content == want
    stream = chat(served["client"], msgs, temperature=0, max_tokens=32, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == want and len([p for p in pieces if p]) > 1


def test_usage_counts_the_rendered_prompt_and_every_generated_token(served, reference):
    from minimind_ray.generate import generate_tokens, render_prompt

    model, tok = reference
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    prompt_ids = tok.encode(render_prompt(tok, msgs))
    generated = list(generate_tokens(model, torch.tensor([prompt_ids]), 40, temperature=0, eos_token_id=tok.eos_id))
    reply = chat(served["client"], msgs, temperature=0, max_tokens=40)
    u = reply.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == \
        (len(prompt_ids), len(generated), len(prompt_ids) + len(generated))
    assert reply.choices[0].finish_reason == ("stop" if generated[-1] == tok.eos_id else "length")
    chunks = list(chat(served["client"], msgs, temperature=0, max_tokens=40, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == \
        u.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    # the thinking switch reaches the template: enable_thinking=false adds MiniMind's empty think block
    off = chat(served["client"], msgs, temperature=0, max_tokens=1, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == len(tok.encode(render_prompt(tok, msgs, False))) > len(prompt_ids)


def test_stop_strings_and_seeds(served, reference):
    msgs = [{"role": "user", "content": "Tell me about Paris."}]
    full = greedy_text(reference, msgs, 40)
    # a stop string that first occurs after some text: the reply is that text
    at = next(i for i in range(1, len(full) - 1) if full.find(full[i:i + 2]) == i)
    cut = chat(served["client"], msgs, temperature=0, max_tokens=40, stop=[full[at:at + 2], "never-seen"])
    assert cut.choices[0].message.content == full[:at]
    assert cut.choices[0].finish_reason == "stop"
    seeded = dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    a = chat(served["client"], msgs, **seeded).choices[0].message.content
    b = chat(served["client"], msgs, **seeded).choices[0].message.content
    # a lone seeded request draws exactly what generate draws with that seed (top_k: the server default, 50)
    assert a == b == greedy_text(reference, msgs, 24, temperature=1.0, top_p=0.9, top_k=50, seed=1234)


LONG = " ".join(["hello"] * 5000)
BAD_REQUESTS = {
    "missing messages": ({"model": "tiny-sft"}, 400, "messages"),
    "messages not a list": ({"messages": "hi"}, 400, "messages"),
    "temperature a string": ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
                             "temperature"),
    "max_tokens a float": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, 400, "max_tokens"),
    "content a number": ({"messages": [{"role": "user", "content": 42}]}, 400, "messages.0.content"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    "max_tokens zero": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens negative": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens"),
    "max_tokens over the cap": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": CAP + 1}, 400,
                                "max_tokens"),
    "prompt longer than the context": ({"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    "a lone surrogate": ({"messages": [{"role": "user", "content": "ok \ud800"}]}, 400, "messages.0.content"),
    "an unknown field": ({"messages": [{"role": "user", "content": "hi"}], "logprob": True}, 400, "logprob"),
    "a refused field": ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 1.0}, 400,
                        "presence_penalty"),
    "unknown model": ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_openai_errors(served, case):
    body, status, param = BAD_REQUESTS[case]
    got, err = post(served["base"], "/v1/chat/completions", json.dumps(body).encode())
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    if case == "prompt longer than the context":
        assert err["error"]["code"] == "context_length_exceeded"


def test_non_json_bodies_are_refused_and_the_official_client_sees_400s(served):
    for raw in (b"not json", b"{\"messages\": [", b"[1, 2]", "\udcff".encode("utf-8", "surrogatepass")):
        status, err = post(served["base"], "/v1/chat/completions", raw)
        assert status == 400 and err["error"]["type"] == "invalid_request_error", raw
    with pytest.raises(openai.BadRequestError) as e:
        chat(served["client"], [{"role": "user", "content": "hi"}], max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    # and the server is still up and answering
    assert chat(served["client"], [{"role": "user", "content": "hi"}], max_tokens=4).usage.completion_tokens >= 1
    assert health(served["base"])["engine"]["running"] == 0


def wait_for(condition, timeout_s=120.0):
    """Poll ``condition`` until it returns something truthy (the server acts on a disconnect asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"condition not met within {timeout_s} s")


def test_a_client_that_disconnects_mid_stream_stops_its_generation(served):
    base = served["base"]
    before = health(base)["engine"]
    host, port = base[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "tiny-sft", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "max_tokens": CAP, "ignore_eos": True, "temperature": 0}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 2:  # the stream is flowing
        events += resp.fp.readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    after = wait_for(lambda: (lambda e: e if e["running"] == 0 and e["waiting"] == 0 else None)(
        health(base)["engine"]))
    aborted = after["requests_aborted"].get("disconnected", 0) - before["requests_aborted"].get("disconnected", 0)
    assert aborted == 1
    assert after["tokens_generated"] - before["tokens_generated"] < CAP  # it stopped well before max_tokens
    assert after["requests_finished"] == before["requests_finished"]


def test_a_registered_model_version_serves_from_models_uri(served, reference):
    """models:/serve-tiny/1 -> the run's model/ files and tokenizer, downloaded from the server: the same
    model as the run directory, so the same greedy reply."""
    client = openai.OpenAI(base_url=f"{served['base']}/registry/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [f"{REGISTERED}/1"]
    msgs = [{"role": "user", "content": PROMPT}]
    want = greedy_text(reference, msgs, 24)
    got = client.chat.completions.create(model=f"{REGISTERED}/1", messages=msgs, temperature=0, max_tokens=24)
    assert got.choices[0].message.content == want


def test_registry_aliases_resolve_and_unknown_versions_are_refused_before_ray(reference, mlflow_server):
    """models:/NAME/ALIAS and models:/NAME@ALIAS load the version the alias points at: the run's own
    weights (its fp32 safetensors); a version that does not exist is a one-line error."""
    from mlflow.tracking import MlflowClient

    from minimind_ray.serve.model_io import check_source, load_served_model

    MlflowClient(mlflow_server.uri).set_registered_model_alias(REGISTERED, "champion", "1")
    run_model = reference[0].state_dict()
    for uri in (f"models:/{REGISTERED}/champion", f"models:/{REGISTERED}@champion"):
        served = load_served_model(uri, tracking_uri=mlflow_server.uri)
        got = served.model.state_dict()
        assert got.keys() == run_model.keys() and all(torch.equal(got[k], run_model[k]) for k in got), uri
    with pytest.raises(ValueError, match=f"models:/{REGISTERED}/7: not found in the MLflow registry"):
        check_source(f"models:/{REGISTERED}/7", mlflow_server.uri)


# --------------------------------------------------------------------------- completions, log-probs, n


def model_logprobs(model, ids):
    """log_softmax of the model's logits at every position of ``ids`` (one plain forward)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completions_take_text_or_token_prompts_and_echo_their_logprobs(served, reference):
    """/v1/completions as lm-eval's local-completions model calls it: raw text (no chat template), several
    prompts, token-id prompts, and echo + logprobs for a log-likelihood (the prompt tokens' log-probs)."""
    from minimind_ray.generate import generate_tokens

    model, tok = reference
    client = served["client"]
    text = "The capital of France is"
    ids = tok.encode(text)
    want = list(generate_tokens(model, torch.tensor([ids]), 12, temperature=0, eos_token_id=tok.eos_id))
    got = client.completions.create(model="tiny-sft", prompt=text, max_tokens=12, temperature=0)
    assert got.object == "text_completion" and got.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want)
    both = client.completions.create(model="tiny-sft", prompt=[text, "Tell me about Paris."], max_tokens=12,
                                     temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text == got.choices[0].text
    assert both.usage.prompt_tokens == len(ids) + len(tok.encode("Tell me about Paris."))
    as_ids = client.completions.create(model="tiny-sft", prompt=ids, max_tokens=12, temperature=0)
    assert as_ids.choices[0].text == got.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-sft", prompt=text, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == got.choices[0].text
    seeded = dict(model="tiny-sft", prompt=text, max_tokens=12, temperature=1.0, seed=3)
    assert client.completions.create(**seeded).choices[0].text == client.completions.create(**seeded).choices[0].text
    full = client.completions.create(model="tiny-sft", prompt=text, max_tokens=24, temperature=0).choices[0].text
    at = next(i for i in range(1, len(full) - 1) if full.find(full[i:i + 2]) == i)
    cut = client.completions.create(model="tiny-sft", prompt=text, max_tokens=24, temperature=0,
                                    stop=[full[at:at + 2]])
    assert cut.choices[0].text == full[:at] and cut.choices[0].finish_reason == "stop"
    # a log-likelihood: echo the prompt with its tokens' log-probs, and one generated token
    scored = client.completions.create(model="tiny-sft", prompt=[ids], max_tokens=1, temperature=0, echo=True,
                                       logprobs=2)
    lp = scored.choices[0].logprobs
    ref = model_logprobs(model, ids + [want[0]])
    assert scored.choices[0].text.startswith(text) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids) + 1):
        assert abs(lp.token_logprobs[j] - float(ref[j - 1, (ids + want)[j]])) < 1e-4
        assert len(lp.top_logprobs[j]) <= 2 and abs(max(lp.top_logprobs[j].values()) - float(ref[j - 1].max())) < 1e-4
    assert "".join(lp.tokens) == scored.choices[0].text and lp.text_offset[1] == len(lp.tokens[0])
    # max_tokens 0 with echo scores the prompt alone
    only = client.completions.create(model="tiny-sft", prompt=text, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == text and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-4)


def test_chat_logprobs_are_the_models_streamed_or_not(served, reference):
    from minimind_ray.generate import generate_tokens, render_prompt

    model, tok = reference
    msgs = [{"role": "user", "content": PROMPT}]
    ids = tok.encode(render_prompt(tok, msgs))
    generated = list(generate_tokens(model, torch.tensor([ids]), 16, temperature=0, eos_token_id=tok.eos_id))
    ref = model_logprobs(model, ids + generated)
    got = chat(served["client"], msgs, temperature=0, max_tokens=16, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == len([t for t in generated if t != tok.eos_id])  # one entry per token but end-of-turn
    for j, e in enumerate(content):
        assert e.logprob == pytest.approx(float(ref[len(ids) - 1 + j, generated[j]]), abs=1e-4)
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy
    # the tokens' bytes make the reply (a token may hold part of a character: its text shows U+FFFD, and a
    # character cut off by max_tokens is not text)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "ignore") == got.choices[0].message.content
    stream = chat(served["client"], msgs, temperature=0, max_tokens=16, logprobs=True, top_logprobs=3, stream=True)
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in entries] == [(e.token, round(e.logprob, 5)) for e in content]


def test_n_samples_share_one_prefill_and_are_reproducible(served):
    base = served["base"]
    msgs = [{"role": "user", "content": "Tell me about Paris."}]
    before = health(base)["engine"]
    a = chat(served["client"], msgs, n=3, temperature=1.0, seed=5, max_tokens=16)
    after = health(base)["engine"]
    assert [c.index for c in a.choices] == [0, 1, 2] and after["prefills"] - before["prefills"] == 1
    texts = [c.message.content for c in a.choices]
    assert len(set(texts)) > 1  # each sample draws from its own generator (seed + index)
    b = chat(served["client"], msgs, n=3, temperature=1.0, seed=5, max_tokens=16)
    assert [c.message.content for c in b.choices] == texts
    assert a.usage.prompt_tokens == b.usage.prompt_tokens < a.usage.completion_tokens  # the prompt counts once
    with pytest.raises(openai.BadRequestError) as e:
        chat(served["client"], msgs, n=17, max_tokens=2)  # more rows than a replica's batch (16)
    assert e.value.body["param"] == "n"


# --------------------------------------------------------------------------- tool calls


def test_tool_calls_through_the_openai_client(served, tool_model):
    """A model whose SFT chats call a calculator: through the official client's tools API its greedy reply is a
    tool call (finish_reason tool_calls), exactly the <tool_call> block generate writes for the same prompt;
    the call and its result go back into the template for the answer; streamed calls arrive whole."""
    from minimind_ray.data.demo import CALCULATOR_TOOL
    from minimind_ray.serve.model_io import render_chat

    model, tok, _ = tool_model
    client = served["guarded"]
    msgs = tool_turn("What is 3 plus 8 plus 5?")
    ids = tok.encode(render_chat(tok, msgs, tools=[CALCULATOR_TOOL]))
    first, want_answer, _ = tool_replies(model, tok)
    want = calls_in(first)
    got = client.chat.completions.create(model="tool-tiny", messages=msgs, tools=[CALCULATOR_TOOL], temperature=0,
                                         max_tokens=100)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and got.usage.prompt_tokens == len(ids)
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "calculate"
    assert json.loads(call.function.arguments) == json.loads(want[0]["function"]["arguments"])
    assert "expression" in json.loads(call.function.arguments) and not choice.message.content
    # the call and the tool's result go back in: the template renders them, the model answers in text
    history = msgs + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = client.chat.completions.create(model="tool-tiny", messages=history, tools=[CALCULATOR_TOOL],
                                            temperature=0, max_tokens=100)
    back = [m for m in history[:2]] + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "calculate", "arguments": call.function.arguments}}]}, history[-1]]
    assert answer.usage.prompt_tokens == len(tok.encode(render_chat(tok, back, tools=[CALCULATOR_TOOL])))
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    assert answer.choices[0].message.content == want_answer and want_answer.strip()
    stream = client.chat.completions.create(model="tool-tiny", messages=msgs, tools=[CALCULATOR_TOOL], temperature=0,
                                            max_tokens=100, stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [("calculate", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_forced_and_malformed_replies(served, tool_model):
    from minimind_ray.data.demo import CALCULATOR_TOOL
    from minimind_ray.serve.model_io import render_chat

    model, tok, _ = tool_model
    client = served["guarded"]
    # the demo's own question shape (sums of three or four digits): the tool model was trained until its
    # greedy reply to this one is a well-formed call (a two-digit sum is outside its chats)
    msgs = tool_turn("What is 3 plus 8 plus 5?")
    off = client.chat.completions.create(model="tool-tiny", messages=msgs, tools=[CALCULATOR_TOOL], tool_choice="none",
                                         temperature=0, max_tokens=30)
    assert off.usage.prompt_tokens == len(tok.encode(render_chat(tok, msgs)))  # no tools in the prompt
    assert not off.choices[0].message.tool_calls and off.choices[0].finish_reason in ("stop", "length")
    named = client.chat.completions.create(
        model="tool-tiny", messages=msgs, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "calculate"}})
    # the forced start is the one the model writes unforced: the same call follows
    want = calls_in(tool_replies(model, tok)[0])[0]["function"]
    got = named.choices[0].message.tool_calls[0].function
    assert (got.name, json.loads(got.arguments)) == ("calculate", json.loads(want["arguments"]))
    # the untrained model of the run, forced to call: the rest of the call is constrained to the tool's schema
    # (tests/integration/test_serve_structured.py: always a valid call where it ends by itself); cut by max_tokens,
    # the unfinished call comes back as text (and a warning), never a 500
    for forced, start in (("required", '<tool_call>\n{"name": "'),
                          ({"type": "function", "function": {"name": "calculate"}},
                           '<tool_call>\n{"name": "calculate", "arguments": ')):
        # 4 tokens: fewer than the shortest call takes to close (its arguments' object, "}", "\n</tool_call>")
        cut = chat(served["client"], msgs, tools=[CALCULATOR_TOOL], tool_choice=forced, temperature=0,
                   max_tokens=4).choices[0]
        assert cut.finish_reason == "length" and not cut.message.tool_calls and cut.message.content.startswith(start)


# --------------------------------------------------------------------------- API key


def session_logs():
    import ray

    return Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"


def test_the_api_key_is_required_and_never_logged_or_echoed(served):
    base = served["base"] + "/guarded"
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    wrong = "wrong-" + KEY[::-1]
    for headers in ({}, {"Authorization": f"Bearer {wrong}"}, {"Authorization": KEY}):
        status, err = post(base, "/v1/chat/completions", body, headers=headers)
        assert status == 401 and err["error"]["code"] == "invalid_api_key", headers
        assert wrong not in json.dumps(err) and KEY not in json.dumps(err)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + "/v1/models", timeout=30)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"
    assert health(base)["status"] == "ok"  # /health stays open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key=wrong, max_retries=0).models.list()
    assert [m.id for m in served["guarded"].models.list().data] == ["tool-tiny"]
    status, ok = post(base, "/v1/chat/completions", body, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and ok["usage"]["completion_tokens"] >= 1
    for f in session_logs().rglob("*"):
        if f.is_file():
            text = f.read_bytes()
            assert KEY.encode() not in text and wrong.encode() not in text, f


CHAT_BODY = {"messages": [{"role": "user", "content": "What is 3 plus 8 plus 5?"}], "max_tokens": 2, "temperature": 0}
TEXT_BODY = {"prompt": "3 plus 8 is", "max_tokens": 2, "temperature": 0}
GUARDED_ROUTES = {  # every route the app serves behind the key: (method, path, body)
    "POST /v1/completions": ("POST", "/v1/completions", TEXT_BODY),
    "POST /v1/completions stream": ("POST", "/v1/completions", {**TEXT_BODY, "stream": True}),
    "POST /v1/chat/completions": ("POST", "/v1/chat/completions", CHAT_BODY),
    "POST /v1/chat/completions stream": ("POST", "/v1/chat/completions", {**CHAT_BODY, "stream": True}),
    "GET /v1/models": ("GET", "/v1/models", None),
}
OPEN_ROUTES = {"GET /": ("GET", "/", None), "GET /health": ("GET", "/health", None)}  # the page and the probes
KEYS = {"no key": {}, "a wrong key": {"Authorization": f"Bearer wrong-{KEY[::-1]}"},
        "the key without Bearer": {"Authorization": KEY}, "the right key": {"Authorization": f"Bearer {KEY}"}}


def test_the_routes_tried_with_keys_are_every_route_the_app_serves():
    from minimind_ray.serve.app import app

    def walk(routes):  # Serve's ingress puts the app's routes inside an included router
        for r in routes:
            yield from walk(r.original_router.routes) if hasattr(r, "original_router") else [r]

    served = {f"{m} {r.path}" for r in walk(app.routes) for m in r.methods}
    assert served == {name.removesuffix(" stream") for name in (*GUARDED_ROUTES, *OPEN_ROUTES)}


def fetch(base, method, path, body, headers):
    """(status, headers, body text) of one request to the app at ``base``, read to its end."""
    host, port = base[len("http://"):].split("/")[0].split(":")
    prefix = base.split(f":{port}", 1)[1]
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, prefix + path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, resp.headers, text


@pytest.mark.parametrize("key", list(KEYS))
@pytest.mark.parametrize("route", [*GUARDED_ROUTES, *OPEN_ROUTES])
def test_every_route_but_the_page_and_health_needs_the_key(served, route, key):
    method, path, body = {**GUARDED_ROUTES, **OPEN_ROUTES}[route]
    status, headers, text = fetch(served["base"] + "/guarded", method, path, body, KEYS[key])
    if route in GUARDED_ROUTES and key != "the right key":
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", (status, text[:300])
        assert json.loads(text)["error"]["code"] == "invalid_api_key" and KEY not in text
        return
    assert status == 200, (status, text[:300])
    if route == "GET /":
        assert "<title>" in text and "authorized(" in text  # the chat page, which asks for the key itself
    elif route == "GET /health":
        assert json.loads(text)["status"] == "ok"
    elif route == "GET /v1/models":
        assert [m["id"] for m in json.loads(text)["data"]] == ["tool-tiny"]
    elif route.endswith("stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), text[-300:]
    else:
        assert json.loads(text)["usage"]["completion_tokens"] >= 1


# --------------------------------------------------------------------------- fuzz and flood


def test_a_fuzz_of_request_bodies_gets_only_200s_and_4xx(served):
    """Random bodies (shapes, types, unicode, broken bytes; seeded) at both endpoints: a 200 (a stream without
    an error event) or a 4xx with OpenAI's error body, never a 5xx; the server answers normally after."""
    rng = random.Random(2022)
    seen = {}
    for i in range(120):
        path, body = (("/v1/chat/completions", chat_body(rng)) if i % 2 == 0 else
                      ("/v1/completions", completion_body(rng)))
        raw = raw_bodies(rng, body)
        req = urllib.request.Request(served["base"] + path, data=raw, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        seen[status] = seen.get(status, 0) + 1
        assert status == 200 or 400 <= status < 500, (raw, status, text[:300])
        if status != 200:
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
        else:
            assert '"server_error"' not in text, (raw, text[:300])
    assert seen.get(200, 0) >= 10 and sum(v for k, v in seen.items() if k != 200) >= 30, seen
    assert chat(served["client"], [{"role": "user", "content": "hi"}], max_tokens=4).usage.completion_tokens >= 1


def one_request(base, body, stream=False):
    """(status, headers, body text, seconds taken, when it ended) of a POST to the guarded app, the key sent."""
    host, port = base[len("http://"):].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    t0 = time.monotonic()
    conn.request("POST", "/guarded/v1/chat/completions", body=json.dumps({**body, "stream": stream}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, resp.headers, text, time.monotonic() - t0, time.monotonic()


def test_a_flood_gets_200_429_or_504_and_leaves_the_server_bounded_and_answering(served):
    """The guarded replica holds 2 running + 2 waiting rows and times out at 3 s. Two endless requests (one
    streamed) fill the batch; 28 more arrive at once: the 2 that fit wait, the rest get 429 with Retry-After and
    OpenAI's body before any of them runs; the endless ones end in 504 (the stream in an error event) and free
    their rows; nothing is a 500, memory stays put, and the server answers normally after.

    A waiting request's 3 s count from its own arrival, which is only a moment after the endless ones', so on a
    loaded machine it may reach its deadline before its 4 tokens are out: then it is a 504 with the timeout code,
    not sooner than 3 s after it was sent, and counted among the timeouts (CI saw this once on 2 busy cores)."""
    base = served["base"]
    before = health(base + "/guarded")
    long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CAP, "ignore_eos": True, "temperature": 0}
    short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(32) as pool:
        endless = [pool.submit(one_request, base, long, stream) for stream in (False, True)]
        wait_for(lambda: health(base + "/guarded")["engine"]["running"] == 2)
        flood = [f.result() for f in [pool.submit(one_request, base, short) for _ in range(28)]]
        endless = [f.result() for f in endless]
    statuses = sorted(r[0] for r in flood)
    assert set(statuses) <= {200, 429, 504} and statuses.count(429) >= 20, statuses
    assert len(flood) - statuses.count(429) >= GUARD["max_queued"], statuses  # the waiting room was used
    late = [r for r in flood if r[0] == 504]
    for status, _, text, took, _ in late:  # a waiting request that reached its own deadline, nothing else
        assert json.loads(text)["error"]["code"] == "timeout" and took >= GUARD["request_timeout_s"], (text, took)
    for status, _, text, _, _ in flood:
        if status == 200:
            assert json.loads(text)["usage"]["completion_tokens"] >= 1
    refused = [r for r in flood if r[0] == 429]
    for status, headers, text, _, _ in refused:
        assert headers["Retry-After"] == "1" and json.loads(text)["error"]["type"] == "rate_limit_error"
    assert max(r[4] for r in refused) < min(r[4] for r in endless)  # refused before the batch even freed up
    (s1, _, plain, _, _), (s2, _, streamed, _, _) = endless
    assert s1 == 504 and json.loads(plain)["error"]["code"] == "timeout"
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert s2 == 200 and events[-1]["error"]["code"] == "timeout" and streamed.endswith("data: [DONE]\n\n")
    def timeouts(h):
        return h["engine"]["requests_aborted"].get("timeout", 0) - before["engine"]["requests_aborted"].get(
            "timeout", 0)

    # idle, and every abort counted (the engine counts a waiting row's abort when its loop takes it out)
    after = wait_for(lambda: (lambda h: h if h["engine"]["running"] == h["engine"]["waiting"] == 0
                              and timeouts(h) >= 2 + len(late) else None)(health(base + "/guarded")))
    eng = after["engine"]
    assert eng["waiting_peak"] <= GUARD["max_queued"] and eng["mean_batch"] <= GUARD["max_batch"]
    assert timeouts(after) == 2 + len(late), (timeouts(after), statuses)
    assert after["rss_mb"] - before["rss_mb"] < 64  # peak resident memory of the replica
    status, _, text, _, _ = one_request(base, short)
    assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")


def test_exactly_max_batch_plus_max_queued_concurrent_streams_get_200_and_one_more_a_429(served):
    """The guarded replica holds max_batch + max_queued = 2 + 2 rows. Four concurrent streamed chats (endless
    replies, ended by the 3 s timeout's error event) are all admitted with a 200 while one more sent during them
    gets the 429. 48 streams against 16 + 32 once got two 429s: rows joining the batch were counted twice while
    they were admitted (tests/unit/test_kv_cache.py checks the count at every forward)."""
    base = served["base"]
    before = health(base + "/guarded")
    endless = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CAP, "ignore_eos": True,
               "temperature": 0}
    n = GUARD["max_batch"] + GUARD["max_queued"]
    with ThreadPoolExecutor(n) as pool:
        held = [pool.submit(one_request, base, endless, True) for _ in range(n)]
        wait_for(lambda: (lambda e: e["running"] + e["waiting"] == n)(health(base + "/guarded")["engine"]), 30)
        extra = one_request(base, endless, True)
        held = [f.result() for f in held]
    assert [r[0] for r in held] == [200] * n and extra[0] == 429, ([r[0] for r in held], extra[:3])
    assert all(text.endswith("data: [DONE]\n\n") for _, _, text, _, _ in held)
    aborted = before["engine"]["requests_aborted"].get("timeout", 0)
    wait_for(lambda: (lambda e: e["running"] == e["waiting"] == 0 and e["requests_aborted"].get("timeout", 0)
                      >= aborted + n)(health(base + "/guarded")["engine"]))


# --------------------------------------------------------------------------- the chat page in a browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium")) as driver:
        yield driver


def test_the_chat_page_streams_the_greedy_reply_over_two_turns(served, browser, tmp_path, reference):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    from minimind_ray.generate import render_prompt

    wait = WebDriverWait(browser, 120)
    browser.get(served["base"] + "/")
    wait.until(lambda d: "tiny-sft" in d.find_element(By.ID, "model").text)
    assert browser.find_element(By.ID, "model").text == f"tiny-sft · context {CONTEXT} tokens, trained at 64"
    for field, value in (("temperature", "0"), ("max-tokens", "24")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    history, prompts = [], []
    for turn, text in enumerate((PROMPT, "And of Spain?"), start=1):
        browser.find_element(By.ID, "prompt").send_keys(text + Keys.ENTER)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state=done]")) == turn)
        shown = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .content")[-1].get_property("textContent")
        history.append({"role": "user", "content": text})
        api = chat(served["client"], history, temperature=0, max_tokens=24).choices[0].message.content
        assert shown == api, f"turn {turn}"
        history.append({"role": "assistant", "content": api})
        meta = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")[-1].text
        assert "tokens" in meta  # the usage chunk of the stream was read
        cached = int(re.search(r"\((\d+) cached\)", meta)[1])  # the prefix cache's share of the prompt
        prompts.append(reference[1].encode(render_prompt(reference[1], history[:-1])))
        if turn == 2:  # turn 2's prompt starts with turn 1's, stored in the prefix cache: its whole 16-token blocks
            same = next((i for i, (a, b) in enumerate(zip(*prompts)) if a != b), len(prompts[0]))
            assert cached >= same // 16 * 16
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")
    browser.save_screenshot(str(tmp_path / "chat.png"))


def test_the_chat_page_asks_for_the_key_says_when_it_is_wrong_and_streams_with_the_right_one(served, browser):
    """The guarded app's page: its first call gets a 401, so it asks for the key; a wrong one is refused, asked for
    again saying so, and when none is given the page says what the server wants; reloaded, the right key loads the
    model and a typed question streams the reply the API gives with that key."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 120)
    browser.get(served["base"] + "/guarded/")

    def answer(expected_prompt, key):
        alert = wait.until(EC.alert_is_present())
        assert alert.text == expected_prompt
        if key is None:
            alert.dismiss()
        else:
            alert.send_keys(key)
            alert.accept()

    answer("This server needs its API key:", "wrong-" + KEY[::-1])
    answer("The server refused that API key. Enter its API key:", None)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.error"))
    assert browser.find_element(By.CSS_SELECTOR, ".msg.error").text == \
        "the server refused the API key (401): reload the page to enter the right one"
    assert browser.find_element(By.ID, "model").text == "model unavailable"
    browser.refresh()  # the refused key was forgotten: the page asks again
    answer("This server needs its API key:", KEY)
    wait.until(lambda d: "tool-tiny" in d.find_element(By.ID, "model").text)
    for field, value in (("temperature", "0"), ("max-tokens", "24")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    question = "What is 3 plus 8 plus 5?"
    browser.find_element(By.ID, "prompt").send_keys(question + Keys.ENTER)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state=done]"))
    shown = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .content").get_property("textContent")
    api = served["guarded"].chat.completions.create(model="tool-tiny", messages=[{"role": "user", "content": question}],
                                                    temperature=0, max_tokens=24).choices[0].message.content
    assert shown == api and shown.strip()
    assert "tokens" in browser.find_element(By.CSS_SELECTOR, ".msg.assistant .meta").text  # streamed to its usage
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")


# --------------------------------------------------------------------------- Prometheus (last: what the others did)


def scrape():
    """Ray's Prometheus endpoint on this node: {(name, frozenset(labels)): value}."""
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(ray_minimind_serve_\w+)\{(.*)\} (\S+)$", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m[2]))
            out[(m[1], labels)] = float(m[3])
    return out


def metric(samples, name, **labels):
    """The sum of ``name`` over the series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_replicas_export_prometheus_metrics_through_rays_metrics_port(served):
    """What the tests above did, as Prometheus sees it on Ray's metrics export port (the session's Ray runs
    without the dashboard; its metrics agent still exports). The agent reads the replicas every few seconds."""
    run, guarded = {"application": "serve-run"}, {"application": "serve-guarded"}
    checks = {
        "chat 200s": lambda s: metric(s, "ray_minimind_serve_requests_total", endpoint="/v1/chat/completions",
                                      status="200", **run) >= 5,
        "completions 200s": lambda s: metric(s, "ray_minimind_serve_requests_total", endpoint="/v1/completions",
                                             status="200", **run) >= 3,
        "400s": lambda s: metric(s, "ray_minimind_serve_requests_total", status="400", **run) >= 10,
        "404": lambda s: metric(s, "ray_minimind_serve_requests_total", status="404", **run) >= 1,
        "429s": lambda s: metric(s, "ray_minimind_serve_requests_total", status="429", **guarded) >= 20,
        "401s": lambda s: metric(s, "ray_minimind_serve_requests_total", status="401", **guarded) >= 3,
        "timeouts": lambda s: metric(s, "ray_minimind_serve_aborted_requests_total", reason="timeout", **guarded) >= 2,
        "disconnects": lambda s: metric(s, "ray_minimind_serve_aborted_requests_total", reason="disconnected",
                                        **run) >= 1,
        "ttft": lambda s: metric(s, "ray_minimind_serve_time_to_first_token_seconds_count", **run) >= 5,
        "itl": lambda s: metric(s, "ray_minimind_serve_inter_token_latency_seconds_count", **run) >= 50,
        "latency": lambda s: metric(s, "ray_minimind_serve_request_latency_seconds_count", **run) >= 5,
        "tokens": lambda s: metric(s, "ray_minimind_serve_generated_tokens_total", **run) >= 100
        and metric(s, "ray_minimind_serve_prompt_tokens_total", **run) >= 100,
        "gauges": lambda s: any(n == "ray_minimind_serve_queue_depth" for n, _ in s)
        and any(n == "ray_minimind_serve_running_batch" for n, _ in s),
    }
    failing = list(checks)
    deadline = time.monotonic() + 60
    while failing and time.monotonic() < deadline:
        samples = scrape()
        failing = [k for k, ok in checks.items() if not ok(samples)]
        if failing:
            time.sleep(1)
    assert not failing, f"not in Ray's /metrics: {failing}"


def test_the_serve_commands_own_ray_exports_metrics_on_loopback_only(tmp_path):
    """Where the metrics are by default: `minimind-ray serve` without a cluster starts a Ray of its own
    (serve/serve_verb.py:connect), whose metrics agent serves Prometheus' /metrics (the replicas' metrics with Ray's)
    on 127.0.0.1 alone, not on the machine's network address; the command prints that URL."""
    script = textwrap.dedent('''
        import json, urllib.request
        import psutil
        from minimind_ray.serve.serve_verb import connect, metrics_url
        from minimind_ray.serve.options import ServeOptions

        started = connect(ServeOptions(weights="unused", cpus_per_replica=1))  # imports Ray, as the command does
        import ray
        url = metrics_url()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        listening = sorted({c.laddr.ip for c in psutil.net_connections("tcp")
                            if c.status == psutil.CONN_LISTEN and c.laddr.port == port})
        with urllib.request.urlopen(url, timeout=60) as r:
            answered = r.status == 200 and "# TYPE ray_" in r.read().decode()
        ray.shutdown()
        print("RESULT " + json.dumps({"started": started, "url": url, "listening": listening, "answered": answered}))
        ''')
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="mmrm", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, (p.stdout + p.stderr)[-4000:]
    got = json.loads(lines[0][len("RESULT "):])
    assert got["started"] and got["answered"] and got["url"].startswith("http://127.0.0.1:"), got
    assert got["listening"] == ["127.0.0.1"], got  # not 0.0.0.0, not the node's network address
