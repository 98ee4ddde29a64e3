"""Serving on Ray Serve with real parts: a tiny SFT model trained and registered in MLflow here (a real
`mlflow server`), the real Serve app on the session's Ray, the official `openai` client, raw HTTP for
what a client library would not send, and a real Chromium driven by Selenium for the chat page.

Two apps run side by side: one from the run directory (``/``), one from the registry
(``models:/serve-tiny/1`` at ``/registry``). Greedy replies are compared with what the library's
``generate`` gives for the same weights and prompt.
"""
from __future__ import annotations

import http.client
import json
import shutil
import socket
import time
import urllib.request

import openai
import pytest
import torch

from .helpers import new_shared, run_tiny

pytestmark = pytest.mark.integration

PROMPT = "What is the capital of France?"
CONTEXT, CAP = 4096, 4000  # room for a long stream in the disconnect test
REGISTERED = "serve-tiny"


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


@pytest.fixture(scope="module")
def served(trained, mlflow_server):
    from ray import serve
    from ray.serve.api import RunTarget

    from minimind_ray.serve.app import build_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = {"context": CONTEXT, "max_tokens_cap": CAP, "cpus_per_replica": 1}
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    serve.run_many([
        RunTarget(build_app({"weights": trained.run_dir, "model_name": "tiny-sft", **common}), name="serve-run",
                  route_prefix="/", logging_config=quiet),
        RunTarget(build_app({"weights": f"models:/{REGISTERED}/1", "tracking_uri": mlflow_server.uri, **common}),
                  name="serve-registry", route_prefix="/registry", logging_config=quiet),
    ])
    base = f"http://127.0.0.1:{port}"
    try:
        yield {"base": base, "client": openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)}
    finally:
        serve.shutdown()  # later tests get their CPUs back


@pytest.fixture(scope="module")
def reference(trained):
    """The run's model and tokenizer, loaded the way `minimind-ray generate` loads them."""
    from minimind_ray.store.weights import build_inference_model
    from minimind_ray.tokenizer import resolve_tokenizer

    model, lw = build_inference_model(trained.run_dir)
    tok = resolve_tokenizer(lw.run_cfg.data.tokenizer, lw.run_cfg.data.cache_dir, lw.run_cfg.model.generation)
    return model, tok


def greedy_text(reference, messages, n, **sampling):
    """What the library's generate loop replies (the chat template, greedy unless told otherwise)."""
    from minimind_ray.generate import SamplingConfig, render_prompt, stream_reply

    model, tok = reference
    cfg = SamplingConfig(max_new_tokens=n, **{"temperature": 0.0, **sampling})
    return "".join(stream_reply(model, tok, render_prompt(tok, messages), cfg))


def post(base, path, body: bytes, content_type="application/json"):
    req = urllib.request.Request(base + path, data=body, headers={"Content-Type": content_type}, method="POST")
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


def test_models_and_health(served):
    models = served["client"].models.list().data
    assert [m.id for m in models] == ["tiny-sft"]
    h = health(served["base"])
    assert h["status"] == "ok" and h["model"] == "tiny-sft" and h["engine"]["running"] == 0


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


# --------------------------------------------------------------------------- the chat page in a browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver_bin:
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1366,860", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_bin), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_chat_page_streams_the_greedy_reply_over_two_turns(served, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 120)
    browser.get(served["base"] + "/")
    wait.until(lambda d: "tiny-sft" in d.find_element(By.ID, "model").text)
    for field, value in (("temperature", "0"), ("max-tokens", "24")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    history = []
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
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")
    browser.save_screenshot(str(tmp_path / "chat.png"))
