"""Structured output for a replica: the grammar a request asks for (``response_format`` json_object / json_schema, or
a forced ``tool_choice``), compiled for the served tokenizer, and each row's own matcher (model/grammar.py); a schema
that cannot be enforced is a 400 naming its JSON path (docs/serving.md, "Structured output")."""
from __future__ import annotations

from typing import Optional

from minimind_ray.serve.model_io import GrammarCompiler, SchemaError, schema_grammar, tool_call_grammar
from minimind_ray.serve.protocol import APIError

SCHEMA_PARAM = "response_format.json_schema.schema"


class RequestGrammars:
    """The replica's grammars: compiled once per schema (the last 64 kept), each compile within ``timeout_s``."""

    def __init__(self, tokenizer, vocab_size: int, timeout_s: float):
        self.tokenizer, self.vocab_size, self.timeout_s = tokenizer, vocab_size, timeout_s
        self.compiler: Optional[GrammarCompiler] = None  # built by the first structured request (~0.1 s)

    def grammar(self, req, mode: str):
        """The grammar ``req``'s reply follows, or None. ``mode`` (the request's tool mode): required or a function's
        name: one call of a declared function (the named one) with arguments valid against its ``parameters``, after
        the start of the call serve/app.py put in the prompt; else a response_format of json_object or json_schema:
        JSON valid against the schema. The grammar is compiled here, so that a bad schema is refused before the
        request joins the batch."""
        try:
            if mode == "required" or mode.startswith("function:"):
                wanted = mode[len("function:"):] if mode.startswith("function:") else None
                grammar = tool_call_grammar([(t.function.name, t.function.parameters, f"tools.{i}.function.parameters")
                                             for i, t in enumerate(req.tools) if wanted in (None, t.function.name)],
                                            named=wanted is not None)
            elif req.structured():
                grammar = schema_grammar(req.response_format.constraint_schema(), SCHEMA_PARAM)
            else:
                return None
            if self.compiler is None:
                self.compiler = GrammarCompiler(self.tokenizer.to_json(), self.tokenizer.eos_id, self.vocab_size,
                                                self.timeout_s)
            self.compiler.compile(grammar)
        except SchemaError as e:
            raise APIError(400, f"{e.path}: {e.message}", e.path or "response_format") from None
        except ValueError as e:  # a model whose logits do not cover its tokenizer's ids: nothing to constrain
            raise APIError(400, f"response_format: structured output is not available for this model ({e})",
                           "response_format") from None
        return grammar

    def constraint(self, grammar):
        """A row's own matcher for ``grammar`` (None: a free row); the grammar is compiled already (:meth:`grammar`)."""
        return None if grammar is None else self.compiler.constraint(grammar)
