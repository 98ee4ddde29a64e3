"""The agent stage without Ray (issue 24, part 2; docs/rl.md): the safe calculator, tool calls parsed and checked, the
tool runner's time limit and errors, the tool turns as the chat template renders them, MiniMind's reward terms by
hand, the agent_rl format's bad-record policy, a multi-turn rollout that runs the tool and trains only the policy's
tokens, and the engine's agent stage saving and restoring bit for bit."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch

from minimind_ray.config import ConfigError, load_config
from minimind_ray.rl.rewards import RewardConfig
from minimind_ray.rl.rollout import TorchRollout
from minimind_ray.rl.tools import CALCULATOR_SCHEMA, ToolBox, calculate, check_arguments, parse_tool_calls
from minimind_ray.rl.trajectory_rewards import build_agent_rewards, gt_found, score_trajectories
from minimind_ray.rl.turns import Trajectory, tool_turn_text
from minimind_ray.stages.agent import ToolConfig
from tests.conftest import minimind_tokenizer_dir

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "3 + 4"}}\n</tool_call>'


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculate("12 + 7") == {"result": 19} and calculate(" (3 + 4) * 2 - 1 ") == {"result": 13}
    assert calculate("2^10") == {"result": 1024} and calculate("6 × 7 ÷ 3") == {"result": 14.0}  # MiniMind's spellings
    assert calculate("sqrt(144)") == {"result": 12.0} and calculate("math.sqrt(16) + abs(-2)") == {"result": 6.0}
    assert calculate("7 // 2 + 7 % 2 + 2 ** -1") == {"result": 4.5}
    for text in ("__import__('os').system('true')", "open('/etc/passwd')", "(1).__class__", "x + 1", "[1] * 3",
                 "'a' * 3", "lambda: 1", "9 ** 9 ** 9", "10 ** 400", "factorial(1000)", "1" * 300, "True + 1"):
        with pytest.raises(ValueError):
            calculate(text)
    with pytest.raises(ZeroDivisionError):
        calculate("1 / 0")


def test_tool_calls_are_parsed_and_their_arguments_checked_against_the_schema():
    text = (CALL + ' then <tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
            " and <tool_call>not json</tool_call> <tool_call>[1, 2]</tool_call>")
    calls, bad = parse_tool_calls(text)
    assert calls == [{"name": "calculate", "arguments": {"expression": "3 + 4"}},
                     {"name": "calculate", "arguments": {"expression": "1+1"}}] and bad == 2
    fn = CALCULATOR_SCHEMA["function"]
    assert check_arguments(fn, {"expression": "3 + 4"}) is None
    assert "required" in check_arguments(fn, {}) and "empty" in check_arguments(fn, {"expression": ""})
    assert "schema" in check_arguments(fn, {"expression": 7}) and "object" in check_arguments(fn, ["3 + 4"])


def test_a_tool_that_raises_hangs_or_dies_becomes_an_error_message():
    def tool(name, fn, timeout=5.0):
        return ToolConfig(name, f"tests.unit.agent_tools:{fn}", {"type": "function", "function": {"name": name}}, timeout)

    box = ToolBox([ToolConfig("calculate"), tool("raises", "raises"), tool("sleeps", "sleeps", 0.5),
                   tool("exits", "exits"), tool("not_json", "not_json")])
    try:
        assert box.run("calculate", {"expression": "3 + 4"}) == ('{"result": 7}', False)
        for name, args, words in (("raises", {}, "RuntimeError: the tool broke"),
                                  ("calculate", {"expr": "1"}, "unexpected keyword"),
                                  ("calculate", {"expression": "1 / 0"}, "ZeroDivisionError"),
                                  ("nope", {}, "unknown tool"), ("calculate", "3 + 4", "must be an object"),
                                  ("not_json", {}, "TypeError"), ("exits", {}, "exited")):
            content, failed = box.run(name, args)
            assert failed and words in json.loads(content)["error"], (name, content)
        t0 = time.monotonic()
        content, failed = box.run("sleeps", {})
        assert failed and "within 0.5 s" in json.loads(content)["error"] and time.monotonic() - t0 < 25  # not 30 s
        assert box.timeouts == 1 and box.proc is None  # the hung worker was killed
        assert box.run("calculate", {"expression": "2 * 21"}) == ('{"result": 42}', False)  # a new one answers
    finally:
        box.close()


@pytest.mark.parametrize("name", ["builtin", "minimind2", "minimind3"])
def test_tool_turns_are_what_the_chat_template_renders_between_the_replies(name):
    from minimind_ray.tokenizer import load_tokenizer, resolve_tokenizer

    tok = resolve_tokenizer("builtin", "data_cache") if name == "builtin" else load_tokenizer(
        str(minimind_tokenizer_dir(name)))
    tools = [CALCULATOR_SCHEMA]
    history = [{"role": "system", "content": "You are MiniMind.", "tools": tools},
               {"role": "user", "content": "What is 3 plus 4?"}]
    prompt = tok.apply_chat_template(history, add_generation_prompt=True, tools=tools)
    contents = ['{"result": 7}']
    whole = tok.apply_chat_template(history + [{"role": "assistant", "content": CALL}, {"role": "tool",
                                    "content": contents[0]}], add_generation_prompt=True, tools=tools)
    # the policy's tokens (its reply and its EOS), then the tool turn: the conversation as the template has it
    assert prompt + CALL + tok.eos_token + tool_turn_text(tok, history, CALL, contents, tools, True) == whole
    assert prompt + CALL + tool_turn_text(tok, history, CALL, contents, tools, False) == whole  # cut before its EOS


def traj(*turns, gt=("7",), unfinished=False, tools=(CALCULATOR_SCHEMA,)):
    return Trajectory("prompt", [], list(tools), list(gt), list(turns), unfinished=unfinished)


def test_agent_rewards_add_up_to_minimind_by_hand():
    from minimind_ray.stages.agent import AgentConfig

    terms = build_agent_rewards(AgentConfig().rewards)
    cases = [  # (trajectory, each term: tags, calls, format, gt, unfinished, repetition)
        # a valid call and the right answer: +0.5 (one valid call for one gt value) + 2.5 (the gt value found)
        (traj(CALL, "3 plus 4 equals 7."), [0, 0.5, 0, 2.5, 0, 0]),
        # no call: the reply's length (5..800 characters: +0.5), no gt credit without a call (MiniMind's rule)
        (traj("3 plus 4 equals 7."), [0, 0, 0.5, 0, 0, 0]),
        (traj("7"), [0, 0, -0.5, 0, 0, 0]),  # too short
        # two calls for one gt value: a gap of 1 -> -0.5; the answer after the last </tool_call> holds 7
        (traj(CALL + CALL + " so 7"), [0, -0.5, 0, 2.5, 0, 0]),
        # an unclosed tag: -0.5, and no call is parsed (format terms instead)
        (traj('<tool_call>{"name": "calculate"} so the answer is 7'), [-0.5, 0, 0.5, 0, 0, 0]),
        # a call without its required argument: 0 valid of 1 call -> gap |0 - 1| + 1 = 2 -> -1.0
        (traj('<tool_call>{"name": "calculate", "arguments": {}}</tool_call>', "it is 7"), [0, -1.0, 0, 2.5, 0, 0]),
        # still calling after the last turn: unfinished, no final answer to find 7 in, 3 valid calls for 1 value;
        # the repetition is then the last turn's (MiniMind): of the call's 30 word 3-grams '" : "' comes twice ->
        # 1 repeat x 2 x 0.5 / 30
        (traj(CALL, CALL, CALL, unfinished=True), [0, -1.0, 0, 0, -0.5, -1 / 30]),
        # a wrong answer after a valid call
        (traj(CALL, "3 plus 4 equals 8."), [0, 0.5, 0, 0, 0, 0]),
        # thinking before the reply (no call): +0.5 length, +1.0 for 20..300 characters of thinking, +0.25 once
        (traj("<think>adding three and four gives seven</think>It is 7."), [0, 0, 1.75, 0, 0, 0]),
    ]
    totals, per_term = score_trajectories(terms, [t for t, _ in cases], clip=3.0)
    for i, (t, want) in enumerate(cases):
        got = [per_term[k][i] for k in ("tool_tags", "tool_calls", "reply_format", "gt_answer", "unfinished",
                                        "repetition")]
        assert got == pytest.approx(want), (i, t.turns, got)
        assert totals[i] == pytest.approx(max(-3.0, min(3.0, sum(want)))), i
    repeated = traj(CALL, "seven seven seven seven seven seven seven seven")
    assert score_trajectories(terms, [repeated], None)[1]["repetition"][0] == pytest.approx(-0.5)  # all 3-grams repeat
    doubled = build_agent_rewards([RewardConfig("gt_answer", weight=2.0), RewardConfig("tool_calls")])
    assert score_trajectories(doubled, [cases[0][0]], 3.0)[0] == [3.0]  # 5.5 clipped to MiniMind's 3
    assert score_trajectories(doubled, [cases[0][0]], None)[0] == [5.5]
    # MiniMind finds a gt value's text anywhere ("17" holds "7"); 'exact' wants the answer's last number
    assert gt_found("it is 17", ["7"]) == [True] and gt_found("it is 17", ["7"], "exact") == [False]
    assert gt_found("1,234 and 5", ["1234", "5"]) == [True, True] and gt_found("x", ["7"]) == [False]


def _records(tools=True):
    system = {"role": "system", "content": "You are MiniMind.", **({"tools": [CALCULATOR_SCHEMA]} if tools else {})}
    return [{"conversations": [system, {"role": "user", "content": f"What is {a} plus {b}?"},
                               {"role": "assistant", "content": f"{a + b}"}], "gt": [a + b]}
            for a, b in ((3, 4), (5, 2), (6, 1), (0, 7), (7, 0), (1, 6))]  # all 7: the scripted reply is right


def test_agent_rl_records_are_checked_and_counted(tmp_path):
    from minimind_ray.data.formats import BadRecord, check_record
    from minimind_ray.tokenizer import load_tokenizer
    from tests.unit.test_grpo import prepare_locally

    tok = load_tokenizer(str(minimind_tokenizer_dir("minimind2")))
    good = _records()
    bad = [{"conversations": good[0]["conversations"]},  # no gt
           {**good[0], "gt": [{"value": 7}]},  # a gt value that is no string or number
           {**good[0], "conversations": good[0]["conversations"][:2]},  # ends with the user's turn
           {"conversations": [{**good[0]["conversations"][0], "tools": "not json"}, *good[0]["conversations"][1:]],
            "gt": 7},
           {"conversations": [{**good[0]["conversations"][0], "tools": [{"description": "no name"}]},
                              *good[0]["conversations"][1:]], "gt": "7"}]
    _, merged = prepare_locally(good + bad, tmp_path, tok, fmt="agent_rl", max_seq_len=320)
    assert merged["counts"]["records"] == len(good)
    assert {k: v["count"] for k, v in merged["skipped"].items()} == {"missing_field": 1, "wrong_type": 4}
    with pytest.raises(BadRecord, match="gt"):
        check_record("agent_rl", bad[0])


class Scripted(torch.nn.Module):
    """The tiny model with a bias towards a script: turn k of a trajectory leans to ``replies[k]`` and its EOS
    (``bias`` 1e4: always; 12: usually, so that sampling still decides)."""

    def __init__(self, inner, tok, replies, bias):
        super().__init__()
        self.inner, self.cfg, self.bias = inner, inner.cfg, bias
        self.start = tok.encode("<|im_start|>assistant\n")
        self.replies = [tok.encode(r) + [tok.eos_id] for r in replies]
        self.rows = None

    def _next(self, row):
        k = len(self.start)
        starts = [i for i in range(len(row) - k + 1) if row[i:i + k] == self.start]
        reply = self.replies[min(len(starts) - 1, len(self.replies) - 1)]
        return reply[min(len(row) - starts[-1] - k, len(reply) - 1)]

    def forward(self, ids, kv_cache=None, input_lengths=None, slots=None, **kw):
        out = self.inner(ids, kv_cache=kv_cache, input_lengths=input_lengths, slots=slots, **kw)
        if input_lengths is not None:  # the prefill: right-padded prompts into cache rows `slots`
            prompts = [r[:n].tolist() for r, n in zip(ids, input_lengths)]
            self.by_slot = dict(zip(range(len(ids)) if slots is None else slots, prompts))
            self._follow_forks(kv_cache)
            rows = prompts
        else:  # one token per cache row 0..B-1; a prompt the batch repeats was prefilled once, then forked
            if self.rows is None:
                self.rows = [self.by_slot[s] for s in range(len(ids))]
            self.rows = rows = [r + [int(t)] for r, t in zip(self.rows, ids[:, -1])]
        for i, row in enumerate(rows):
            out.logits[i, -1, self._next(row)] += self.bias
        return out

    def _follow_forks(self, cache):
        """A forked cache row holds the prompt of the row it was copied from."""
        self.rows, fork = None, cache.fork

        def forked(src, dsts):
            self.by_slot.update({d: self.by_slot[src] for d in dsts})
            fork(src, dsts)

        cache.fork = forked


def scripted_engine(state, tok, replies, bias):
    class ScriptedRollout(TorchRollout):
        def update_policy(self, model, step):
            self.model = Scripted(model, tok, replies, bias)

    plan = state.objective
    plan.start(state)
    plan.engine = ScriptedRollout(state.autocast)


@pytest.fixture(scope="module")
def agent_prepared(tmp_path_factory):
    from minimind_ray.model.minimind import build_model
    from minimind_ray.store.pth import save_pth
    from minimind_ray.tokenizer import load_tokenizer
    from tests.unit.test_grpo import prepare_locally

    tok = load_tokenizer(str(minimind_tokenizer_dir("minimind2")))
    d = tmp_path_factory.mktemp("agent")
    path, _ = prepare_locally(_records(), d, tok, fmt="agent_rl", max_seq_len=320)
    save_pth(build_model(load_config(None, ["data.train_path=[demo]", "model.preset=tiny"]).model, seed=5),
             str(d / "base.pth"), dtype=torch.float32)
    return path, str(d / "base.pth"), tok


def agent_config(init_from, *extra):
    return load_config(None, [
        "data.train_path=[demo]", "model.preset=tiny", "train.stage=agent", "data.format=agent_rl",
        "data.max_seq_len=320", f"train.init_from={init_from}", "train.global_batch_size=2", "train.micro_batch_size=1",
        "train.max_steps=4", "train.lr=3e-3", "train.warmup_steps=1", "train.log_interval=1", "checkpoint.interval=2",
        "train.agent.num_generations=2", "train.agent.max_gen_len=48", "train.agent.temperature=1.0",
        "train.agent.loss_type=grpo", "train.agent.max_total_len=420", "cluster.num_workers=1", *extra])


def test_agent_config_is_checked():
    for extra, field in ((["train.agent.max_total_len=100"], "train.agent.max_total_len"),
                         (["train.agent.tools=[{name: weather}]"], r"train.agent.tools\[0\].function"),
                         (["train.agent.rewards=[{name: length}]"], r"train.agent.rewards\[0\].name"),
                         (["train.grpo.rewards=[{name: exact_answer}]"],
                          r"^train\.grpo\.rewards: .*did you mean train\.agent\.rewards\?$")):
        with pytest.raises(ConfigError, match=field):
            load_config(None, ["data.train_path=[demo]", "model.preset=tiny", "train.stage=agent",
                               "data.format=agent_rl", "data.max_seq_len=320", "train.init_from=.", *extra])


def test_the_grpo_keys_the_agent_read_before_its_section_are_read_into_it_with_a_notice(capsys):
    """Before issue 56 the agent's group, sampling and loss were train.grpo's: those keys still work, each moved into
    train.agent with one notice, and the run keeps the identity (its default name) it had."""
    from minimind_ray.config import run_identity

    base = ["data.train_path=[demo]", "model.preset=tiny", "train.stage=agent", "data.format=agent_rl",
            "data.max_seq_len=320", "train.init_from=.", "train.agent.max_total_len=420"]
    old = load_config(None, base + ["train.grpo.num_generations=2", "train.grpo.beta=0.0"])
    assert [line for line in capsys.readouterr().err.splitlines() if "notice" in line] == [
        "[minimind-ray] notice: train.grpo.num_generations is now train.agent.num_generations for the agent stage "
        "(read as train.agent.num_generations=2)",
        "[minimind-ray] notice: train.grpo.beta is now train.agent.beta for the agent stage (read as "
        "train.agent.beta=0.0)"]
    new = load_config(None, base + ["train.agent.num_generations=2", "train.agent.beta=0.0"])
    assert (old.train.agent.num_generations, old.train.agent.beta) == (2, 0.0)
    assert old.train.grpo == type(old.train.grpo)() and run_identity(old) == run_identity(new)
    with pytest.raises(ConfigError, match=r"^train\.agent\.beta: 0\.5, but the old train\.grpo\.beta says 0\.0"):
        load_config(None, base + ["train.grpo.beta=0.0", "train.agent.beta=0.5"])


def test_a_rollout_runs_the_tool_and_only_the_policys_tokens_carry_loss(agent_prepared):
    from minimind_ray.engine.state import TrainState

    prepared, base, tok = agent_prepared
    state = TrainState.build(agent_config(base, "train.global_batch_size=1", "train.agent.max_gen_len=64"), prepared)
    scripted_engine(state, tok, [CALL, "So the answer is 7."], bias=1e4)
    batches = state.objective.prepare(state, state.stream.next_step(), 1)
    state.stream.close()
    b = batches[0]
    prompt_len = int(b["input_ids"].shape[1] - b["completion_mask"].shape[1])
    for row, mask, attn, reward in zip(b["input_ids"], b["completion_mask"], b["attention_mask"], b["rewards"]):
        resp, mask, attn = row[prompt_len:], mask.bool(), attn[prompt_len:].bool()
        own = tok.decode(resp[mask].tolist())
        assert own == CALL + tok.eos_token + "So the answer is 7." + tok.eos_token  # two replies, each with its EOS
        tool_turn = tok.decode(resp[attn & ~mask].tolist())  # what the policy read, not wrote
        assert tool_turn.startswith("\n<|im_start|>user\n<tool_response>\n{\"result\": 7}\n</tool_response>")
        assert float(reward) == pytest.approx(3.0)  # a valid call (+0.5) and the gt value in the answer (+2.5)
    assert float(b["metric_tool_calls"]) == 2.0 and float(b["metric_answer_correct"]) == 2.0  # 2 trajectories
    assert float(b["metric_turns"]) == 4.0 and float(b["metric_tool_errors"]) == 0.0


def test_agent_stage_saves_and_restores_bit_for_bit(agent_prepared, tmp_path):
    """Trajectories sample from per-row seeds (turn by turn), tools are deterministic: a run stopped after step 2 and
    restored takes the same steps, with the same rewards and tool calls, as one that never stopped."""
    from minimind_ray.engine.loop import Hooks, run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.store.checkpoint import open_checkpoint

    prepared, base, tok = agent_prepared
    cfg = agent_config(base, "train.max_steps=3")
    replies = [CALL, "3 plus 4 equals 7."]

    class Rec(Hooks):
        def __init__(self):
            self.by_step = {}

        def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
            self.by_step[step] = {k: metrics[k] for k in ("reward", "tool_calls", "called_tool", "loss")}

    straight, seen = TrainState.build(cfg, prepared), Rec()
    scripted_engine(straight, tok, replies, bias=12.0)
    run(straight, seen)
    assert any(0 < m["called_tool"] < 1 for m in seen.by_step.values())  # sampling decides, some trajectories call

    class StopAt2(Rec):
        def on_checkpoint(self, step, metrics):
            if step == 2:
                first.save(tmp_path / "ck", mlflow_run_id=None, prepared_dir=prepared)
                raise KeyboardInterrupt

    first, before = TrainState.build(cfg, prepared), StopAt2()
    scripted_engine(first, tok, replies, bias=12.0)
    with pytest.raises(KeyboardInterrupt):
        run(first, before)
    first.stream.close()
    resumed, after = TrainState.build(cfg, prepared), Rec()
    resumed.restore(open_checkpoint(tmp_path / "ck"))
    scripted_engine(resumed, tok, replies, bias=12.0)
    run(resumed, after)
    assert {**before.by_step, **after.by_step} == seen.by_step
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(math.isfinite(m["loss"]) for m in seen.by_step.values())


def test_the_demo_tool_chats_and_agent_prompts_fit_their_recipes_and_hold_out_the_eval_sums():
    """The calculator demo's files against its recipes: every tool SFT chat fits demo_tool_sft.yaml's max_seq_len
    whole (a cut chat trains no final answer: seen once, when 4-digit sums made the chats 647 tokens for a limit of
    640), every agent prompt fits demo_agent.yaml's and leaves room for a call, its result and an answer, and no
    evaluated sum is in a training file."""
    from omegaconf import OmegaConf

    from minimind_ray.data.demo import resolve_demo_path
    from minimind_ray.tokenizer import resolve_tokenizer

    tok = resolve_tokenizer("builtin", "data_cache")
    read = lambda name: [json.loads(x) for x in open(resolve_demo_path(f"demo:{name}", "", "data_cache"))]  # noqa: E731
    recipe = lambda name: OmegaConf.load(f"pipelines/configs/{name}.yaml")  # noqa: E731
    chats = [r["conversations"] for r in read("tool_sft")]
    longest_chat = max(len(tok.encode(tok.apply_chat_template(c, tools=c[0]["tools"]))) for c in chats)
    assert longest_chat <= recipe("demo_tool_sft").data.max_seq_len
    tasks = [r["conversations"][:2] for r in read("agent_rl")]
    longest_prompt = max(len(tok.encode(tok.apply_chat_template(c, add_generation_prompt=True, tools=c[0]["tools"])))
                         for c in tasks)
    agent = recipe("demo_agent")
    assert longest_prompt <= agent.data.max_seq_len
    assert longest_chat <= agent.train.agent.max_total_len  # a trajectory has room for the chat the tool SFT taught
    evaluated = {r["messages"][-1]["content"] for r in read("toolcall_eval") if r["tool"]}
    trained = {c[1]["content"] for c in chats} | {c[1]["content"] for c in tasks}
    assert len(evaluated) == 200 and not evaluated & trained
