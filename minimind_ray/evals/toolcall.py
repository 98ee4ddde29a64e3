"""``toolcall``: tool-use prompts (docs/evaluation.md, "Tool calls"): a jsonl of ``{"prompt" or "messages",
"tools": [OpenAI function schemas], "tool": name or null, "arguments"}``. The conversation and its tools go through
the chat template (the tools into the system turn, as in training); the greedy reply's first ``<tool_call>`` is
parsed as the agent stage parses it (rl/tools.py) and judged: the tool named, its arguments against the tool's
schema and, when given, against ``arguments``; ``tool: null`` expects no call. MiniMind's scripts/eval_toolcall.py
shows its cases; this scores them.
"""
from __future__ import annotations

import json
import math
from typing import Dict, List

from minimind_ray.config_checks import need
from minimind_ray.data.formats import BadRecord
from minimind_ray.data.manifest import DataError
from minimind_ray.evals.config import task_name
from minimind_ray.evals.kinds import GenerationTask, fmt, mean_stderr, pass_at_k
from minimind_ray.evals.tasks import BadRows, ToolCallItem, check_text, jsonl_records
from minimind_ray.rl.tools import check_arguments, parse_tool_calls, tool_schemas


def toolcall_record(rec: dict) -> dict:
    prompt, messages, tools = rec.get("prompt"), rec.get("messages"), rec.get("tools")
    if prompt is None and messages is None:
        raise BadRecord("missing_field", "field 'prompt' (or 'messages') missing")
    if messages is None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadRecord("wrong_type", "'prompt' must be a non-empty text")
        messages = [{"role": "user", "content": prompt}]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise BadRecord("wrong_type", "'messages' must be a list of {role, content} texts")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise BadRecord("wrong_type", "'tools' is a string that is not JSON") from None
    if not isinstance(tools, list) or not tools or len(tool_schemas(tools)) != len(tools):
        raise BadRecord("wrong_type" if tools is not None else "missing_field",
                        "'tools' must be a list of function schemas, each with a name")
    tool, args = rec.get("tool"), rec.get("arguments")
    if tool is not None and (not isinstance(tool, str) or tool not in tool_schemas(tools)):
        raise BadRecord("bad_answer", f"field 'tool' is {tool!r}, not one of the tools offered {sorted(tool_schemas(tools))}")
    if args is not None and not isinstance(args, dict):
        raise BadRecord("wrong_type", f"'arguments' is {type(args).__name__}, expected an object")
    check_text({f"messages[{i}]": m["content"] for i, m in enumerate(messages)})
    return {**rec, "messages": messages, "tools": tools, "tool": tool, "arguments": args}


def _same_value(got, want) -> bool:
    """An argument as expected: numbers equal, texts equal but for case and spacing ("3+4" is "3 + 4")."""
    if isinstance(want, str) and isinstance(got, str):
        return "".join(got.split()).casefold() == "".join(want.split()).casefold()
    if isinstance(want, (int, float)) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    return got == want


def judge_tool_call(item: ToolCallItem, reply: str) -> dict:
    """What the reply's first call gets right: ``called``, ``name`` (the expected tool, or no call when none is
    expected), ``valid`` (its arguments suit the tool's schema, rl/tools.py:check_arguments), ``match`` (they equal
    the expected arguments, when given), and ``exact``: all of these."""
    calls, bad = parse_tool_calls(reply)
    first = calls[0] if calls else None
    if item.tool is None:
        return {"called": bool(calls), "bad_blocks": bad, "name": not calls and not bad, "exact": not calls and not bad}
    name = first is not None and first["name"] == item.tool
    why = check_arguments(tool_schemas(item.tools)[item.tool], first["arguments"]) if name else "wrong or no tool"
    match = (name and isinstance(first["arguments"], dict) and set(first["arguments"]) == set(item.arguments)
             and all(_same_value(first["arguments"][k], v) for k, v in item.arguments.items())
             ) if item.arguments is not None else None
    return {"called": bool(calls), "bad_blocks": bad, "name": name, "valid": why is None, "invalid_reason": why,
            "match": match, "exact": name and why is None and match is not False}


def aggregate_toolcall(items: List[ToolCallItem], greedy: List[str], sampled: List[List[str]], task) -> dict:
    """acc: the greedy reply right in every respect (judge_tool_call's ``exact``); name_acc, args_valid (over the
    prompts that expect a call), args_match (over those with expected arguments), call_rate; pass@1 / pass@k of
    ``exact`` over the samples."""
    judged = [judge_tool_call(it, g) for it, g in zip(items, greedy)]
    sample_exact = [[bool(judge_tool_call(it, x)["exact"]) for x in s] for it, s in zip(items, sampled)]
    k = task.k or task.samples

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    def scores(rows):
        want = [i for i in rows if items[i].tool is not None]
        out = {"acc": mean([float(judged[i]["exact"]) for i in rows]), "n": len(rows),
               "name_acc": mean([float(judged[i]["name"]) for i in rows]),
               "args_valid": mean([float(judged[i]["valid"]) for i in want]),
               "args_match": mean([float(judged[i]["match"]) for i in want if items[i].arguments is not None]),
               "call_rate": mean([float(judged[i]["called"]) for i in rows])}
        if task.samples:
            hits = [sum(sample_exact[i]) for i in rows]
            out.update({"pass@1": mean([c / task.samples for c in hits]),
                        "pass@k": mean([pass_at_k(task.samples, c, k) for c in hits])})
        return out

    by_subject: Dict[str, List[int]] = {}
    for i, it in enumerate(items):
        by_subject.setdefault(it.subject, []).append(i)
    out = {**scores(range(len(items))), "acc_stderr": mean_stderr([float(j["exact"]) for j in judged]),
           "subjects": {s: scores(rows) for s, rows in sorted(by_subject.items())},
           "details": [{"where": it.where, "subject": it.subject, "tool": it.tool, "reply": g, **j, "samples": s,
                        "sample_verdicts": v} for it, g, j, s, v in zip(items, greedy, judged, sampled, sample_exact)]}
    if task.samples:
        out.update({"k": k, "samples": task.samples})
    return out


METRICS = ("acc", "name_acc", "args_valid", "args_match", "call_rate")


class ToolCall(GenerationTask):
    """Tool-use prompts through the chat template: the tool the greedy reply calls and its arguments judged."""

    @classmethod
    def check(cls, cfg, where=""):
        super().check(cfg, where)
        need(cfg.shots == 0, f"{where}shots", "toolcall prompts are conversations with their tools: no shots")

    def load_items(self, tokenizer):
        import os

        cfg = self.cfg
        if not os.path.isfile(cfg.data):
            raise DataError(f"{cfg.data}: no such file (task {cfg.task} reads a jsonl file)")
        bad = BadRows(cfg.bad_records)
        records = jsonl_records(cfg.data, bad, toolcall_record)
        # always the chat template: the tools are rendered into the system turn
        return [ToolCallItem(rec.get("subject", task_name(cfg)), tokenizer.apply_chat_template(
            rec["messages"], add_generation_prompt=True, tools=rec["tools"]), rec["tools"], rec["tool"],
            rec["arguments"], where) for rec, where in (records[:cfg.limit] if cfg.limit else records)], bad

    def judge(self, items, greedy, sampled):
        return aggregate_toolcall(items, greedy, sampled, self.cfg)

    def metrics(self, summary):
        return {k: float(summary[k]) for k in METRICS if summary.get(k) is not None}

    def samples(self, items, summary):
        return [{"prompt": it.context, "expected_tool": it.tool, "expected_arguments": it.arguments, **d}
                for it, d in zip(items, summary["details"])]

    def table(self, res):
        rows = [(s, r) for s, r in res["subjects"].items()] if len(res["subjects"]) > 1 else []
        rows.append((f"all ({res['task']})", res))
        lines = [f"{'subject':<28} {'n':>6} " + " ".join(f"{c:>10}" for c in METRICS)]
        lines += [f"{name:<28} {r['n']:>6} " + " ".join(f"{fmt(r.get(c)):>10}" for c in METRICS) for name, r in rows]
        if res.get("pass@1") is not None:
            lines.append(f"sampled: pass@1 {fmt(res['pass@1'])}  pass@{res['k']} {fmt(res['pass@k'])}")
        return "\n".join(lines)
