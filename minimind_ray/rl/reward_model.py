"""Model-based rewards (``{name: reward_model, path: DIR}`` in ``train.grpo.rewards``), scored in the worker.

Two kinds of directory:

``sequence_classification``  a Hugging Face ``AutoModelForSequenceClassification`` with one label (the
    usual reward-model head): the conversation plus the completion, rendered with the reward model's
    own chat template when it has one (else ``role: content`` lines), scored by its logit.
``get_score``  what MiniMind's ``trainer_utils.LMForRewardModel`` loads (internlm2-1_8b-reward): an
    ``AutoModel`` with remote code and a ``get_score(tokenizer, messages)`` method, given MiniMind's
    message layout (earlier turns folded into the last question). Remote code runs code from the
    directory, so it needs ``args: {trust_remote_code: true}``.

``kind: auto`` (the default) picks ``sequence_classification`` when the directory's config.json names
a ``*ForSequenceClassification`` architecture, else ``get_score``. Scores are clipped to [-clip, clip]
(MiniMind: 3). The model is frozen, in eval mode, on the worker's device.

``placement: actor`` scores on a Ray actor instead: one copy of the reward model that every rank of the
run calls (a named actor the first rank creates), with resources of its own (``actor_cpus``,
``actor_gpus``), so a large reward model is not loaded once per training GPU.
"""
from __future__ import annotations

import json
import os
import re
from typing import List

import torch

_TURN = re.compile(r"<\|im_start\|>(system|user|assistant|tool)\s+(.*?)<\|im_end\|>", re.DOTALL)
KINDS = ("auto", "sequence_classification", "get_score")


def prompt_messages(prompt: str) -> List[dict]:
    """The turns of a ChatML prompt (MiniMind's template) as messages; a plain prompt is one user turn."""
    turns = [{"role": r, "content": c.strip()} for r, c in _TURN.findall(prompt)]
    return turns or [{"role": "user", "content": prompt.strip()}]


def _kind_of(path: str) -> str:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError) as e:
        raise ValueError(f"reward model {path}: no readable config.json ({e})") from None
    return "sequence_classification" if any(a.endswith("ForSequenceClassification") for a in archs) else "get_score"


class SequenceClassifierReward:
    def __init__(self, path: str, device, clip: float = 3.0, max_length: int = 1024, batch_size: int = 16,
                 trust_remote_code: bool = False, dtype: str = "float32"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if self.tok.pad_token is None:  # batched scoring pads; a model without a pad token reads the last real one
            self.tok.pad_token = self.tok.eos_token or self.tok.unk_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                                        dtype=getattr(torch, dtype))
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tok.pad_token_id
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.clip, self.max_length, self.batch_size = device, clip, max_length, batch_size

    def text(self, prompt: str, completion: str) -> str:
        messages = prompt_messages(prompt) + [{"role": "assistant", "content": completion}]
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(messages, tokenize=False)
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

    @torch.no_grad()
    def __call__(self, prompts, completions, answers) -> List[float]:
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        scores = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tok(texts[i:i + self.batch_size], return_tensors="pt", padding=True, truncation=True,
                           max_length=self.max_length).to(self.device)
            scores += self.model(**enc).logits[:, 0].float().clamp(-self.clip, self.clip).tolist()
        return scores


class GetScoreReward:
    """MiniMind's reward-model call: ``model.get_score(tokenizer, [user: history + question, assistant: reply])``."""

    def __init__(self, path: str, device, clip: float = 3.0, trust_remote_code: bool = False, dtype: str = "float32"):
        if not trust_remote_code:
            raise ValueError(f"reward model {path}: a get_score model runs the directory's own code; set "
                             f"args.trust_remote_code=true for this reward if you trust it")
        from transformers import AutoModel, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        self.model = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=getattr(torch, dtype))
        if not hasattr(self.model, "get_score"):
            raise ValueError(f"reward model {path}: {type(self.model).__name__} has no get_score method "
                             f"(and config.json names no *ForSequenceClassification architecture)")
        self.model.to(device).eval().requires_grad_(False)
        self.clip = clip

    @staticmethod
    def messages(prompt: str, completion: str) -> List[dict]:
        turns = prompt_messages(prompt)
        history = "\n".join(f"{m['role']}: {m['content']}" for m in turns[:-1])
        question = turns[-1]["content"] if turns else ""
        context = f"{history}\n以上是对话历史。我的新问题是：\n{question}" if history else question
        return [{"role": "user", "content": context}, {"role": "assistant", "content": completion}]

    @torch.no_grad()
    def __call__(self, prompts, completions, answers) -> List[float]:
        return [max(-self.clip, min(self.clip, float(self.model.get_score(self.tok, self.messages(p, c)))))
                for p, c in zip(prompts, completions)]


def load_reward_model(path: str, device=None, kind: str = "auto", placement: str = "worker", actor_name: str = "",
                      actor_cpus: float = 1.0, actor_gpus: float = 0.0, **kw):
    """A reward callable for the model in directory ``path`` (see the module docstring); ``kw`` are the
    reward's other ``args`` (clip, max_length, batch_size, trust_remote_code, dtype)."""
    if not path or not os.path.isdir(path):
        raise ValueError(f"reward model: {path!r} is not a directory")
    if kind not in KINDS:
        raise ValueError(f"reward model {path}: kind {kind!r} is not one of {KINDS}")
    if placement == "actor":
        return ActorReward(path, actor_name, actor_cpus, actor_gpus, kind=kind, **kw)
    if placement != "worker":
        raise ValueError(f"reward model {path}: placement {placement!r} is not 'worker' or 'actor'")
    kind = _kind_of(path) if kind == "auto" else kind
    device = device or torch.device("cpu")
    if kind == "sequence_classification":
        return SequenceClassifierReward(path, device, **kw)
    return GetScoreReward(path, device, **kw)


class _Scorer:
    """What the reward actor runs: the same in-process scorer, on the actor's device."""

    def __init__(self, path: str, gpu: bool, kw: dict):
        self.fn = load_reward_model(path, torch.device("cuda" if gpu else "cpu"), **kw)

    def score(self, prompts, completions, answers) -> List[float]:
        return self.fn(prompts, completions, answers)


class ActorReward:
    """A reward model on a named Ray actor, shared by the ranks of a run (created by whichever asks first;
    it lives as long as that worker). Scoring is deterministic, so where it runs changes no result."""

    def __init__(self, path: str, name: str, cpus: float, gpus: float, **kw):
        import ray

        import hashlib

        self.name = name or f"minimind-reward-{hashlib.sha256(path.encode()).hexdigest()[:12]}"
        cls = ray.remote(_Scorer).options(name=self.name, get_if_exists=True, num_cpus=cpus, num_gpus=gpus)
        self.actor = cls.remote(path, gpus > 0, kw)

    def __call__(self, prompts, completions, answers) -> List[float]:
        import ray

        return ray.get(self.actor.score.remote(list(prompts), list(completions), list(answers)))
