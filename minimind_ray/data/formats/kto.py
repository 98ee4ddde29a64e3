"""``kto``: ``{"conversations": [..., {"role": "assistant", ...}], "label": true|false}``: unpaired preferences (stage
``kto``, Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"). The last message is the
assistant reply being judged: desirable (``label`` true) or undesirable (false); the turns before it are its prompt.

Rendered and labelled like SFT (data/formats/sft.py: the chat template, MiniMind's assistant spans, a row cut at
``max_seq_len`` and counted ``truncated``); the judged reply is the last assistant span, and only its tokens are
scored (earlier assistant turns are prompt). A record whose reply starts after ``max_seq_len`` has nothing to score
(``no_labels``).

Stored columns ``prompt_ids``, ``completion_ids`` (the reply's tokens, through its ``<|im_end|>\\n``) and ``label``
(one uint8). The batch: ``input_ids``/``targets`` of each prompt + its reply (targets on the reply only), ``label``
(B,) bool, and ``kl_input_ids``/``kl_targets`` of mismatched pairs, each prompt with the reply of the row before it
in the micro-batch (the first with the last's), TRL's rotation: what the objective estimates KTO's reference point
from (stages/kto_objective.py). The pairs depend on the rows of a micro-batch only, so they are the same whatever
the number of workers.
"""
from __future__ import annotations

from typing import List

import numpy as np

from minimind_ray.data.formats.base import BAD_TEXT, BadRecord, Format, Issues, RowEncoder, assistant_mask, \
    batch_length, check_reply, render_chat, sample_id_tensor, shift


class KTOEncoder(RowEncoder):
    def add(self, records: List[dict]) -> Issues:
        issues, texts, kept = [], [], []
        for i, r in enumerate(records):
            try:
                texts.append(render_chat(self.tok, r["conversations"]))
                kept.append(i)
            except BadRecord as e:
                issues.append((i, e.reason, e.detail))
        for i, ids in zip(kept, self._encode(texts)):
            if ids is None:
                issues.append((i, "bad_text", BAD_TEXT))
                continue
            arr = np.asarray(ids, dtype=self.dtype)
            labelled = np.flatnonzero(assistant_mask(arr, self.start_seq, self.end_seq))
            if not len(labelled):
                issues.append((i, "no_labels", "no assistant tokens"))
                continue
            gaps = np.flatnonzero(np.diff(labelled) > 1)
            start = int(labelled[gaps[-1] + 1] if len(gaps) else labelled[0])  # the last span: the judged reply
            end = min(int(labelled[-1]) + 1, self.L)
            if start >= self.L:
                issues.append((i, "no_labels", f"the judged reply starts after max_seq_len={self.L}"))
                continue
            if len(arr) > self.L:
                issues.append((i, "truncated", f"longer than max_seq_len={self.L}"))
            self._rows["prompt_ids"].append(arr[:start])
            self._rows["completion_ids"].append(arr[start:end])
            self._rows["label"].append(np.array([records[i]["label"]], dtype=np.uint8))
        return issues


class KTO(Format):
    name = "kto"
    record = "{conversations ending with the judged assistant reply, label: true|false}"
    columns = ("prompt_ids", "completion_ids", "label")
    byte_columns = ("label",)
    encoder_class = KTOEncoder

    def check(self, rec: dict) -> int:
        chars = check_reply(rec)
        if rec.get("label") is None:
            raise BadRecord("missing_field", "field 'label' missing")
        if not isinstance(rec["label"], bool):
            raise BadRecord("wrong_type", f"'label' is {type(rec['label']).__name__}, expected true or false")
        return chars

    def collate(self, rows, sample_ids, pad_id, max_seq_len):
        import torch  # lazy: torch, in the training workers only (prepare never collates)

        prompts, replies = rows["prompt_ids"], rows["completion_ids"]
        mismatched = [replies[i - 1] for i in range(len(replies))]  # row i's prompt with row i-1's reply
        out = {}
        for prefix, with_replies in (("", replies), ("kl_", mismatched)):
            seqs = [np.concatenate([p, r]) for p, r in zip(prompts, with_replies)]
            masks = [np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(r), np.uint8)])
                     for p, r in zip(prompts, with_replies)]
            out[prefix + "input_ids"], out[prefix + "targets"] = shift(seqs, masks, batch_length(seqs, max_seq_len),
                                                                       pad_id)
        out["label"] = torch.tensor([bool(label[0]) for label in rows["label"]], dtype=torch.bool)
        out["sample_ids"] = sample_id_tensor(sample_ids)
        return out


FORMAT = KTO()
