"""``rlaif``: ``{"conversations": [..., {"role": "assistant", ...}]}``, MiniMind's ``rlaif.jsonl``: RL prompts (stages
``grpo``, ``ppo``). The last turn, the assistant's, is the one to generate; its content is kept as the reference
answer. Rendered with the generation prompt; a longer prompt keeps its last ``max_seq_len`` tokens (MiniMind's
rule, counted ``truncated``). No random system prompt or thinking switch.

The base of the other prompt formats (``prompt``, ``agent_rl``): they differ in the record's check, its prompt's
messages, its answer and what else a rollout needs (:meth:`RLAIF.context`).

Stored columns ``prompt_ids`` and ``answer_utf8`` (and a subclass's ``context_utf8``); the batch is the prompts
left-padded, with the answers as bytes (:meth:`RLAIF.collate`), which rl/ reads.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from minimind_ray.data.formats.base import BAD_TEXT, BadRecord, Format, Issues, RowEncoder, check_reply, \
    render_chat, sample_id_tensor


class PromptEncoder(RowEncoder):
    def add(self, records: List[dict]) -> Issues:
        fmt = self.format
        issues, texts, answers, kept, contexts = [], [], [], [], []
        for i, r in enumerate(records):
            try:
                texts.append(render_chat(self.tok, fmt.prompt_messages(r), add_generation_prompt=True))
                answers.append(fmt.answer(r))
                context = fmt.context(r)
                contexts.append(None if context is None else np.frombuffer(context.encode("utf-8"), np.uint8))
                kept.append(i)
            except BadRecord as e:
                issues.append((i, e.reason, e.detail))
        for i, ids, answer, context in zip(kept, self._encode(texts), answers, contexts):
            try:
                answer_bytes = np.frombuffer(answer.encode("utf-8"), dtype=np.uint8)
            except UnicodeEncodeError:  # a lone surrogate
                ids = None
            if ids is None:
                issues.append((i, "bad_text", BAD_TEXT))
                continue
            if len(ids) > self.L:  # MiniMind keeps the prompt's end: the question and the generation prompt
                issues.append((i, "truncated", f"prompt longer than max_seq_len={self.L}: kept its last tokens"))
            self._rows["prompt_ids"].append(np.asarray(ids[-self.L:], dtype=self.dtype))
            self._rows["answer_utf8"].append(answer_bytes)
            if context is not None:
                self._rows["context_utf8"].append(context)
        return issues


class RLAIF(Format):
    name = "rlaif"
    record = "{conversations ending with the assistant turn to generate}"
    columns = ("prompt_ids", "answer_utf8")
    byte_columns = ("answer_utf8",)
    encoder_class = PromptEncoder

    def check(self, rec: dict) -> int:
        return check_reply(rec)

    def prompt_messages(self, rec: dict) -> List[dict]:
        """The messages the prompt renders (with the generation prompt after them)."""
        return rec["conversations"][:-1]

    def answer(self, rec: dict) -> str:
        """The reference answer a reward may compare with, stored as UTF-8."""
        return rec["conversations"][-1]["content"]

    def context(self, rec: dict) -> Optional[str]:
        """What else a rollout needs, stored as UTF-8 in ``context_utf8``; None: nothing (no such column)."""
        return None

    def collate(self, rows, sample_ids, pad_id, max_seq_len):
        """``prompt_ids`` (B, P) left-padded with ``pad_id``, ``prompt_mask`` (B, P) (1 = a prompt token),
        ``sample_ids``, and each ``<x>_utf8`` column (the answer; agent_rl's context) as zero-padded bytes (B, A)
        with ``<x>_len`` (B,)."""
        import torch  # lazy: torch, in the training workers only (prepare never collates)

        prompts = rows["prompt_ids"]
        B, P = len(prompts), max(len(p) for p in prompts)
        ids, mask = np.full((B, P), pad_id, np.int64), np.zeros((B, P), np.int64)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):], mask[i, P - len(p):] = p, 1
        out = {"prompt_ids": torch.from_numpy(ids), "prompt_mask": torch.from_numpy(mask),
               "sample_ids": sample_id_tensor(sample_ids)}
        for col in [c for c in rows if c.endswith("_utf8")]:
            utf8 = np.zeros((B, max(1, max(len(a) for a in rows[col]))), np.uint8)
            for i, a in enumerate(rows[col]):
                utf8[i, :len(a)] = a
            out[col] = torch.from_numpy(utf8)
            out[col[:-len("_utf8")] + "_len"] = torch.tensor([len(a) for a in rows[col]], dtype=torch.int64)
        return out


FORMAT = RLAIF()
