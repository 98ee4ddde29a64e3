"""Constrained rollouts: an RL stage's completions held to a grammar, as ``generate --json-schema`` and serve's
``response_format`` hold replies (model/grammar.py, llguidance; docs/rl.md, "Constrained rollouts"). Off by default.

* The option, in the algorithm's own section: ``json_schema`` (train.grpo, train.rloo, train.ppo: every completion is
  JSON valid against the file's schema; :func:`json_schema_field`, checked before Ray by :func:`validate_json_schema`
  in one line naming the field and the file), or the agent's ``train.agent.constrain_tool_calls`` (each turn an
  answer or calls of train.agent.tools with valid arguments: :func:`tool_calls_grammar`).
* The plan base asks its algorithm for the grammar once (rl/plan.py: ``RolloutPlan.grammar``) and puts its text in the
  sampling params (``SamplingParams.grammar``), so that it reaches a worker's sampler and a rollout actor alike, and
  a step's requests still merge into one batch.
* The sampler (rl/rollout.py:sample_completions) keeps one matcher per row (:class:`RowsConstraint`): before each
  pick of the batched decode step the live rows' bitmasks go onto a copy of the logits; the sampled token moves the
  row's matcher on. The behaviour log-probs stay the unconstrained model's (docs/rl.md says why).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from minimind_ray.config_checks import ConfigError, config_field
from minimind_ray.rl.tools import BUILTIN_TOOLS

# Light at the top: the sections (stages/, which the CLI reads) name json_schema_field; llguidance and torch are
# imported where a schema is checked or a constraint used.

COMPILE_TIMEOUT_S = 60.0  # a run's grammar compiles once per sampler; the bound only stops a pathological schema


def json_schema_field():
    """The ``json_schema`` field of an RL algorithm's section (one help line for all of them)."""
    return config_field(None, "a JSON Schema file (a path every worker can read; made absolute on the driver): every "
                              "completion is sampled under llguidance's mask to be JSON valid against it, or is cut "
                              "at max_gen_len (docs/rl.md, 'Constrained rollouts'); None = free sampling")


def read_json_schema(path: str, where: str) -> dict:
    """The schema of ``where``'s file; a ConfigError naming the field and the file when it cannot be read or is not
    a JSON object."""
    from minimind_ray.model.grammar import read_schema_file  # lazy: llguidance, torch

    try:
        return read_schema_file(os.path.expanduser(path))
    except ValueError as e:
        raise ConfigError(f"{where}: {path}: {e}") from None


def validate_json_schema(path: Optional[str], where: str) -> None:
    """Before Ray: the file at ``path`` (None: off) is a JSON Schema llguidance can constrain to, else one line
    naming the field, the file and the schema's bad keyword (as ``generate --json-schema`` says it)."""
    if path is None:
        return
    from minimind_ray.model.grammar import SchemaError, check_grammar, schema_grammar  # lazy: llguidance, torch

    try:
        check_grammar(schema_grammar(read_json_schema(path, where)))
    except SchemaError as e:
        raise ConfigError(f"{where}: {path}: {e}") from None


def json_schema_grammar(path: Optional[str], where: str) -> Optional[str]:
    """The grammar text of the section's ``json_schema`` file (None: off)."""
    from minimind_ray.model.grammar import schema_grammar  # lazy: llguidance, torch, when a run samples

    return None if path is None else schema_grammar(read_json_schema(path, where)).text


def tool_calls_grammar(tools) -> str:
    """The grammar text of an agent's turn with constrained calls: free text without ``<tool_call>``, or calls of
    ``tools`` (train.agent.tools: each a ToolConfig, its schema or the built-in's) with arguments valid against
    their parameters (model/grammar.py:reply_or_tool_calls_grammar)."""
    return _tools_grammar(tools).text


def validate_tool_calls(tools, where: str) -> None:
    """Before Ray: the tools' parameter schemas can be constrained to, else one line naming ``where`` and the bad
    keyword's path (``train.agent.tools[0].schema.function.parameters...``)."""
    from minimind_ray.model.grammar import SchemaError, check_grammar  # lazy: llguidance, torch

    try:
        check_grammar(_tools_grammar(tools))
    except SchemaError as e:
        raise ConfigError(f"{where}: {e}") from None


def _tools_grammar(tools):
    from minimind_ray.model.grammar import reply_or_tool_calls_grammar  # lazy: llguidance, torch

    triples = []
    for i, t in enumerate(tools):
        schema = t.schema or BUILTIN_TOOLS[t.name][1]
        fn = schema.get("function", schema)
        triples.append((t.name, fn.get("parameters"), f"train.agent.tools[{i}].schema.function.parameters"))
    return reply_or_tool_calls_grammar(triples)


def with_absolute_schema(train, absolute):
    """The TrainConfig ``train`` with its stage's ``json_schema`` path passed through ``absolute`` (the driver's
    copy for the workers, which run in another directory); unchanged without one."""
    section = getattr(train, train.stage, None)
    if getattr(section, "json_schema", None) is None:
        return train
    return dataclasses.replace(train, **{train.stage: dataclasses.replace(section,
                                                                         json_schema=absolute(section.json_schema))})


def grammar_compiler(tokenizer, vocab_size: int):
    """The compiler a sampler keeps for the run's tokenizer (``tokenizer``: the project's Tokenizer)."""
    return compiler_of(tokenizer.to_json(), tokenizer.eos_id, vocab_size)


def compiler_of(tokenizer_json: str, eos_id: int, vocab_size: int):
    """A GrammarCompiler (model/grammar.py) for a sampler, from the tokenizer's HF JSON (what a rollout actor gets)."""
    from minimind_ray.model.grammar import GrammarCompiler  # lazy: llguidance, torch, when a run samples

    return GrammarCompiler(tokenizer_json, eos_id, vocab_size, compile_timeout_s=COMPILE_TIMEOUT_S)


class RowsConstraint:
    """The matchers of a rollout's N rows, all at the start of one grammar (``grammar``: its llguidance text)."""

    def __init__(self, compiler, grammar: str, rows: int):
        from minimind_ray.model.grammar import Grammar  # lazy: llguidance, torch, when a run samples

        wanted = Grammar(grammar)  # compiled once per text by the compiler, then one matcher copy per row
        self.rows = [compiler.constraint(wanted) for _ in range(rows)]

    def masked(self, logits, alive):
        """A copy of ``logits`` (N, V) in which each live row allows only what its grammar allows next (a finished
        row's logits are left as they are: its token is replaced by the pad)."""
        from minimind_ray.model.grammar import new_bitmask  # lazy: llguidance, torch, when a run samples
        from minimind_ray.model.sampling import apply_token_bitmask  # lazy: torch, when a run samples

        # a matcher that refused a token (never under its own mask: a bug) leaves its row free, not all -inf
        live = [r for r in alive.nonzero().squeeze(1).tolist() if self.rows[r].failed is None]
        out = logits.clone()
        if not live:
            return out
        bitmask = new_bitmask(len(live), logits.shape[-1])
        for j, r in enumerate(live):
            self.rows[r].fill(bitmask[j])
        out[live] = apply_token_bitmask(out[live], bitmask)
        return out

    def advance(self, tokens, alive) -> None:
        """Each live row's matcher past its sampled token."""
        for r in alive.nonzero().squeeze(1).tolist():
            self.rows[r].advance(int(tokens[r]))
