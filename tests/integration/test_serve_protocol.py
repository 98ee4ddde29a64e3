"""The serving wire format without a server or Ray: every request field honoured, inert or refused (and the
docs' table saying which), a fuzz of request bodies that may only ever end in a validated request or a 4xx,
``<tool_call>`` blocks into tool calls (and malformed ones back into text), and the API key's handling
in the command (only its sha256 leaves the driver)."""
from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

import pytest

from minimind_ray.serve.protocol import (INERT, REFUSED, REFUSED_CHAT, REFUSED_COMPLETIONS, APIError, ChatMessage,
                                         ChatCompletionRequest, CompletionRequest, parse_chat, parse_completion)
from minimind_ray.serve.replies import ToolCallText

from .serve_fuzz import chat_body, completion_body, raw_bodies

REPO = Path(__file__).resolve().parents[2]
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}


def refused(parse, body, param):
    with pytest.raises(APIError) as e:
        parse(json.dumps(body).encode(), 100, 8)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert param.split(".")[0] in e.value.message
    return e.value


def docs_table():
    """docs/serving.md's request-field table: {field: (endpoints, treatment)}."""
    rows = re.findall(r"^\| `([^`]+)` \| ([a-z, ]+) \| (honoured|inert|refused)[^|]* \|", (REPO / "docs" / "serving.md")
                      .read_text(), flags=re.M)
    return {f: (set(e.replace(" ", "").split(",")), t) for f, e, t in rows}


def test_the_docs_table_names_every_field_and_what_the_server_does_with_it():
    table = docs_table()
    inert_top = {k for k in INERT if "." not in k}
    for endpoint, model, refusals in (("chat", ChatCompletionRequest, REFUSED_CHAT),
                                      ("completions", CompletionRequest, REFUSED_COMPLETIONS)):
        for name in model.model_fields:
            want = "refused" if name in refusals else "inert" if name in inert_top else "honoured"
            assert name in table, f"docs/serving.md's field table lacks `{name}`"
            endpoints, treatment = table[name]
            assert endpoint in endpoints and treatment == want, (name, table[name], want)
    for name in ChatMessage.model_fields:
        assert f"messages.N.{name}" in table, f"docs/serving.md's field table lacks `messages.N.{name}`"


NOT_DEFAULT = {"frequency_penalty": 0.5, "presence_penalty": -1.0, "logit_bias": {"5": 10}, "modalities": ["audio"],
               "audio": {"voice": "alloy"}, "prediction": {"type": "content", "content": "x"},
               "reasoning_effort": "low", "web_search_options": {}, "verbosity": "low", "functions": [{"name": "f"}],
               "function_call": "auto", "suffix": "the end", "best_of": 3}


@pytest.mark.parametrize("name", sorted(set(REFUSED_CHAT) | set(REFUSED_COMPLETIONS)))
def test_refused_fields_are_a_400_naming_them_unless_null_or_default(name):
    default, _ = REFUSED[name]
    for parse, fields, base in ((parse_chat, REFUSED_CHAT, {"messages": MSGS}),
                                (parse_completion, REFUSED_COMPLETIONS, {"prompt": "hi"})):
        if name not in fields:
            continue
        refused(parse, {**base, name: NOT_DEFAULT[name]}, name)
        parse(json.dumps({**base, name: None}).encode(), 100, 8)
        if default is not None:
            parse(json.dumps({**base, name: default}).encode(), 100, 8)


def test_unknown_fields_wrong_types_and_bad_text_name_the_field():
    refused(parse_chat, {"messages": MSGS, "logprob": True}, "logprob")  # a typo is not silently ignored
    refused(parse_chat, {"messages": [{"role": "user", "content": "hi", "colour": 1}]}, "messages.0.colour")
    refused(parse_chat, {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}]},
            "messages.1.content")
    refused(parse_chat, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "a\udcffb"}}]},
            "tools.0.function.name")
    refused(parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0.type")
    refused(parse_chat, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs")  # needs logprobs: true
    refused(parse_chat, {"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format.json_schema")
    refused(parse_chat, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "colour": 1}}}, "response_format.json_schema.colour")
    refused(parse_completion, {"prompt": "hi", "response_format": {"type": "json_object", "json_schema": {
        "name": "x"}}}, "response_format.json_schema")
    refused(parse_chat, {"messages": MSGS, "tools": [TOOL], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "response_format")
    refused(parse_chat, {"messages": MSGS, "tools": [TOOL], "tool_choice": {"type": "function", "function": {
        "name": "other"}}}, "tool_choice.function.name")
    refused(parse_chat, {"messages": MSGS, "chat_template_kwargs": {"temperature": 1}},
            "chat_template_kwargs.temperature")
    refused(parse_chat, {"messages": MSGS, "n": 9}, "n")  # more than the batch (8 here)
    refused(parse_completion, {"prompt": [[1, 2], []]}, "prompt")
    refused(parse_completion, {"prompt": "hi", "max_tokens": 0}, "max_tokens")  # 0 only with echo
    req = parse_completion(json.dumps({"prompt": "hi", "max_tokens": 0, "echo": True}).encode(), 100, 8)
    assert req.max_tokens == 0
    assert parse_completion(b'{"prompt": "hi"}', 100, 8).max_tokens == 16  # OpenAI's default
    # what a client sends back as history: a reply message with its null fields, and OpenAI's developer role
    history = [{"role": "developer", "content": "Be brief."}, *MSGS,
               {"role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
                "function_call": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "calculate", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    req = parse_chat(json.dumps({"messages": history, "tools": [TOOL], "user": "u1", "store": False}).encode(), 100, 8)
    assert req.messages[0].as_template_message() == {"role": "system", "content": "Be brief."}
    assert req.messages[2].as_template_message()["tool_calls"][0]["function"]["name"] == "calculate"


def test_a_fuzz_of_request_bodies_ends_only_in_a_request_or_a_4xx():
    """3000 random bodies (seeded): parsing either returns a request or raises APIError with a 4xx whose body
    is JSON-encodable as UTF-8 (a message quoting a lone surrogate would make the reply itself fail)."""
    rng = random.Random(22)
    outcomes = {"ok": 0, "4xx": 0}
    for i in range(3000):
        chat = i % 2 == 0
        body = chat_body(rng) if chat else completion_body(rng)
        raw = raw_bodies(rng, body)
        try:
            (parse_chat if chat else parse_completion)(raw, 100, 8)
            outcomes["ok"] += 1
        except APIError as e:
            assert 400 <= e.status < 500, (raw, e.status)
            json.dumps(e.body(), ensure_ascii=False).encode("utf-8")
            outcomes["4xx"] += 1
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"body {raw!r}: {type(e).__name__}: {e}") from e
    assert outcomes["ok"] > 300 and outcomes["4xx"] > 300, outcomes


# --------------------------------------------------------------------------- tool calls


CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 + 7"}}\n</tool_call>'


def parse_calls(text, names=("calculate",), pieces=None, **kw):
    """Feed ``text`` whole (pieces=None) or in pieces of that size, as a stream would; -> (content, calls, parser)."""
    p = ToolCallText(names, **kw)
    events = []
    chunks = [text] if pieces is None else [text[i:i + pieces] for i in range(0, len(text), pieces)]
    for c in chunks:
        events += p.push(c)
    events += p.finish()
    content = "".join(v for f, v in events if f == "content")
    return content, [v for f, v in events if f == "tool_call"], p


@pytest.mark.parametrize("pieces", [None, 1, 3])
def test_tool_call_blocks_become_calls_in_any_pieces(pieces):
    content, calls, p = parse_calls(CALL, pieces=pieces)
    assert content == "" and p.malformed == 0 and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "calculate", "arguments": json.dumps({"expression": "12 + 7"})}
    content, calls, _ = parse_calls("Let me compute.\n" + CALL + "\n" + CALL.replace("12 + 7", "3 + 4"), pieces=pieces)
    assert content == "Let me compute." and [json.loads(c["function"]["arguments"])["expression"] for c in calls] == \
        ["12 + 7", "3 + 4"]
    # a '<' that starts no block, held back only until it cannot be one
    content, calls, _ = parse_calls("1 < 2 and <tool_cal is not a tag", pieces=pieces)
    assert content == "1 < 2 and <tool_cal is not a tag" and calls == []


@pytest.mark.parametrize("text, why", [
    ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "1 + }\n</tool_call>', "not JSON"),
    ('<tool_call>\n["calculate"]\n</tool_call>', "no name"),
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', "unknown function"),
    ('<tool_call>\n{"name": "calculate", "arguments": "{oops"}\n</tool_call>', "arguments not JSON"),
    ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "1', "unterminated"),
])
def test_a_malformed_tool_call_is_returned_as_text_with_a_warning(text, why, caplog):
    with caplog.at_level("WARNING", logger="minimind_ray.serve.replies"):
        content, calls, p = parse_calls(text, pieces=2)
    assert calls == [] and content == text and p.malformed == 1, why
    assert "returned as text" in caplog.text


def test_a_forced_call_prefix_and_one_call_only():
    prefix = '<tool_call>\n{"name": "calculate", "arguments": '
    content, calls, _ = parse_calls('{"expression": "2 + 2"}}\n</tool_call>', prefix=prefix)
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"expression": "2 + 2"}
    p = ToolCallText(["calculate"], single=True)
    events = p.push(CALL + "\n" + CALL)
    assert [f for f, _ in events] == ["tool_call"] and p.done  # parallel_tool_calls: false ends the reply


@pytest.fixture(scope="module")
def tokenizers():
    from minimind_ray.tokenizer import load_tokenizer
    from tests.conftest import minimind_tokenizer_dir

    return {g: load_tokenizer(str(minimind_tokenizer_dir(g))) for g in ("minimind2", "minimind3")}


@pytest.mark.parametrize("generation", ["minimind2", "minimind3"])
def test_reply_tokens_with_a_tool_call_give_the_call_and_no_text(tokenizers, generation):
    """minimind-3's tokenizer has <tool_call> as one token, MiniMind2's spells it out: the same call either way."""
    from minimind_ray.generate import StreamDecoder
    from minimind_ray.serve.replies import ReplyText

    tok = tokenizers[generation]
    reply = ReplyText(StreamDecoder(tok), [], False, ToolCallText(["calculate"]))
    deltas = []
    for t in tok.encode(CALL):
        deltas += reply.push(t)
    deltas += reply.finish()
    assert [f for f, _ in deltas] == ["tool_call"] and reply.content == []
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"expression": "12 + 7"}


# --------------------------------------------------------------------------- the API key in the command


def test_the_api_key_leaves_the_driver_only_as_its_sha256(tmp_path, monkeypatch):
    import argparse

    from minimind_ray.config import ConfigError
    from minimind_ray.serve.serve_verb import add_arguments, options_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    key = "k-" + "0123456789abcdef" * 2
    (tmp_path / "key").write_text(key + "\n")
    monkeypatch.delenv("MINIMIND_RAY_API_KEY", raising=False)
    assert options_from_args(p.parse_args([str(tmp_path)])).api_key_sha256 is None
    for argv, env in ((["--api-key", key], None), (["--api-key-file", str(tmp_path / "key")], None), ([], key)):
        if env:
            monkeypatch.setenv("MINIMIND_RAY_API_KEY", env)
        opts = options_from_args(p.parse_args([str(tmp_path), *argv]))
        assert opts.api_key_sha256 == hashlib.sha256(key.encode()).hexdigest()
        assert key not in repr(opts) and key not in json.dumps(opts.__dict__)
    monkeypatch.delenv("MINIMIND_RAY_API_KEY")
    with pytest.raises(ConfigError, match="shorter than 16"):
        options_from_args(p.parse_args([str(tmp_path), "--api-key", "short"]))
    with pytest.raises(ConfigError, match="--api-key-file .*nope: cannot read it"):
        options_from_args(p.parse_args([str(tmp_path), "--api-key-file", str(tmp_path / "nope")]))
