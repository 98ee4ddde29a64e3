"""The RL prompt formats' pieces that need nothing of data/formats.py (which calls them): the prompts' collate, and
the ``agent_rl`` record format: MiniMind's ``agent_rl.jsonl`` (``dataset/lm_dataset.py:AgentRLDataset``, d65ef2c).

    {"conversations": [{"role": "system", "content": ..., "tools": [...]}, {"role": "user", ...}, ...,
                       {"role": "assistant", "content": ...}],
     "gt": ["42"]}

As MiniMind reads it: the prompt is every turn but the last (the assistant's, a reference the rollouts do not
use), the tools are the system message's ``tools`` (a list of OpenAI function schemas, or that list as a JSON
string), and ``gt`` lists the values a right final answer holds (strings or numbers; one value may stand alone).
The conversation is checked as an ``rlaif`` record's; this module adds the checks of ``gt`` and ``tools`` and what
the prepared row keeps beside the prompt's tokens.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

import numpy as np


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


def agent_context(rec: dict) -> str:
    """What a rollout needs besides the prompt's tokens, as JSON: the prompt's messages (to render each tool
    response through the chat template) and the tools offered (to check the calls against)."""
    return json.dumps({"messages": rec["conversations"][:-1], "tools": record_tools(rec) or []}, ensure_ascii=False)


def collate_prompts(rows: Dict[str, List[np.ndarray]], sample_ids: np.ndarray, pad_id: int) -> dict:
    """rlaif/prompt/agent_rl rows -> ``prompt_ids`` (B, P) left-padded with ``pad_id``, ``prompt_mask`` (B, P)
    (1 = a prompt token), ``sample_ids``, and each ``<x>_utf8`` column (the answer; agent_rl's context) as
    zero-padded bytes (B, A) with ``<x>_len`` (B,)."""
    import torch

    prompts = rows["prompt_ids"]
    B, P = len(prompts), max(len(p) for p in prompts)
    ids, mask = np.full((B, P), pad_id, np.int64), np.zeros((B, P), np.int64)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = p, 1
    out = {"prompt_ids": torch.from_numpy(ids), "prompt_mask": torch.from_numpy(mask),
           "sample_ids": torch.from_numpy(np.asarray(sample_ids, dtype=np.int64))}
    for col in [c for c in rows if c.endswith("_utf8")]:
        utf8 = np.zeros((B, max(1, max(len(a) for a in rows[col]))), np.uint8)
        for i, a in enumerate(rows[col]):
            utf8[i, :len(a)] = a
        out[col] = torch.from_numpy(utf8)
        out[col[:-len("_utf8")] + "_len"] = torch.tensor([len(a) for a in rows[col]], dtype=torch.int64)
    return out
