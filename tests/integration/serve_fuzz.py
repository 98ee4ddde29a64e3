"""Random request bodies for the serving fuzz tests (test_serve_protocol.py without a server, test_serve.py
through one): valid bodies with one to three fields replaced by random JSON, random shapes, broken bytes.

Seeded, so a failure names a body that can be replayed. Generation stays short: ``max_tokens`` is never
left to its default, and ``n`` stays small.
"""
from __future__ import annotations

import json
import random

CHAT_FIELDS = ["messages", "model", "stream", "stream_options", "temperature", "top_p", "top_k", "max_tokens",
               "max_completion_tokens", "stop", "seed", "n", "logprobs", "top_logprobs", "tools", "tool_choice",
               "parallel_tool_calls", "response_format", "chat_template_kwargs", "open_thinking", "ignore_eos", "user",
               "metadata", "store", "frequency_penalty", "presence_penalty", "logit_bias", "modalities", "audio",
               "reasoning_effort", "functions", "service_tier", "no_such_field"]
COMPLETION_FIELDS = ["prompt", "model", "stream", "stream_options", "temperature", "top_p", "top_k", "max_tokens",
                     "stop", "seed", "n", "logprobs", "echo", "suffix", "best_of", "ignore_eos", "user", "logit_bias",
                     "frequency_penalty", "no_such_field"]
TEXTS = ["hi", "", "\ud800", "\udcff tail", "emoji 🤖", "中文", "\u0000nul", "\u202eRTL", "a" * 300, "<|im_end|>",
         "<tool_call>\n{\"name\": 1}\n</tool_call>", "\\", "\"quoted\""]


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(12 if depth < 2 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 3, 17, 2 ** 31, 2 ** 64, -(2 ** 70), 10 ** 30])
    if kind == 3:
        return rng.choice([0.0, 0.5, 1.5, -0.1, 2.5, 1e308, -1e-9, float("nan"), float("inf")])
    if kind in (4, 5, 6, 7):
        return rng.choice(TEXTS)
    if kind in (8, 9):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["role", "content", "type", "text", "name", "function", "x", "\ud800"]): _value(rng, depth + 1)
            for _ in range(rng.randrange(4))}


TOOL = {"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}
PLAUSIBLE = {  # valid values, so that a good share of the fuzz reaches generation
    "temperature": [0, 0.7, 2], "top_p": [0.5, 1], "top_k": [0, 5], "stop": ["\n", ["a", "b"]], "seed": [0, 7, 2 ** 63],
    "n": [1, 2], "logprobs": [True, False, 0, 2], "top_logprobs": [0, 3], "stream": [True, False],
    "stream_options": [{"include_usage": True}], "user": ["u"], "metadata": [{"k": "v"}], "store": [False],
    "frequency_penalty": [0], "ignore_eos": [True], "tools": [[TOOL]], "tool_choice": ["auto", "none", "required"],
    "parallel_tool_calls": [False], "response_format": [
        {"type": "text"}, {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}, "required": ["b"], "additionalProperties": False}}},
        {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}},
        {"type": "json_schema", "json_schema": {"name": "no", "schema": {"not": {}}}}], "echo": [True, False], "best_of": [1],
    "chat_template_kwargs": [{"enable_thinking": False}], "model": [None],
    "messages": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "中文 🤖 \u0000"}],
                 [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "ok"},
                  {"role": "user", "content": "<|im_end|>"}]],
    "prompt": ["hello", ["a", "b"], [1, 2, 3], [[5, 6], [7]], "\u202eRTL"],
}


def _message(rng: random.Random):
    if rng.random() < 0.7:
        return {"role": rng.choice(["user", "system", "assistant", "tool", "developer", "wizard"]),
                "content": rng.choice([rng.choice(TEXTS), [{"type": "text", "text": rng.choice(TEXTS)}],
                                       [{"type": "image_url", "image_url": {"url": "x"}}], None, 3])}
    return _value(rng, 1)


def chat_body(rng: random.Random) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    for _ in range(rng.randrange(1, 4)):
        field = rng.choice(CHAT_FIELDS)
        if field in PLAUSIBLE and rng.random() < 0.5:
            body[field] = rng.choice(PLAUSIBLE[field])
            if field == "top_logprobs":
                body["logprobs"] = True
        elif field == "messages":
            body["messages"] = rng.choice([[_message(rng) for _ in range(rng.randrange(4))], _value(rng)])
        elif field in ("max_tokens", "max_completion_tokens"):
            body[field] = rng.choice([-1, 0, 1, 3, 1.5, "2", 10 ** 9])
        elif field == "n":
            body["n"] = rng.choice([0, 1, 2, 3, 100, -1, 2.0])
        elif field == "tools":
            body["tools"] = rng.choice([[{"type": "function", "function": {"name": rng.choice(TEXTS)}}],
                                        [{"type": "function"}], _value(rng)])
        else:
            body[field] = _value(rng)
    return body


def completion_body(rng: random.Random) -> dict:
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    for _ in range(rng.randrange(1, 4)):
        field = rng.choice(COMPLETION_FIELDS)
        if field in PLAUSIBLE and rng.random() < 0.5:
            body[field] = rng.choice(PLAUSIBLE[field])
        elif field == "prompt":
            body["prompt"] = rng.choice([rng.choice(TEXTS), [rng.choice(TEXTS)], [1, 2, 3], [[5, 6], [7]], [[]],
                                         [-1], [10 ** 9], _value(rng)])
        elif field == "max_tokens":
            body["max_tokens"] = rng.choice([-1, 0, 1, 3, 1.5, "2", 10 ** 9])
        elif field == "n":
            body["n"] = rng.choice([0, 1, 2, 3, 100, -1])
        else:
            body[field] = _value(rng)
    return body


def raw_bodies(rng: random.Random, body: dict):
    """The body as bytes, sometimes broken: truncated, not UTF-8, not an object."""
    data = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\ud800 escapes, valid JSON
    r = rng.random()
    if r < 0.05:
        return data[:rng.randrange(1, max(2, len(data)))]
    if r < 0.08:
        return b"\xff\xfe" + data
    if r < 0.10:
        return json.dumps(_value(rng)).encode()
    return data
