"""Structured output without Ray: the grammar's mask in the serving engine's batched decode step (model/grammar.py,
model/sampling.py:apply_token_bitmask, serve/engine.py), with a freshly initialised model whose replies are near
random, for MiniMind's minimind2 tokenizer and the built-in demo one (both byte-level BPE)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import pytest
import torch

from minimind_ray.model.grammar import GrammarCompiler, SchemaError, new_bitmask, schema_grammar, tool_call_grammar
from minimind_ray.model.sampling import apply_token_bitmask
from tests.conftest import minimind_tokenizer_dir

SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "structured_schemas.json").read_text())


@pytest.fixture(scope="module", params=["minimind2", "builtin"])
def setup(request, tmp_path_factory):
    from minimind_ray.config import ModelConfig
    from minimind_ray.model.minimind import build_model
    from minimind_ray.model.presets import preset_values
    from minimind_ray.tokenizer import load_tokenizer, resolve_tokenizer

    tok = resolve_tokenizer("builtin", str(tmp_path_factory.mktemp("cache"))) if request.param == "builtin" else \
        load_tokenizer(str(minimind_tokenizer_dir(request.param)))
    model = build_model(ModelConfig(**{**preset_values("tiny"), "vocab_size": tok.vocab_size}), seed=0).eval()
    return tok, model, GrammarCompiler(tok.to_json(), tok.eos_id, model.cfg.vocab_size)


def run_engine(model, tok, requests, max_batch=8):
    """Submit ``requests`` (dicts of GenRequest fields) together; -> [(tokens, finish reason)] in order."""
    from minimind_ray.serve.engine import Engine, GenRequest

    engine = Engine(model, eos_id=tok.eos_id, max_batch=max_batch, context=256)
    out = [([], None) for _ in requests]
    left = threading.Semaphore(0)

    def on_event(i, event):
        if event[0] == "token":
            out[i][0].append(event[1])
        elif event[0] in ("end", "error"):
            out[i] = (out[i][0], event[1])
            left.release()

    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    try:
        for i, fields in enumerate(requests):
            engine.submit(GenRequest(prompt_ids=prompt, on_event=lambda e, i=i: on_event(i, e), **fields))
        for _ in requests:
            assert left.acquire(timeout=120)
    finally:
        engine.close()
    return out


def text_of(tok, tokens):
    return tok.decode([t for t in tokens if t != tok.eos_id])


def test_a_batch_mixes_constrained_and_free_rows_and_every_constrained_reply_validates(setup):
    """Eight rows in one batch at temperature 1: the constrained ones (two schemas) end by themselves with JSON that
    validates, their end of turn last; the free greedy rows write exactly what ``generate`` writes alone."""
    from minimind_ray.generate import generate_tokens

    tok, model, grammars = setup
    person, nested = schema_grammar(SCHEMAS["person"]), schema_grammar(SCHEMAS["nested"])
    reqs = []
    for i in range(8):
        grammar = (person, None, nested, None)[i % 4]
        reqs.append(dict(max_new_tokens=120, temperature=1.0 if grammar else 0.0, seed=i,
                         constraint=grammars.constraint(grammar) if grammar else None))
    out = run_engine(model, tok, reqs)
    prompt = torch.tensor([tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")])
    alone = list(generate_tokens(model, prompt, 120, temperature=0.0, eos_token_id=tok.eos_id))
    for i, (tokens, reason) in enumerate(out):
        schema = (SCHEMAS["person"], None, SCHEMAS["nested"], None)[i % 4]
        if schema is None:
            assert tokens == alone
            continue
        assert reason == "stop" and tokens[-1] == tok.eos_id and tok.eos_id not in tokens[:-1], (i, reason)
        jsonschema.validate(json.loads(text_of(tok, tokens)), schema)


def test_the_end_of_turn_is_allowed_only_where_the_grammar_accepts(setup):
    tok, model, grammars = setup
    row = grammars.constraint(schema_grammar(SCHEMAS["weather_args"]))
    ids = tok.encode('{"city": "Oslo", "unit": "celsius"')

    def allows_eos():
        mask = new_bitmask(1, model.cfg.vocab_size)
        row.fill(mask[0])
        logits = apply_token_bitmask(torch.zeros(1, model.cfg.vocab_size), mask)
        return bool(torch.isfinite(logits[0, tok.eos_id])), int(torch.isfinite(logits).sum())

    assert allows_eos()[0] is False  # nothing written yet
    for t in ids:
        assert allows_eos()[0] is False
        row.advance(t)
    assert row.failed is None and allows_eos()[0] is False  # "days" may still come, or "}"
    row.advance(tok.encode("}")[0])
    assert allows_eos() == (True, 1)  # the object is closed: the end of turn and nothing else
    row.advance(tok.eos_id)
    assert row.complete and row.failed is None
    padded = GrammarCompiler(tok.to_json(), tok.eos_id, tok.vocab_size + 64).constraint(schema_grammar(None))
    mask = new_bitmask(1, tok.vocab_size + 64)
    padded.fill(mask[0])
    allowed = torch.isfinite(apply_token_bitmask(torch.zeros(1, tok.vocab_size + 64), mask)[0]).nonzero().flatten()
    assert allowed.tolist() == tok.encode("{")  # any object starts with "{"; a padded vocabulary's ids never come


def test_a_reply_cut_by_max_tokens_says_length_and_an_ignore_eos_row_ends_with_its_grammar(setup):
    tok, model, grammars = setup
    person = schema_grammar(SCHEMAS["person"])
    cut, free = run_engine(model, tok, [dict(max_new_tokens=3, temperature=1.0, seed=1,
                                             constraint=grammars.constraint(person)),
                                        dict(max_new_tokens=3, temperature=1.0, seed=1)])
    assert cut[1] == "length" and len(cut[0]) == 3 and text_of(tok, cut[0]).startswith("{")
    assert free[1] == "length"
    [(tokens, reason)] = run_engine(model, tok, [dict(max_new_tokens=200, temperature=1.0, seed=2,
                                                      stop_at_eos=False, constraint=grammars.constraint(person))])
    assert reason == "stop"  # ignore_eos: nothing may follow the grammar's end, so the row ends there
    jsonschema.validate(json.loads(text_of(tok, tokens)), SCHEMAS["person"])


def test_a_forced_tool_call_names_a_declared_function_with_valid_arguments(setup):
    """After the start serve puts in the prompt (``<tool_call>\\n{"name": "``, or up to a named function's
    arguments), the reply is the rest of one call of a declared function, arguments valid, then its end of turn."""
    tok, model, grammars = setup
    tools = [("get_weather", SCHEMAS["weather_args"], "tools.0.function.parameters"),
             ("ping", None, "tools.1.function.parameters")]
    no_args = {"type": "object", "additionalProperties": False}
    for named, grammar in ((None, tool_call_grammar(tools)), ("get_weather", tool_call_grammar(tools[:1], True))):
        out = run_engine(model, tok, [dict(max_new_tokens=160, temperature=1.0, seed=s,
                                           constraint=grammars.constraint(grammar)) for s in range(4)])
        for tokens, reason in out:
            text = text_of(tok, tokens)
            assert reason == "stop" and tokens[-1] == tok.eos_id, text
            whole = '{"name": "' + text if named is None else '{"name": "get_weather", "arguments": ' + text
            assert whole.endswith("}\n</tool_call>")
            call = json.loads(whole[:-len("\n</tool_call>")])
            assert call["name"] in ("get_weather", "ping") and set(call) == {"name", "arguments"}
            jsonschema.validate(call["arguments"], SCHEMAS["weather_args"] if call["name"] == "get_weather" else
                                no_args)


def test_a_schema_that_cannot_be_constrained_to_is_refused_naming_its_path(setup):
    tok, model, grammars = setup
    where = "response_format.json_schema.schema"
    with pytest.raises(SchemaError) as e:
        schema_grammar({"type": "object", "properties": {"a": {"type": "strin"}}}, where)
    assert e.value.path == where + ".properties.a.type" and "valid JSON Schema" in e.value.message
    with pytest.raises(SchemaError) as e:
        grammars.compile(schema_grammar({"type": "object", "properties": {"a": {"not": {"const": 1}}}}, where))
    assert e.value.path == where + ".properties.a.not" and "'not' is not supported" in e.value.message
    tools = [("f", {"type": "object"}, "tools.0.function.parameters"),
             ("g", {"type": "object", "properties": {"x": {"type": "integer", "if": {"minimum": 1}}}},
              "tools.1.function.parameters")]
    with pytest.raises(SchemaError) as e:
        grammars.compile(tool_call_grammar(tools))
    assert e.value.path == "tools.1.function.parameters.properties.x.if", e.value
    slow = GrammarCompiler(tok.to_json(), tok.eos_id, model.cfg.vocab_size, compile_timeout_s=1e-6)
    with pytest.raises(SchemaError) as e:
        slow.compile(schema_grammar(SCHEMAS["nested"], where))
    assert e.value.path == where and "grammar-timeout-s" in e.value.message


def test_generate_and_chat_take_a_json_schema_file(capsys, tmp_path):
    """`generate --json-schema FILE` at temperature 1 from a fresh model: every reply validates; `chat` too; a file
    that is not JSON, or a schema with a keyword that cannot be enforced, is one line naming the file (exit 2)."""
    import io

    from minimind_ray.cli import main
    from minimind_ray.config import ModelConfig
    from minimind_ray.generate import chat_loop, schema_constraints
    from minimind_ray.model.minimind import build_model
    from minimind_ray.model.presets import preset_values
    from minimind_ray.model.sampling import SamplingParams
    from minimind_ray.store.pth import save_pth
    from minimind_ray.tokenizer import load_tokenizer

    model = build_model(ModelConfig(**preset_values("tiny")), seed=4)
    save_pth(model, str(tmp_path / "tiny.pth"), dtype=torch.float32)
    tok_dir = str(minimind_tokenizer_dir("minimind2"))
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMAS["person"]))
    base = ["generate", str(tmp_path / "tiny.pth"), "--tokenizer", tok_dir, "--temperature", "1",
            "--max-new-tokens", "200"]
    capsys.readouterr()
    assert main(base + ["--prompt", "a user", "--prompt", "another", "--seed", "3", "--json-schema", str(schema)]) == 0
    replies = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("> ")]
    assert len(replies) == 2
    for reply in replies:
        jsonschema.validate(json.loads(reply), SCHEMAS["person"])
    tok = load_tokenizer(tok_dir)
    out = io.StringIO()
    chat_loop(model, tok, SamplingParams(max_new_tokens=200, temperature=1.0, seed=1), inp=io.StringIO("hi\nmore\n"),
              out=out, constraints=schema_constraints(model, tok, SCHEMAS["weather_args"]))
    turns = [line.split("minimind> ", 1)[1] for line in out.getvalue().splitlines() if "minimind> " in line]
    assert len(turns) == 2
    for turn in turns:
        jsonschema.validate(json.loads(turn), SCHEMAS["weather_args"])
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "not.json").write_text(json.dumps({"type": "object", "properties": {"a": {"not": {}}}}))
    for name, words in (("bad.json", "not JSON"), ("not.json", "properties.a.not: the keyword 'not' is not "
                                                               "supported")):
        assert main(base + ["--prompt", "x", "--json-schema", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--json-schema {tmp_path / name}" in err and words in err, err
