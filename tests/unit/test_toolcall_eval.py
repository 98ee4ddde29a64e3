"""``eval --task toolcall`` (issue 24, part 6; docs/evaluation.md): tool-use prompts read with the bad-record policy,
each reply judged by hand (the tool named, its arguments valid and as expected), the aggregates, and the task end to
end on a model that calls the calculator."""
from __future__ import annotations

import json

import pytest

from minimind_ray.data.manifest import DataError
from minimind_ray.evals.config import EvalTaskConfig
from minimind_ray.evals.run import aggregate_toolcall, judge_tool_call
from minimind_ray.evals.tasks import ToolCallItem, load_items
from minimind_ray.rl.tools import CALCULATOR_SCHEMA
from tests.conftest import minimind_tokenizer_dir

TOOLS = [CALCULATOR_SCHEMA]
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def call(name="calculate", **args):
    return CALL.format(name=name, args=json.dumps(args))


def item(tool="calculate", arguments=None, subject="s"):
    return ToolCallItem(subject, "ctx", TOOLS, tool, arguments, "f:1")


@pytest.fixture(scope="module")
def tok():
    from minimind_ray.tokenizer import load_tokenizer

    return load_tokenizer(str(minimind_tokenizer_dir("minimind2")))


def test_tool_use_prompts_are_read_and_bad_rows_counted(tmp_path, tok):
    rows = [{"prompt": "What is 3 plus 4?", "tools": TOOLS, "tool": "calculate", "arguments": {"expression": "3 + 4"}},
            {"messages": [{"role": "user", "content": "Hi"}], "tools": json.dumps(TOOLS), "tool": None,
             "subject": "chat"},
            {"tools": TOOLS, "tool": "calculate"},  # no prompt
            {"prompt": "x", "tools": [{"description": "nameless"}], "tool": None},  # tools without a name
            {"prompt": "x", "tools": TOOLS, "tool": "weather"},  # a tool that is not offered
            {"prompt": "x", "tools": TOOLS, "tool": "calculate", "arguments": "3 + 4"}]  # arguments not an object
    path = tmp_path / "tc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\nnot json\n")
    items, bad = load_items(EvalTaskConfig(task="toolcall", data=str(path)), tok)
    assert [(it.subject, it.tool) for it in items] == [("tc", "calculate"), ("chat", None)]
    assert items[0].context == tok.apply_chat_template([{"role": "user", "content": "What is 3 plus 4?"}],
                                                       add_generation_prompt=True, tools=TOOLS)
    assert '"name": "calculate"' in items[1].context  # a JSON-string tools list is parsed and rendered
    assert bad.report() == {"bad_answer": 1, "bad_json": 1, "missing_field": 1, "wrong_type": 2}
    assert bad.samples["bad_answer"][0].startswith(f"{path}:5:")
    with pytest.raises(DataError, match=rf"{path}:3: .*'prompt'"):
        load_items(EvalTaskConfig(task="toolcall", data=str(path), bad_records="strict"), tok)


def test_each_reply_is_judged_by_hand():
    expr = {"expression": "3 + 4"}
    cases = [  # (item, reply, name, valid, match, exact)
        (item(arguments=expr), call(expression="3 + 4"), True, True, True, True),
        (item(arguments=expr), call(expression="3+4") + " then more", True, True, True, True),  # spacing aside
        (item(arguments=expr), call(expression="3 + 5"), True, True, False, False),  # valid, not as expected
        (item(arguments=expr), call(), True, False, False, False),  # the required expression is missing
        (item(arguments=expr), call(expression=""), True, False, False, False),  # ... or empty
        (item(arguments=expr), call("calculator", expression="3 + 4"), False, False, False, False),
        (item(), call(expression="12 * 3"), True, True, None, True),  # no expected arguments: any valid ones
        (item(arguments=expr), "It is 7.", False, False, False, False),  # no call
        (item(arguments=expr), "<tool_call>{broken</tool_call>", False, False, False, False),
    ]
    for it, reply, name, valid, match, exact in cases:
        j = judge_tool_call(it, reply)
        assert (j["name"], j["valid"], j["match"], j["exact"]) == (name, valid, match, exact), reply
    assert judge_tool_call(item(None), "Paris.")["exact"] and not judge_tool_call(item(None), call())["exact"]
    assert not judge_tool_call(item(None), "<tool_call>{broken</tool_call>")["exact"]  # a broken call is a call too


def test_aggregates_by_hand():
    expr = {"expression": "3 + 4"}
    items = [item(arguments=expr, subject="math"), item(arguments=expr, subject="math"),
             item(arguments=expr, subject="math"), item(None, subject="none"), item(None, subject="none")]
    replies = [call(expression="3 + 4"), call(expression="3 + 5"), "7", "Paris.", call(expression="1")]
    res = aggregate_toolcall(items, replies, [[] for _ in items], EvalTaskConfig(task="toolcall", data="x"))
    # exact: 1 (math) + 1 (none) of 5; name: 2 (math) + 1 (none); valid: 2 of the 3 that expect a call; match: 1 of 3;
    # calls: 2 (math) + 1 (none) of 5
    assert (res["acc"], res["name_acc"], res["args_valid"], res["args_match"], res["call_rate"]) == pytest.approx(
        (2 / 5, 3 / 5, 2 / 3, 1 / 3, 3 / 5))
    assert res["subjects"]["math"]["acc"] == pytest.approx(1 / 3) and res["subjects"]["none"]["acc"] == 0.5
    assert res["subjects"]["none"]["args_valid"] is None and res["n"] == 5
    sampled = aggregate_toolcall(items[:1], replies[:1], [[replies[0], "no", replies[1], replies[0]]],
                                 EvalTaskConfig(task="toolcall", data="x", samples=4, k=2))
    assert sampled["pass@1"] == 0.5 and sampled["pass@k"] == pytest.approx(1 - 1 / 6)  # 2 of 4 right; C(2,2)/C(4,2)


def test_the_task_end_to_end_on_a_model_that_calls_the_calculator(tmp_path, tok, capsys):
    """Through evaluate_task and the verb's table: a model scripted to call calculate("3 + 4") is right on the
    prompt that asks for it, valid but not as expected on another, and wrong where no tool is wanted."""
    from minimind_ray.config import load_config
    from minimind_ray.evals.run import evaluate_task
    from minimind_ray.evals.eval_verb import format_table
    from minimind_ray.model.minimind import build_model
    from tests.unit.test_agent import CALL as SCRIPT, Scripted

    rows = [{"prompt": "What is 3 plus 4?", "tools": TOOLS, "tool": "calculate", "arguments": {"expression": "3 + 4"},
             "subject": "arithmetic"},
            {"prompt": "What is 5 plus 6?", "tools": TOOLS, "tool": "calculate", "arguments": {"expression": "5 + 6"},
             "subject": "arithmetic"},
            {"prompt": "What is the capital of France?", "tools": TOOLS, "tool": None, "subject": "no tool"}]
    path = tmp_path / "tc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = Scripted(build_model(load_config(None, ["data.train_path=[demo]", "model.preset=tiny"]).model, seed=1),
                     tok, [SCRIPT], bias=1e4).eval()
    res = evaluate_task("unused", EvalTaskConfig(task="toolcall", data=str(path), max_new_tokens=64, batch_size=2),
                        model=model, tok=tok, device="cpu")
    assert res["subjects"]["arithmetic"]["acc"] == 0.5 and res["subjects"]["arithmetic"]["args_valid"] == 1.0
    assert res["subjects"]["no tool"]["acc"] == 0.0 and res["call_rate"] == 1.0
    assert res["details"][0]["reply"] == SCRIPT
    table = format_table(res)
    assert "args_valid" in table and "all (tc)" in table
