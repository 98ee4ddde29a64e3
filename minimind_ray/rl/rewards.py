"""Reward plug-ins of the grpo stage, combined by configured weights.

Every reward is called once per micro-batch as ``fn(prompts, completions, answers, **args)`` and returns
one float per completion. The three lists are aligned, one entry per completion: ``prompts`` the
chat-templated prompt text (special tokens kept, so a reward model can read the turns back),
``completions`` the sampled text through its EOS (special tokens removed), ``answers`` the
reference answer of its prompt ('' when the data has none). ``train.grpo.rewards`` lists the
terms; the total reward of a completion is the sum of ``weight * term``.

Built in (MiniMind's rules from ``trainer/train_grpo.py``, d65ef2c, written anew):

``length``        +0.5 when the stripped completion has 20..800 characters, else -0.5
``think_format``  for a completion with ``</think>``: +1.0 when the thinking has 20..300 characters (else
                  -0.5), +0.25 when ``</think>`` occurs once (else -0.25); 0 without ``</think>``
``repetition``    minus MiniMind's repetition penalty of the answer (the text after ``</think>``):
                  the share of repeated word 3-grams, times 2 * cap, at most cap = 0.5
``exact_answer``  1.0 when the answer is right, else 0.0 (:func:`is_correct`)
``close_answer``  partial credit for a numeric answer: 1 - |last number - answer| / tolerance, at least 0
``permutation_answer``  for answers that are an ordering of items (sorting: "1 2 4 7 9"): 1.0 for the answer,
                  ``partial`` x the share of positions right for another ordering of the same items, and 0 for
                  anything else (so no constant reply, and no reply that drops or invents items, earns credit)
``reward_model``  a model's score, clipped to [-3, 3] (minimind_ray/rl/reward_model.py)
``module:function``  any importable callable with the signature above

No reward draws random numbers: scoring never moves the sampling RNG that checkpoints restore.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from minimind_ray.config_checks import ConfigError, config_field as _f, need, require_extra
from minimind_ray.failures import plugin_call
from minimind_ray.plugins import callable_object

BUILTIN_REWARDS = ("length", "think_format", "repetition", "exact_answer", "close_answer", "permutation_answer",
                   "reward_model")
RewardFn = Callable[..., Sequence[float]]


def split_think(text: str) -> Tuple[Optional[str], str]:
    """(thinking, answer): the text before and after the first ``</think>``; (None, text) without one."""
    if "</think>" not in text:
        return None, text
    thinking, answer = text.split("</think>", 1)  # MiniMind's rule: the thinking is measured as it is
    return thinking, answer.strip()


def length_reward(prompts, completions, answers, min_chars: int = 20, max_chars: int = 800,
                  inside: float = 0.5, outside: float = -0.5) -> List[float]:
    return [inside if min_chars <= len(c.strip()) <= max_chars else outside for c in completions]


def think_format_reward(prompts, completions, answers, min_chars: int = 20, max_chars: int = 300) -> List[float]:
    out = []
    for c in completions:
        thinking, _ = split_think(c)
        if thinking is None:
            out.append(0.0)
            continue
        r = 1.0 if min_chars <= len(thinking.strip()) <= max_chars else -0.5
        out.append(r + (0.25 if c.count("</think>") == 1 else -0.25))
    return out


def repetition_penalty(text: str, n: int = 3, cap: float = 0.5) -> float:
    """MiniMind's ``rep_penalty``: words and punctuation marks, lower-cased, in n-grams; the share of
    n-grams that repeat an earlier one, times 2 * cap, at most cap."""
    toks = re.findall(r"\w+|[^\w\s]", text.lower())
    grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    if not grams:
        return 0.0
    return min(cap, (len(grams) - len(set(grams))) * cap * 2 / len(grams))


def repetition_reward(prompts, completions, answers, n: int = 3, cap: float = 0.5) -> List[float]:
    return [-repetition_penalty(split_think(c)[1], n, cap) for c in completions]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _as_number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def _normalise(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(".。!！")


def _last_number(text: str) -> Optional[float]:
    numbers = _NUMBER.findall(split_think(text)[1].replace(",", ""))
    return float(numbers[-1]) if numbers else None


def is_correct(completion: str, answer: str) -> bool:
    """Whether ``completion`` gives ``answer``. A numeric answer must equal the completion's *last*
    number ("12 plus 7 equals 19." gives 19; thousands commas ignored); any other answer must equal
    the whole reply, case, spacing and a final full stop aside. After ``</think>`` when there is one."""
    answer = answer.strip()
    if not answer:
        return False
    ref = _as_number(answer)
    if ref is not None:
        return _last_number(completion) == ref
    return _normalise(split_think(completion)[1]) == _normalise(answer)


def exact_answer_reward(prompts, completions, answers, correct: float = 1.0, wrong: float = 0.0) -> List[float]:
    return [correct if is_correct(c, a) else wrong for c, a in zip(completions, answers)]


def close_answer_reward(prompts, completions, answers, tolerance: float = 10.0) -> List[float]:
    """A dense companion of exact_answer for numeric answers: a near miss earns part of the credit, so a
    group of wrong replies still tells the closer ones apart. 0 for a reply without a number or a text answer."""
    out = []
    for c, a in zip(completions, answers):
        ref, got = _as_number(a), _last_number(c)  # a blank answer is no number
        out.append(0.0 if ref is None or got is None else max(0.0, 1.0 - abs(got - ref) / tolerance))
    return out


def permutation_answer_reward(prompts, completions, answers, partial: float = 0.5) -> List[float]:
    """See the module docstring: items are the whitespace-separated words of the answer and of the reply (after
    ``</think>``, a final full stop aside)."""
    out = []
    for c, a in zip(completions, answers):
        want, got = a.split(), split_think(c)[1].strip().rstrip(".。").split()
        if not want or sorted(got) != sorted(want):
            out.append(0.0)
        elif got == want:
            out.append(1.0)
        else:
            out.append(partial * sum(x == y for x, y in zip(got, want)) / len(want))
    return out


RULES: Dict[str, RewardFn] = {"length": length_reward, "think_format": think_format_reward,
                              "repetition": repetition_reward, "exact_answer": exact_answer_reward,
                              "close_answer": close_answer_reward, "permutation_answer": permutation_answer_reward}


def load_callable(spec: str) -> RewardFn:
    """``package.module:function`` -> the function; ValueError naming what is wrong."""
    if ":" not in spec:
        raise ValueError(f"{spec!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor 'module:function'")
    return callable_object(spec, "reward")


@dataclass
class RewardTerm:
    label: str  # the metric name's suffix: reward_<label>
    weight: float
    fn: RewardFn
    args: dict

    plugin: Optional[str] = None  # a user's 'module:function': what it raises is the user's mistake (failures.py)

    def __call__(self, prompts: List[str], completions: List[str], answers: List[str]) -> List[float]:
        with plugin_call(f"reward plug-in {self.plugin}") if self.plugin else contextlib.nullcontext():
            values = [float(v) for v in self.fn(prompts, completions, answers, **self.args)]
            if len(values) != len(completions):
                raise ValueError(f"reward {self.label!r} returned {len(values)} values for {len(completions)} "
                                 f"completions")
            bad = [v for v in values if not math.isfinite(v)]
            if bad:
                raise ValueError(f"reward {self.label!r} returned a non-finite value ({bad[0]})")
        return values


def build_rewards(specs, device=None, run_name: Optional[str] = None) -> List[RewardTerm]:
    """The terms of ``train.grpo.rewards`` (a list of config.RewardConfig), ready to call. ``run_name``
    names a reward model's actor (``placement: actor``), which every rank of the run then shares."""
    terms, labels = [], set()
    for i, spec in enumerate(specs):
        args = dict(spec.args or {})
        if spec.name == "reward_model":
            from minimind_ray.rl.reward_model import load_reward_model  # lazy: torch, only when this runs

            if run_name and args.get("placement") == "actor":
                args.setdefault("actor_name", f"minimind-reward-{run_name}-{i}")
            fn, args = load_reward_model(spec.path, device, **args), {}
            label = "reward_model"
        elif spec.name in RULES:
            fn, label = RULES[spec.name], spec.name
        else:
            with plugin_call(f"reward plug-in {spec.name}") if ":" in spec.name else contextlib.nullcontext():
                fn = load_callable(spec.name)
            label = re.sub(r"\W", "_", spec.name.partition(":")[2])
        base, k = label, 2
        while label in labels:  # the same reward twice (other args): reward_length, reward_length_2
            label, k = f"{base}_{k}", k + 1
        labels.add(label)
        terms.append(RewardTerm(label, float(spec.weight), fn, args, plugin=spec.name if ":" in spec.name else None))
    return terms


def score(terms: List[RewardTerm], prompts: List[str], completions: List[str],
          answers: List[str]) -> Tuple[List[float], Dict[str, List[float]]]:
    """(total reward of each completion, each term's unweighted values by label)."""
    per_term = {t.label: t(prompts, completions, answers) for t in terms}
    total = [sum(t.weight * per_term[t.label][i] for t in terms) for i in range(len(completions))]
    return total, per_term


# --------------------------------------------------------------------------- a reward term in a config


@dataclass
class RewardConfig:
    """One term of the GRPO reward; a completion's reward is the sum of weight * term (minimind_ray/rl/rewards.py)."""

    name: str = _f("length", "length | think_format | repetition | exact_answer | close_answer | permutation_answer | "
                             "reward_model (MiniMind's "
                             "rules, a known answer, a near miss, a model), or 'module:function' called as "
                             "fn(prompts, completions, answers, **args)")
    weight: float = _f(1.0, "multiplier of this term in the total reward")
    path: Optional[str] = _f(None, "reward_model: a directory with an HF AutoModelForSequenceClassification, or a model "
                                   "with get_score as MiniMind uses (internlm2-1_8b-reward; args.trust_remote_code=true)")
    args: Dict[str, Any] = _f({}, "keyword arguments of the term, e.g. {min_chars: 20, max_chars: 800} for length, "
                                  "{clip: 3.0, kind: auto, placement: worker | actor} for reward_model")


def validate_reward_term(r: RewardConfig, at: str) -> None:
    """A reward term loads: a known rule, a reward model directory, or an importable ``module:function``."""
    need(math.isfinite(r.weight), f"{at}.weight", "must be a finite number")
    if r.name == "reward_model":
        need(r.path is not None and os.path.isdir(r.path), f"{at}.path", f"not a directory: {r.path}")
        require_extra("transformers", "hf", at, "a reward model")  # checked with the config, before Ray starts
    elif r.name not in BUILTIN_REWARDS:
        try:
            load_callable(r.name)
        except ValueError as e:
            raise ConfigError(f"{at}.name: {e}") from None


def validate_reward_terms(terms: List[RewardConfig], where: str) -> None:
    need(bool(terms), where, "no reward terms")
    for i, r in enumerate(terms):
        validate_reward_term(r, f"{where}[{i}]")


def user_reward_names(terms: List[RewardConfig]) -> List[str]:
    """The user's own reward functions among ``terms`` (``package.module:function``), which the workers must import."""
    return [r.name for r in terms if r.name not in BUILTIN_REWARDS and ":" in r.name]


MINIMIND_RULES = ("length", "think_format", "repetition")  # MiniMind's rule rewards: every section's default


def reward_terms_field(help: str, names=MINIMIND_RULES):
    """An RL section's ``rewards``: a list of :class:`RewardConfig`, by default one per name (MiniMind's rules)."""
    return field(default_factory=lambda: [RewardConfig(n) for n in names], metadata={"help": help})
