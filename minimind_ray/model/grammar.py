"""Constrained decoding (structured output): a JSON Schema, any JSON object, or a call of one of a request's tools,
compiled for a tokenizer by llguidance; one matcher per row, whose bitmask of allowed tokens goes onto the row's
logits before the one sampler (model/sampling.py: ``apply_token_bitmask``), so constrained and free rows share a
batch. docs/serving.md says why llguidance and not xgrammar, with the measurements (bench/bench_structured.py).

No grammar engine here: llguidance's. This module turns what a caller asks for into llguidance's grammar, checks it
(an invalid schema, a keyword llguidance does not implement, a compile over its time bound: a :class:`SchemaError`
naming the JSON path), caches compiled grammars per tokenizer, and keeps a row's matcher in step with its tokens.
The end-of-turn token is allowed exactly where the grammar accepts; once the grammar is complete it is the only one.
"""
from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import llguidance
import torch

#: How the JSON is spelled: the separators of MiniMind's own tool calls (``{"name": "f", "arguments": {...}}``), and
#: no free whitespace (a nearly untrained model would spend its tokens on it; nothing parses differently without it)
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: no parameters = none
CALL_OPEN = '<tool_call>\n{"name": "'  # what starts a call (serve/app.py:_forced_prefix puts it before a forced one)
CALL_CLOSE = "\n</tool_call>"  # what follows a call's JSON


class SchemaError(ValueError):
    """A schema this server cannot constrain to: ``path`` is where, inside the schema (``properties.age.type``; ""
    for the schema itself), ``message`` says what."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path or '(the schema)'}: {message}")
        self.path, self.message = path, message


@dataclass(frozen=True)
class Grammar:
    """llguidance's grammar text, and the JSON schemas it was made from with their paths in the caller's input (for
    the messages of a SchemaError: which keyword, where)."""

    text: str
    schemas: Tuple[Tuple[Any, str], ...] = ()

    def where(self) -> str:
        return self.schemas[0][1] if len(self.schemas) == 1 else self.schemas[0][1].split(".", 1)[0] if \
            self.schemas else ""


def read_schema_file(path: str) -> dict:
    """The JSON Schema in the file at ``path``; a ValueError saying why not (unreadable, not JSON, not an object), which
    the caller prefixes with the flag or field that named the file (``generate --json-schema``, an RL section's
    ``json_schema``)."""
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON Schema is a JSON object")
    return schema


def schema_grammar(schema: Optional[dict], where: str = "") -> Grammar:
    """JSON valid against ``schema`` (None: any JSON object); the schema is checked against its metaschema first (an
    invalid one is a SchemaError at the bad keyword). ``where``: the schema's path in the caller's input."""
    schema = ANY_OBJECT if schema is None else schema
    _check_metaschema(schema, where)
    text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=dict(JSON_STYLE))
    return Grammar(text, ((schema, where),))


def tool_call_grammar(tools: Sequence[Tuple[str, Optional[dict], str]], named: bool = False) -> Grammar:
    """The rest of one call of one of ``tools`` ((name, parameters schema, the schema's path in the caller's input)
    triples) as MiniMind writes it, after what serve/app.py put at the start of the reply: ``<tool_call>\\n{"name":
    "`` (then a tool's name, ``", "arguments": ``, arguments valid against its parameters), or with ``named`` (one
    tool) ``<tool_call>\\n{"name": "<its name>", "arguments": `` (then its arguments); ``}`` and ``\\n</tool_call>``
    close it."""
    rules, schemas = _call_rules(tools, named)
    text = "start: " + " | ".join(f"call{i}" for i in range(len(rules))) + "\n" + "\n".join(rules) + "\n"
    return Grammar(text, tuple(schemas))


def reply_or_tool_calls_grammar(tools: Sequence[Tuple[str, Optional[dict], str]]) -> Grammar:
    """A whole reply that is either free text without ``<tool_call>`` (an answer) or one or more calls of ``tools``
    (as :func:`tool_call_grammar`), each a ``<tool_call>`` block on its own lines, MiniMind's format, and nothing
    else: what an RL agent's turn may be when its tool calls are constrained (rl/constraints.py). Text before a call
    is not allowed: llguidance's lexer takes the longest match and cannot end free text where a call begins."""
    rules, schemas = _call_rules(tools, named=False)
    text = ("start: ANSWER | calls\n"
            "ANSWER: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/\n"
            "calls: call (\"\\n\" call)*\n"
            f"call: {json.dumps(CALL_OPEN)} (" + " | ".join(f"call{i}" for i in range(len(rules))) + ")\n"
            + "\n".join(rules) + "\n")
    return Grammar(text, tuple(schemas))


def _call_rules(tools: Sequence[Tuple[str, Optional[dict], str]], named: bool) -> Tuple[List[str], List[tuple]]:
    """One rule per tool (``call<i>``): what follows ``CALL_OPEN`` (or, ``named``, the name as well) to the call's
    end; and the (schema, path) pairs."""
    rules, schemas = [], []
    for i, (name, params, where) in enumerate(tools):
        params = NO_ARGUMENTS if params is None else params
        _check_metaschema(params, where)
        schemas.append((params, where))
        head = "" if named else json.dumps(json.dumps(name, ensure_ascii=False)[1:] + ', "arguments": ',
                                           ensure_ascii=False) + " "
        rules.append(f"call{i}: {head}%json {json.dumps({**params, 'x-guidance': dict(JSON_STYLE)})} "
                     f"{json.dumps('}' + CALL_CLOSE)}")
    return rules, schemas


def check_grammar(grammar: Grammar) -> None:
    """``grammar`` compiles for llguidance (checked without a tokenizer: a config check before any model loads); a
    SchemaError naming the unsupported keyword's path otherwise."""
    error = llguidance.LLMatcher.validate_grammar(grammar.text)
    if error:
        raise _explain(error, grammar)


class GrammarCompiler:
    """Grammars compiled for one tokenizer, the last ``cache_size`` kept (a repeated schema compiles once).
    ``tokenizer_json``: the HF tokenizers JSON of the tokenizer (project ``Tokenizer.to_json()``); ``vocab_size``:
    the model's logits width, at least the tokenizer's (ids past the tokenizer's are never allowed)."""

    def __init__(self, tokenizer_json: str, eos_id: int, vocab_size: int, compile_timeout_s: float = 5.0,
                 cache_size: int = 64):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos_id)
        if vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"the model's {vocab_size} logits do not cover the tokenizer's "
                             f"{self.tokenizer.vocab_size} ids")
        self.eos_id, self.vocab_size = eos_id, vocab_size
        self.compile_timeout_s, self.cache_size = compile_timeout_s, cache_size
        self._compiled: "collections.OrderedDict[str, llguidance.LLMatcher]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> "llguidance.LLMatcher":
        """A matcher at the start of ``grammar`` (copy it per row: :meth:`constraint`); a SchemaError naming the
        unsupported keyword (its path found in the schema) or the time bound."""
        key, where = grammar.text, grammar.where()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        done: Dict[str, Any] = {}

        def build():  # llguidance drops the GIL while it builds: the wait below is a real bound
            try:
                done["matcher"] = llguidance.LLMatcher(self.tokenizer, key, log_level=0)
            except Exception as e:  # noqa: BLE001 - llguidance says it never raises for a grammar; a refusal if it does
                done["error"] = f"{type(e).__name__}: {e}"

        worker = threading.Thread(target=build, name="grammar-compile", daemon=True)
        started = time.monotonic()
        worker.start()
        worker.join(self.compile_timeout_s)
        # Still running: it finishes in the background and is dropped. Finished, but past the bound (the join can
        # return late on a busy machine): refused the same, so the bound means one thing whatever the scheduler did.
        if worker.is_alive() or time.monotonic() - started > self.compile_timeout_s:
            raise SchemaError(where, f"compiling the schema took over {self.compile_timeout_s:g} s (this server's "
                                     f"bound: serve --grammar-timeout-s); simplify it")
        if "error" in done:
            raise _explain(done["error"], grammar)
        matcher = done["matcher"]
        if matcher.is_error():
            raise _explain(matcher.get_error(), grammar)
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return matcher

    def constraint(self, grammar: Grammar) -> "RowConstraint":
        """A fresh row's constraint (its own matcher state) for ``grammar``."""
        return RowConstraint(self.compile(grammar).deep_copy(), (self.tokenizer.vocab_size + 31) // 32)


class RowConstraint:
    """One row's matcher: the tokens it may emit next (:meth:`fill`), moved on by each emitted one (:meth:`advance`).
    ``failed``: why the matcher stopped following the row (a token it refused), else None."""

    def __init__(self, matcher: "llguidance.LLMatcher", words: int):
        self.matcher, self.words = matcher, words  # words: the tokenizer's ids / 32, what llguidance writes
        self.failed: Optional[str] = None

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed-token bits into ``row``, a contiguous int32 CPU tensor of ``ceil(logits / 32)`` words (bit
        ``i % 32`` of word ``i // 32`` for token ``i``); ids past the tokenizer's (a model's padded vocabulary) are
        never allowed."""
        row[self.words:] = 0
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)

    def advance(self, token: int) -> None:
        if self.failed is None and not self.matcher.consume_token(int(token)):
            self.failed = self.matcher.get_error() or f"token {token} is not allowed here"

    @property
    def complete(self) -> bool:
        """The grammar is finished: only the end-of-turn token is left."""
        return self.matcher.is_stopped()


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask for ``rows`` rows: int32 (rows, ceil(vocab / 32)), the layout :meth:`fill` writes."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _check_metaschema(schema: Any, where: str) -> None:
    """An invalid schema (not an object, a keyword of the wrong type...) -> SchemaError at the bad keyword."""
    import jsonschema  # lazy: only a constrained request pays for its import

    if not isinstance(schema, dict):
        raise SchemaError(where, "a schema must be a JSON object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        inner = ".".join(str(p) for p in e.absolute_path)
        raise SchemaError(".".join(p for p in (where, inner) if p), f"not a valid JSON Schema: {e.message}") from None


def _explain(error: str, grammar: Grammar) -> SchemaError:
    """llguidance's refusal as a SchemaError; an unimplemented keyword is looked up in the schemas for its path."""
    keyword = _unimplemented_keyword(error)
    if keyword:
        for schema, where in grammar.schemas:
            found = _find_key(schema, keyword, [])
            if found:
                return SchemaError(".".join([where] + found if where else found),
                                   f"the keyword {keyword!r} is not supported for constrained decoding")
    first = error.strip().splitlines()[0][:300] if error.strip() else "refused"
    return SchemaError(grammar.where(), f"cannot be compiled for constrained decoding: {first}")


def _unimplemented_keyword(error: str) -> Optional[str]:
    marker = "Unimplemented keys: ["
    i = error.find(marker)
    if i < 0:
        return None
    names = error[i + len(marker):].split("]", 1)[0]
    first = names.split(",")[0].strip().strip('"')
    return first or None


def _find_key(node: Any, key: str, path: List[str]) -> Optional[List[str]]:
    if isinstance(node, dict):
        if key in node:
            return path + [key]
        items = node.items()
    elif isinstance(node, list):
        items = ((str(i), v) for i, v in enumerate(node))
    else:
        return None
    for k, v in items:
        found = _find_key(v, key, path + [str(k)])
        if found:
            return found
    return None
