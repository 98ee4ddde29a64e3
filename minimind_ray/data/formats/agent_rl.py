"""``agent_rl``: MiniMind's ``agent_rl.jsonl`` (``dataset/lm_dataset.py:AgentRLDataset``, d65ef2c), the agent stage's
prompts.

    {"conversations": [{"role": "system", "content": ..., "tools": [...]}, {"role": "user", ...}, ...,
                       {"role": "assistant", "content": ...}],
     "gt": ["42"]}

As MiniMind reads it: the prompt is every turn but the last (the assistant's, a reference the rollouts do not
use), the tools are the system message's ``tools`` (a list of OpenAI function schemas, or that list as a JSON
string), and ``gt`` lists the values a right final answer holds (strings or numbers; one value may stand alone).
The conversation is checked as an ``rlaif`` record's (data/formats/rlaif.py); this module adds the checks of ``gt``
and ``tools``, and what the prepared row keeps beside the prompt's tokens: ``answer_utf8`` the ``gt`` values as a
JSON list, ``context_utf8`` the prompt's messages and the tools offered.
"""
from __future__ import annotations

import json
from typing import List, Optional, Tuple

from minimind_ray.data.formats.base import BadRecord
from minimind_ray.data.formats.rlaif import RLAIF


def record_tools(rec: dict):
    """The tools of the record's first (system) message, parsed; None without any."""
    conv = rec.get("conversations") or []
    tools = conv[0].get("tools") or conv[0].get("functions") if conv and isinstance(conv[0], dict) else None
    return json.loads(tools) if isinstance(tools, str) else tools


def agent_problem(rec: dict) -> Optional[Tuple[str, str]]:
    """(reason, detail) of what is wrong with an agent_rl record beyond its conversation, or None."""
    if "gt" not in rec or rec["gt"] is None:
        return "missing_field", "field 'gt' missing"
    gt = rec["gt"] if isinstance(rec["gt"], list) else [rec["gt"]]
    for i, g in enumerate(gt):
        if isinstance(g, bool) or not isinstance(g, (str, int, float)):
            return "wrong_type", f"'gt[{i}]' is {type(g).__name__}, expected a string or number"
    try:
        tools = record_tools(rec)
    except ValueError:
        return "wrong_type", "the system message's 'tools' is a string that is not JSON"
    named = lambda t: isinstance(t, dict) and isinstance(t.get("function", t), dict) and isinstance(  # noqa: E731
        t.get("function", t).get("name"), str)
    if tools is not None and not (isinstance(tools, list) and all(named(t) for t in tools)):
        return "wrong_type", "the system message's 'tools' is not a list of function schemas with a 'name'"
    return None


def gt_values(rec: dict) -> List[str]:
    gt = rec["gt"] if isinstance(rec["gt"], list) else [rec["gt"]]
    return [str(g) for g in gt]


class AgentRL(RLAIF):
    name = "agent_rl"
    record = "{conversations with tools, gt} (MiniMind's agent_rl.jsonl)"
    columns = ("prompt_ids", "answer_utf8", "context_utf8")
    byte_columns = ("answer_utf8", "context_utf8")

    def check(self, rec: dict) -> int:
        chars = super().check(rec)
        problem = agent_problem(rec)
        if problem:
            raise BadRecord(*problem)
        return chars + len(str(rec["gt"]))

    def answer(self, rec: dict) -> str:
        return json.dumps(gt_values(rec), ensure_ascii=False)

    def context(self, rec: dict) -> str:
        """What a rollout needs besides the prompt's tokens, as JSON: the prompt's messages (to render each tool
        response through the chat template) and the tools offered (to check the calls against)."""
        return json.dumps({"messages": rec["conversations"][:-1], "tools": record_tools(rec) or []},
                          ensure_ascii=False)


FORMAT = AgentRL()
