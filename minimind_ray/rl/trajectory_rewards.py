"""Reward terms of the agent stage: MiniMind's ``calculate_rewards`` of ``trainer/train_agent.py`` (d65ef2c), split into
terms that add up to it (written anew), and plug-ins. Every term is called once per micro-batch as
``fn(trajectories, **args)`` (rl/turns.py:Trajectory) and returns one float per trajectory; a trajectory's reward is
``clip(sum of weight * term, -reward_clip, reward_clip)``. With every term at weight 1 this is MiniMind's reward:

``tool_tags``     -0.5 per unbalanced ``<tool_call>`` / ``</tool_call>`` tag in the turns' answers (after ``</think>``)
``tool_calls``    with calls: +0.5 when the valid calls (an offered tool, arguments that suit its schema) number as
                  many as ``gt`` has values and none is invalid, else -0.5 per call too many, too few or invalid; 0
                  without calls
``reply_format``  without calls: +0.5 for a reply of 5..800 characters (else -0.5), and for a ``</think>``: +1.0 when
                  the thinking has 20..300 characters (else -0.5), +0.25 when it occurs once (else -0.25); 0 with calls
``gt_answer``     with calls (``require_tool_call``, MiniMind's rule): 2.5 x the share of ``gt`` values the final answer
                  holds (the text after the last ``</tool_call>``; none when unfinished); ``match: minimind`` finds a
                  value as MiniMind does (its text anywhere, or an equal number), ``exact`` as the ``exact_answer``
                  reward does (one value: the answer's last number, or the whole answer)
``unfinished``    -0.5 for a trajectory that still called tools after the last turn (or ran out of max_total_len)
``repetition``    minus MiniMind's repetition penalty of the final answer
``reward_model``  without calls: a reward model's score of the answer (rl/reward_model.py, as the GRPO term), else 0
``module:function``  any callable ``fn(trajectories, **args) -> one float per trajectory``
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from minimind_ray.rl.rewards import build_rewards, is_correct, load_callable, repetition_penalty, split_think
from minimind_ray.rl.tools import check_arguments, parse_tool_calls, tool_schemas

_MINIMIND_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?![\w.])")
_NUMERIC = re.compile(r"[-+]?\d+(?:\.\d+)?")


def turn_answers(traj) -> List[str]:
    """Each turn's text after its ``</think>`` (the whole turn without one), stripped."""
    return [split_think(t)[1].strip() if "</think>" in t else t.strip() for t in traj.turns]


def answer_calls(traj) -> List[dict]:
    return [c for a in turn_answers(traj) for c in parse_tool_calls(a)[0]]


def final_answer(traj) -> str:
    """What the trajectory ends with: the last turn's answer after its last ``</tool_call>``; '' when unfinished."""
    answers = turn_answers(traj)
    if traj.unfinished or not answers:
        return ""
    last = answers[-1]
    return last.split("</tool_call>")[-1].strip() if "</tool_call>" in last else last


def gt_found(text: str, gt: Sequence[str], match: str = "minimind") -> List[bool]:
    """Which ``gt`` values ``text`` holds. ``minimind`` (MiniMind's validate_gt_in_text): the value's text anywhere
    in it, case aside, or a number of the text equal to it (within 1e-6); ``exact``: a single value as
    :func:`~minimind_ray.rl.rewards.is_correct` has it (the text's last number, or the whole text), several each as
    a whole number of the text or, for text values, anywhere in it."""
    if match == "exact":
        if len(gt) == 1:
            return [is_correct(text, gt[0])]
        numbers = [float(x) for x in _NUMERIC.findall(text.replace(",", ""))]
        return [any(abs(float(g) - n) < 1e-9 for n in numbers) if _NUMERIC.fullmatch(g.strip().replace(",", ""))
                else g.strip().lower() in text.lower() for g in gt]
    numbers = [float(x) for x in _MINIMIND_NUMBER.findall(text.replace(",", ""))]
    out = []
    for g in gt:
        s = str(g).strip()
        numeric = _NUMERIC.fullmatch(s.replace(",", ""))
        out.append(bool(s) and s.lower() in text.lower()
                   or bool(numeric) and any(abs(float(s.replace(",", "")) - n) < 1e-6 for n in numbers))
    return out


def tool_tags(trajs, penalty: float = 0.5) -> List[float]:
    return [-penalty * sum(abs(a.count("<tool_call>") - a.count("</tool_call>")) for a in turn_answers(t))
            for t in trajs]


def tool_calls(trajs, bonus: float = 0.5, penalty: float = 0.5) -> List[float]:
    out = []
    for t in trajs:
        calls = answer_calls(t)
        if not calls:
            out.append(0.0)
            continue
        offered = tool_schemas(t.tools)
        valid = sum(c["name"] in offered and check_arguments(offered[c["name"]], c["arguments"]) is None for c in calls)
        gap = abs(valid - len(t.gt)) + (len(calls) - valid)
        out.append(bonus if gap == 0 else -penalty * gap)
    return out


def reply_format(trajs, min_chars: int = 5, max_chars: int = 800) -> List[float]:
    out = []
    for t in trajs:
        if answer_calls(t):
            out.append(0.0)
            continue
        reply = t.turns[-1] if t.turns else ""
        r = 0.5 if min_chars <= len(reply.strip()) <= max_chars else -0.5
        if "</think>" in reply:
            think = reply.split("</think>", 1)[0]
            r += (1.0 if 20 <= len(think.strip()) <= 300 else -0.5) + (0.25 if reply.count("</think>") == 1 else -0.25)
        out.append(r)
    return out


def gt_answer(trajs, credit: float = 2.5, require_tool_call: bool = True, match: str = "minimind") -> List[float]:
    out = []
    for t in trajs:
        if not t.gt or (require_tool_call and not answer_calls(t)):
            out.append(0.0)
            continue
        found = gt_found(final_answer(t), t.gt, match)
        out.append(credit * sum(found) / len(t.gt))
    return out


def unfinished(trajs, penalty: float = 0.5) -> List[float]:
    return [-penalty if t.unfinished else 0.0 for t in trajs]


def repetition(trajs, n: int = 3, cap: float = 0.5) -> List[float]:
    out = []
    for t in trajs:
        if answer_calls(t):
            text = final_answer(t) or (turn_answers(t) or [""])[-1]
        else:
            text = split_think(t.turns[-1] if t.turns else "")[1]
        out.append(-repetition_penalty(text, n, cap))
    return out


AGENT_RULES: Dict[str, Callable] = {"tool_tags": tool_tags, "tool_calls": tool_calls, "reply_format": reply_format,
                                    "gt_answer": gt_answer, "unfinished": unfinished, "repetition": repetition}


@dataclass
class AgentTerm:
    label: str  # the metric name's suffix: reward_<label>
    weight: float
    fn: Callable
    args: dict

    def __call__(self, trajs) -> List[float]:
        values = [float(v) for v in self.fn(trajs, **self.args)]
        if len(values) != len(trajs):
            raise ValueError(f"reward {self.label!r} returned {len(values)} values for {len(trajs)} trajectories")
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            raise ValueError(f"reward {self.label!r} returned a non-finite value ({bad[0]})")
        return values


def _reward_model_term(spec, device, run_name, index):
    """A reward model scores a trajectory that called no tool, on its prompt and final reply (MiniMind's rule)."""
    (term,) = build_rewards([spec], device, run_name=f"{run_name}-agent{index}" if run_name else None)

    def score(trajs) -> List[float]:
        plain = [i for i, t in enumerate(trajs) if not answer_calls(t)]
        values = [0.0] * len(trajs)
        if plain:
            got = term([trajs[i].prompt for i in plain], [split_think(trajs[i].turns[-1])[1] for i in plain],
                       ["" for _ in plain])
            for i, v in zip(plain, got):
                values[i] = v
        return values

    return score


def build_agent_rewards(specs, device=None, run_name: Optional[str] = None) -> List[AgentTerm]:
    """The terms of ``train.agent.rewards`` (config.RewardConfig), ready to call."""
    terms, labels = [], set()
    for i, spec in enumerate(specs):
        args = dict(spec.args or {})
        if spec.name == "reward_model":
            fn, args, label = _reward_model_term(spec, device, run_name, i), {}, "reward_model"
        elif spec.name in AGENT_RULES:
            fn, label = AGENT_RULES[spec.name], spec.name
        else:
            fn, label = load_callable(spec.name), re.sub(r"\W", "_", spec.name.partition(":")[2])
        base, k = label, 2
        while label in labels:
            label, k = f"{base}_{k}", k + 1
        labels.add(label)
        terms.append(AgentTerm(label, float(spec.weight), fn, args))
    return terms


def score_trajectories(terms: List[AgentTerm], trajs, clip: Optional[float]) -> Tuple[List[float], Dict[str, List[float]]]:
    """(each trajectory's total reward, clipped; each term's unweighted values by label)."""
    per_term = {t.label: t(trajs) for t in terms}
    total = [sum(t.weight * per_term[t.label][i] for t in terms) for i in range(len(trajs))]
    if clip is not None:
        total = [max(-clip, min(clip, x)) for x in total]
    return total, per_term
