"""``sft``: ``{"conversations": [{"role", "content", ...}, ...]}``, following MiniMind's ``dataset/lm_dataset.py``.

Rendered with the tokenizer's chat template (``tools`` passed when the first system message carries ``functions``
(MiniMind2) or ``tools`` (minimind-3); JSON-string ``tools``/``tool_calls`` are parsed as minimind-3 does),
truncated to ``max_seq_len``, and labelled exactly as MiniMind's ``generate_labels``: a label span starts after
each occurrence of the token sequence of ``f"{bos}assistant\\n"`` and runs through the first following occurrence
of the tokens of ``f"{eos}\\n"`` (included), or to the end of the truncated row. Deterministic: none of MiniMind's
random system prompts or random removal of empty ``<think>`` blocks. One difference, on purpose: MiniMind labels
after padding, so an assistant span cut by truncation also trains on the pad tokens after it; here labels are
computed before padding and pads never train. SFT is not packed: the model attends with SDPA ``is_causal=True``
and has no block-diagonal mask, so packed conversations would attend across each other.

Stored columns ``ids``, ``mask``; batch ``input_ids``, ``targets``. :class:`ConversationEncoder` also encodes
DPO's two conversations (data/formats/dpo.py).
"""
from __future__ import annotations

from typing import List

import numpy as np

from minimind_ray.data.formats.base import BAD_TEXT, BadRecord, Format, Issues, RowEncoder, batch_length, \
    check_messages, render_chat, sample_id_tensor, shift


class ConversationEncoder(RowEncoder):
    """Each of the format's ``sides`` (column prefix, record field) rendered, truncated and labelled; a record whose
    sides do not all keep an assistant token is dropped (``no_labels``)."""

    def add(self, records: List[dict]) -> Issues:
        sides = self.format.sides
        issues, texts, kept = [], [], []
        for i, r in enumerate(records):
            try:
                texts += [render_chat(self.tok, r[field]) for _, field in sides]
                kept.append(i)
            except BadRecord as e:
                issues.append((i, e.reason, e.detail))
        encoded = self._encode(texts)
        for j, i in enumerate(kept):
            every = encoded[j * len(sides):(j + 1) * len(sides)]
            if any(ids is None for ids in every):
                issues.append((i, "bad_text", BAD_TEXT))
                continue
            labelled = [self._labelled(ids) for ids in every]
            if not all(m[1:].any() for _, m, _ in labelled):
                issues.append((i, "no_labels", "no assistant tokens within max_seq_len"))
                continue
            if any(cut for _, _, cut in labelled):
                issues.append((i, "truncated", f"longer than max_seq_len={self.L}"))
            for (prefix, _), (arr, m, _) in zip(sides, labelled):
                self._rows[prefix + "ids"].append(arr)
                self._rows[prefix + "mask"].append(m.astype(np.uint8))
        return issues


class SFT(Format):
    name = "sft"
    record = "{conversations}"
    columns = ("ids", "mask")
    byte_columns = ("mask",)
    cross_entropy = True
    encoder_class = ConversationEncoder
    sides = (("", "conversations"),)  # (column prefix, record field) of each conversation a record holds

    def check(self, rec: dict) -> int:
        return sum(check_messages(rec, field) for _, field in self.sides)

    def collate(self, rows, sample_ids, pad_id, max_seq_len):
        """``<prefix>input_ids``, ``<prefix>targets`` of each side, all of one length T (so that an objective can run
        the sides in one forward), and ``sample_ids``."""
        T = batch_length([r for prefix, _ in self.sides for r in rows[prefix + "ids"]], max_seq_len)
        out = {}
        for prefix, _ in self.sides:
            out[prefix + "input_ids"], out[prefix + "targets"] = shift(rows[prefix + "ids"], rows[prefix + "mask"],
                                                                       T, pad_id)
        out["sample_ids"] = sample_id_tensor(sample_ids)
        return out


FORMAT = SFT()
