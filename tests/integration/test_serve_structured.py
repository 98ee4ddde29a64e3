"""Structured output through a running `serve` and the official `openai` client, from models that have barely
trained, where the guarantee matters most: the session's tiny baseline run (its built-in demo tokenizer), and a
freshly initialised tiny model with MiniMind's minimind2 tokenizer, whose app also has a short --grammar-timeout-s
(0.05 s, against about 1 ms for the tests' schemas and 0.17 s or more for SLOW_COMPILE). Every reply that ends by
itself parses and validates with `jsonschema`; a cut one says "length"; a schema the server cannot enforce is a 400
naming its JSON path, and the server goes on answering."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.conftest import minimind_tokenizer_dir

pytestmark = pytest.mark.integration

SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "structured_schemas.json").read_text())
MSGS = [{"role": "user", "content": "Describe a user as JSON."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": SCHEMAS["weather_args"]}},
         {"type": "function", "function": {"name": "ping", "description": "no arguments"}}]
NO_ARGS = {"type": "object", "additionalProperties": False}
SLOW_COMPILE = {"anyOf": [{"type": "string", "pattern": f"^(ab|cd){{{i},{i + 5}}}[0-9]{{3}}$"} for i in range(3000)]}


def person_format(schema=SCHEMAS["person"]):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def served(ray_session, tiny_baseline, tmp_path_factory):
    import torch
    from ray import serve
    from ray.serve.api import RunTarget

    from minimind_ray.config import ModelConfig
    from minimind_ray.model.minimind import build_model
    from minimind_ray.model.presets import preset_values
    from minimind_ray.serve.app import build_app
    from minimind_ray.store.pth import save_pth

    fresh = tmp_path_factory.mktemp("fresh") / "fresh_tiny.pth"
    save_pth(build_model(ModelConfig(**preset_values("tiny")), seed=5), str(fresh), dtype=torch.float32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    common = {"context": 1024, "max_tokens_cap": 512, "cpus_per_replica": 1, "max_batch": 16}
    serve.run_many([
        RunTarget(build_app({"weights": tiny_baseline[1].run_dir, "model_name": "baseline", **common}),
                  name="structured-baseline", route_prefix="/baseline", logging_config=quiet),
        RunTarget(build_app({"weights": str(fresh), "tokenizer": str(minimind_tokenizer_dir("minimind2")),
                             "model_name": "fresh", "grammar_timeout_s": 0.05, **common}),
                  name="structured-fresh", route_prefix="/fresh", logging_config=quiet),
    ])
    base = f"http://127.0.0.1:{port}"
    try:
        yield {name: openai.OpenAI(base_url=f"{base}/{name}/v1", api_key="unused", max_retries=0)
               for name in ("baseline", "fresh")}
    finally:
        serve.shutdown()  # later tests get their CPUs back


def test_fifty_json_schema_replies_at_temperature_1_all_validate(served):
    """5 requests of n = 10, three at a time (their rows decode together), on both apps."""
    from concurrent.futures import ThreadPoolExecutor

    for name, client in served.items():
        def ask(seed):
            return client.chat.completions.create(model=name, messages=MSGS, temperature=1.0, n=10, seed=seed,
                                                  max_tokens=300, response_format=person_format())

        with ThreadPoolExecutor(3) as pool:  # 30 rows at once: within the batch + queue (48)
            replies = list(pool.map(ask, range(5)))
        choices = [c for r in replies for c in r.choices]
        assert len(choices) == 50
        for c in choices:
            assert c.finish_reason == "stop", (name, c.message.content)
            jsonschema.validate(json.loads(c.message.content), SCHEMAS["person"])
        assert len({c.message.content for c in choices}) > 10  # temperature 1: not one reply fifty times


def test_json_object_replies_and_text_completions_parse(served):
    client = served["fresh"]
    nested = client.chat.completions.create(model="fresh", messages=MSGS, temperature=1.0, n=8, seed=3,
                                            max_tokens=300, response_format=person_format(SCHEMAS["nested"]))
    for c in nested.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["nested"])
    anything = client.chat.completions.create(model="fresh", messages=MSGS, temperature=1.0, n=8, seed=4,
                                              max_tokens=400, response_format={"type": "json_object"})
    # any object: its keys are strings of any length, which a near-random model rarely closes, so most replies run
    # to max_tokens; those that end by themselves are objects
    ended = [c for c in anything.choices if c.finish_reason == "stop"]
    for c in anything.choices:
        assert c.message.content.startswith("{")
        assert c.finish_reason == "stop" or c.finish_reason == "length"
    for c in ended:
        assert isinstance(json.loads(c.message.content), dict)
    text = client.completions.create(model="fresh", prompt="A user:", temperature=1.0, n=4, seed=5, max_tokens=300,
                                     extra_body={"response_format": person_format()})
    for c in text.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMAS["person"])


def test_a_forced_tool_choice_calls_a_declared_function_with_valid_arguments(served):
    for name, client in served.items():
        forced = client.chat.completions.create(model=name, messages=MSGS, tools=TOOLS, tool_choice="required",
                                                temperature=1.0, n=8, seed=6, max_tokens=300)
        named = client.chat.completions.create(model=name, messages=MSGS, tools=TOOLS, temperature=1.0, n=4, seed=7,
                                               max_tokens=300, tool_choice={"type": "function",
                                                                            "function": {"name": "get_weather"}})
        for c in forced.choices + named.choices:
            assert c.finish_reason == "tool_calls", (name, c.message.content)
            [call] = c.message.tool_calls
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, SCHEMAS["weather_args"] if call.function.name == "get_weather" else NO_ARGS)
        assert {c.message.tool_calls[0].function.name for c in named.choices} == {"get_weather"}
        free = client.chat.completions.create(model=name, messages=MSGS, tools=TOOLS, tool_choice="auto",
                                              temperature=0, max_tokens=20)
        assert free.choices[0].finish_reason in ("stop", "length", "tool_calls")  # auto: the model's own reply


def test_streams_carry_the_same_guarantee_and_a_cut_reply_says_length(served):
    client = served["baseline"]
    stream = client.chat.completions.create(model="baseline", messages=MSGS, temperature=1.0, n=2, seed=8,
                                            max_tokens=300, response_format=person_format(), stream=True)
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["stop", "stop"]
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMAS["person"])
    stream = client.chat.completions.create(model="baseline", messages=MSGS, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=9, max_tokens=300, stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments),
                        SCHEMAS["weather_args"] if calls[0].function.name == "get_weather" else NO_ARGS)
    cut = client.chat.completions.create(model="baseline", messages=MSGS, temperature=1.0, seed=10, max_tokens=3,
                                         response_format=person_format())
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith("{")


def refusal(client, model, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MSGS, max_tokens=20, **kw)
    return e.value.body


@pytest.mark.parametrize("schema, param, words", [
    ({"type": "object", "properties": {"age": {"type": "strin"}}}, "response_format.json_schema.schema."
     "properties.age.type", "not a valid JSON Schema"),
    ({"type": "object", "properties": {"age": {"type": "integer", "not": {"const": 3}}}},
     "response_format.json_schema.schema.properties.age.not", "'not' is not supported"),
    (SLOW_COMPILE, "response_format.json_schema.schema", "--grammar-timeout-s"),
])
def test_a_schema_the_server_cannot_enforce_is_a_400_naming_its_path(served, schema, param, words):
    client = served["fresh"]
    body = refusal(client, "fresh", response_format=person_format(schema))
    assert body["param"] == param and words in body["message"] and param in body["message"], body
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "if": {"minimum": 1}}}}}}]
    body = refusal(client, "fresh", tools=tools, tool_choice="required")
    assert body["param"] == "tools.1.function.parameters.properties.x.if", body
    ok = client.chat.completions.create(model="fresh", messages=MSGS, max_tokens=300, temperature=1.0, seed=11,
                                        response_format=person_format())
    jsonschema.validate(json.loads(ok.choices[0].message.content), SCHEMAS["person"])  # still answering
