"""Constrained RL rollouts (rl/constraints.py) without Ray: off, the batched sampler gives the tokens recorded before
the option existed; on, every completion of a freshly initialised model is JSON valid against the section's schema or
cut by length, an agent's calls are calls of its declared tools with valid arguments, the log-probs are the
unconstrained model's, a rollout actor samples what the worker does; a bad schema file is refused before Ray in one
line naming the field and the file."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jsonschema
import pytest
import torch

from minimind_ray.config import ConfigError, RunConfig, load_config
from minimind_ray.model.sampling import SamplingParams
from minimind_ray.rl.constraints import grammar_compiler, json_schema_grammar, tool_calls_grammar, with_absolute_schema
from minimind_ray.rl.logprobs import completion_logprobs
from minimind_ray.rl.rollout import row_seeds, sample_completions
from minimind_ray.rl.tools import parse_tool_calls
from minimind_ray.stages.agent import ToolConfig
from tests.conftest import minimind_tokenizer_dir
from tests.unit.test_agent import agent_prepared  # noqa: F401 (the agent_rl prompts and base weights)
from tests.unit.test_grpo import prepared  # noqa: F401 (the prepared prompts and base weights)
from tests.unit.test_kv_cache import GOLDEN, make  # the decode golden tests' models, prompts and recorded tokens

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = json.loads((REPO / "tests" / "fixtures" / "structured_schemas.json").read_text())
PICK = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from minimind_ray.tokenizer import load_tokenizer

    return load_tokenizer(str(minimind_tokenizer_dir("minimind2")))


@pytest.fixture(scope="module")
def compiler(tok):
    return grammar_compiler(tok, tok.vocab_size)


@pytest.fixture(scope="module")
def fresh(tok):
    """A freshly initialised model: its replies are near random, where the guarantee matters most."""
    from minimind_ray.config import ModelConfig
    from minimind_ray.model.minimind import build_model
    from minimind_ray.model.presets import preset_values

    return build_model(ModelConfig(**{**preset_values("tiny"), "vocab_size": tok.vocab_size}), seed=0).eval()


def chat_batch(tok, contents, group):
    """GRPO's shape: chat-templated prompts, left-padded, each repeated for its group, with per-row seeds."""
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True))
               for c in contents]
    ids, mask = make.left_pad(prompts)
    return ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0), row_seeds(5, 2, torch.arange(len(
        prompts)), group)


def replies(tok, roll):
    """(text through the EOS, without it; cut by length) per row."""
    return [(tok.decode([t for t in row[m].tolist() if t != tok.eos_id]), bool(cut))
            for row, m, cut in zip(roll.completion_ids, roll.completion_mask, roll.truncated)]


def test_off_the_sampler_gives_the_tokens_recorded_before_the_option(compiler):
    """tests/fixtures/decode_golden.json's rollouts (recorded at b090f53): a sampler that holds a grammar compiler but
    gets no grammar samples them token for token, as one without."""
    model, want = make.model_for("tiny", False), GOLDEN["tiny"]
    ids, mask = make.left_pad([make.prompt_of(n, seed) for seed, n in enumerate(make.ROLLOUT_PROMPTS)])
    params = SamplingParams(max_new_tokens=14, temperature=1.0, top_p=0.95, top_k=50, eos_id=want["rollout_eos"],
                            pad_id=0)
    assert params.grammar is None
    seeds = row_seeds(11, 3, torch.arange(ids.shape[0]), 1)
    for grammars in (compiler, None):
        got = sample_completions(model, ids, mask, params, seeds=seeds, grammars=grammars)
        assert got.completion_ids.tolist() == want["rollout_seeded"]["ids"]
        assert got.completion_mask.int().tolist() == want["rollout_seeded"]["mask"]
        torch.testing.assert_close(got.logprobs, torch.tensor(want["rollout_seeded"]["logprobs"]), atol=2e-5, rtol=0)


def test_off_no_section_names_a_grammar():
    """Every RL plan asks its section for the grammar; at the defaults there is none (sampling params as before)."""
    from minimind_ray.stages import STAGES

    cfg = RunConfig()
    for name in ("grpo", "rloo", "ppo", "agent"):
        cfg.train.stage = name
        assert STAGES[name].objective(cfg).grammar() is None, name


def test_on_every_completion_validates_against_the_schema_or_is_cut_by_length(tok, compiler, fresh, tmp_path):
    """A fresh model at temperature 1, 3 prompts x 4 completions: every one that ends is JSON valid against the
    schema; the sampled tokens' log-probs are the unconstrained model's (the trainer's), not the masked ones'."""
    path = tmp_path / "person.json"
    path.write_text(json.dumps(SCHEMAS["person"]))
    ids, mask, seeds = chat_batch(tok, ["a person", "who is it?", "describe someone in JSON"], 4)
    params = SamplingParams(max_new_tokens=96, temperature=1.0, eos_id=tok.eos_id, pad_id=tok.pad_id,
                            grammar=json_schema_grammar(str(path), "train.grpo.json_schema"))
    roll = sample_completions(fresh, ids, mask, params, seeds=seeds, grammars=compiler)
    ended = [text for text, cut in replies(tok, roll) if not cut]
    assert len(ended) >= 6, replies(tok, roll)
    for text in ended:
        jsonschema.validate(json.loads(text), SCHEMAS["person"])
    free = sample_completions(fresh, ids, mask, dataclasses.replace(params, grammar=None), seeds=seeds)
    assert not any(text.startswith("{") for text, _ in replies(tok, free))  # the mask, not the model, made them JSON
    full = torch.cat([ids, roll.completion_ids], 1)
    logp, _ = completion_logprobs(fresh, full, torch.cat([mask, roll.completion_mask.long()], 1),
                                  roll.completion_ids.shape[1])
    on = roll.completion_mask
    torch.testing.assert_close(roll.logprobs[on], logp[on].float(), atol=1e-4, rtol=0)
    assert bool((roll.logprobs[on] < -1e-3).any())  # forced tokens too keep the model's probability, not 1


class Leading(torch.nn.Module):
    """``model`` led to start every reply with ``tokens``: +``bias`` on the logit of the t-th at decode step t (a
    policy that begins a tool call and is left to itself after the call's opening)."""

    def __init__(self, model, tokens, bias=30.0):
        super().__init__()
        self.inner, self.cfg, self.tokens, self.bias, self.calls = model, model.cfg, tokens, bias, 0

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if self.calls < len(self.tokens):
            out.logits[..., self.tokens[self.calls]] += self.bias
        self.calls += 1
        return out


def test_an_agents_constrained_turns_are_answers_or_valid_calls_of_its_declared_tools(tok, compiler, fresh):
    """A policy that opens a tool call: free, it writes broken calls; under train.agent.constrain_tool_calls' grammar
    every turn that ends holds calls of the declared tools with valid arguments (or is an answer without a call)."""
    from minimind_ray.model.grammar import CALL_OPEN

    tools = [ToolConfig("calculate"), ToolConfig("pick", function="tests.unit.agent_tools:raises",
                                                 schema={"type": "function", "function": {"name": "pick",
                                                                                          "parameters": PICK}})]
    schemas = {"calculate": {"type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}, "pick": PICK}
    ids, mask, seeds = chat_batch(tok, ["what is 3 + 4?", "pick a number"], 6)
    params = SamplingParams(max_new_tokens=96, temperature=1.0, eos_id=tok.eos_id, pad_id=tok.pad_id,
                            grammar=tool_calls_grammar(tools))
    opening = tok.encode(CALL_OPEN)
    free = replies(tok, sample_completions(Leading(fresh, opening), ids, mask, dataclasses.replace(params, grammar=None),
                                           seeds=seeds))
    assert all(text.startswith(CALL_OPEN) and not parse_tool_calls(text)[0] for text, _ in free)  # broken calls
    calls = 0
    for text, cut in replies(tok, sample_completions(Leading(fresh, opening), ids, mask, params, seeds=seeds,
                                                     grammars=compiler)):
        assert text.startswith(CALL_OPEN), text
        if cut:
            continue
        found, bad = parse_tool_calls(text)
        assert bad == 0 and found and text.count("<tool_call>") == len(found), text
        for call in found:
            jsonschema.validate(call["arguments"], schemas[call["name"]])
        calls += len(found)
    assert calls >= 3


def test_a_rollout_actor_samples_under_the_grammar_what_the_worker_does(tok, compiler, fresh):
    """The actor class itself, without Ray: given the tokenizer's JSON it compiles the grammar and samples the same."""
    from minimind_ray.rl.actors import RolloutActor

    ids, mask, seeds = chat_batch(tok, ["a person", "another"], 3)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, eos_id=tok.eos_id, pad_id=tok.pad_id,
                            grammar=tool_calls_grammar([ToolConfig("calculate")]))
    actor = RolloutActor(dataclasses.asdict(fresh.cfg), 1, 0.0, (tok.to_json(), tok.eos_id))
    actor.load(1, fresh.state_dict())
    got = actor.generate(1, ids, mask, params, seeds)
    want = sample_completions(fresh, ids, mask, params, seeds=seeds, grammars=compiler)
    assert torch.equal(got.completion_ids, want.completion_ids)
    with pytest.raises(ValueError, match="grammar compiler"):
        sample_completions(fresh, ids, mask, params, seeds=seeds)


def _refusal(recipe: str, overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(str(REPO / "pipelines" / "configs" / recipe), ["train.init_from=.", *overrides])
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("stage", ["grpo", "rloo", "ppo"])
def test_a_bad_schema_file_is_refused_before_ray_in_one_line_naming_the_field_and_the_file(stage, tmp_path):
    field = f"train.{stage}.json_schema"
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "not.json").write_text(json.dumps({"type": "object", "properties": {"a": {"not": {}}}}))
    (tmp_path / "invalid.json").write_text(json.dumps({"type": "object", "properties": {"a": {"type": 3}}}))
    (tmp_path / "good.json").write_text(json.dumps(SCHEMAS["person"]))
    for name, words in (("bad.json", "not JSON"), ("missing.json", "cannot read it"),
                        ("not.json", "properties.a.not: the keyword 'not' is not supported"),
                        ("invalid.json", "properties.a.type: not a valid JSON Schema")):
        msg = _refusal(f"demo_{stage}.yaml", [f"{field}={tmp_path / name}"])
        assert msg.startswith(f"{field}: {tmp_path / name}: ") and words in msg, msg
    cfg = load_config(str(REPO / "pipelines" / "configs" / f"demo_{stage}.yaml"),
                      ["train.init_from=.", f"{field}={tmp_path / 'good.json'}"])
    assert getattr(cfg.train, stage).json_schema == str(tmp_path / "good.json")


def test_an_agents_tool_schema_that_cannot_be_constrained_to_is_refused_naming_it():
    msg = _refusal("demo_agent.yaml", ["train.agent.constrain_tool_calls=true", "train.agent.tools=[{name: pick, "
                                       "function: 'tests.unit.agent_tools:raises', schema: {type: function, function: "
                                       "{name: pick, parameters: {type: object, properties: {n: {not: {}}}}}}}]"])
    assert msg.startswith("train.agent.constrain_tool_calls: train.agent.tools[0].schema.function.parameters."
                          "properties.n.not: the keyword 'not' is not supported"), msg


def test_the_workers_get_the_schema_path_absolute(tmp_path, monkeypatch):
    """The workers run in another directory: a relative json_schema is made absolute in the driver's copy."""
    from minimind_ray.raytrain.driver import absolute_weight_paths
    from minimind_ray.stages import STAGES

    monkeypatch.chdir(tmp_path)
    train = RunConfig().train
    train = dataclasses.replace(train, stage="rloo", rloo=dataclasses.replace(train.rloo, json_schema="s.json"))
    assert absolute_weight_paths(train, STAGES["rloo"]).rloo.json_schema == str(tmp_path / "s.json")
    plain = dataclasses.replace(train, stage="grpo")
    assert with_absolute_schema(plain, str.upper) is plain  # no schema: the same config


ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}


def test_a_grpo_step_with_a_schema_samples_only_valid_json_and_trains(prepared, tmp_path):
    """The whole path without Ray: the plan asks its section for the grammar, the worker's sampler (built with the
    run's tokenizer) masks every row of the step's merged batch; each completion that ends is valid, and two steps
    train with finite metrics."""
    from minimind_ray.engine.loop import run
    from tests.unit.test_engine import MetricsByStep
    from minimind_ray.engine.state import TrainState
    from minimind_ray.tokenizer import load_tokenizer
    from tests.unit.test_grpo import grpo_config

    path, base = prepared
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps(ANSWER))
    cfg = grpo_config(base, "train.grpo.max_gen_len=24", f"train.grpo.json_schema={schema}", "train.max_steps=2")
    state = TrainState.build(cfg, path)
    out = state.objective.prepare(state, state.stream.peek(), 1)
    tok = load_tokenizer(str(minimind_tokenizer_dir("minimind2")))
    ended = 0
    for b in out:
        R = b["completion_mask"].shape[1]
        for row, m in zip(b["input_ids"][:, -R:], b["attention_mask"][:, -R:].bool()):
            tokens = row[m].tolist()
            if tokens and tokens[-1] == tok.eos_id:
                jsonschema.validate(json.loads(tok.decode(tokens[:-1])), ANSWER)
                ended += 1
    assert ended >= 4
    seen = MetricsByStep()
    run(state, seen)
    state.stream.close()
    assert sorted(seen.by_step) == [1, 2]
    for key in ("loss", "reward", "kl", "clip_fraction", "completion_len"):
        assert math.isfinite(seen.by_step[2][key]), key


def test_an_agent_step_with_constrained_tool_calls_runs_its_turns_under_the_grammar(agent_prepared):
    """The agent's plan: constrain_tool_calls gives its sampler the compiler and every turn's params the tool-call
    grammar of train.agent.tools; one step of turns runs, and no call it makes is broken."""
    from minimind_ray.engine.state import TrainState
    from tests.unit.test_agent import agent_config

    path, base, _ = agent_prepared
    cfg = agent_config(base, "train.global_batch_size=1", "train.agent.constrain_tool_calls=true")
    state = TrainState.build(cfg, path)
    b = state.objective.prepare(state, state.stream.next_step(), 1)[0]
    state.stream.close()
    plan = state.objective
    assert plan.engine.grammars is not None and plan.params().grammar == tool_calls_grammar(cfg.train.agent.tools)
    assert float(b["metric_bad_tool_calls"]) == 0.0 and float(b["metric_turns"]) >= 2.0
