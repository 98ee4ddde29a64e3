"""``pretrain``: ``{"text": ...}``, following MiniMind's ``dataset/lm_dataset.py`` (83e52f6 / d65ef2c).

Each document is ``bos + ids + eos``. Packed (default): the documents of a shard are concatenated and cut into
non-overlapping windows of ``max_seq_len + 1`` tokens; a window ``w`` trains ``input = w[:-1]``, ``targets =
w[1:]``, so every token lies in exactly one window and no compute is spent on padding. The shard's last partial
window is kept and padded (targets -100); a 1-token tail (always an ``eos``, with nothing to predict) is not stored
and is counted in ``dropped_tail_tokens``. ``pack=False`` is MiniMind's pad mode: one document per row, truncated
to ``bos + ids[:max_seq_len-2] + eos`` (counted as ``truncated``), pads never trained.

Stored column ``ids``; batch ``input_ids``, ``targets``.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from minimind_ray.data.formats.base import BAD_TEXT, BadRecord, Format, Issues, RowEncoder, batch_length, \
    sample_id_tensor, shift


class PretrainEncoder(RowEncoder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stream: List[np.ndarray] = []  # packing: documents not yet cut into windows
        self._stream_len = 0

    def add(self, records: List[dict]) -> Issues:
        issues = []
        for i, ids in enumerate(self._encode([r["text"] for r in records])):
            if ids is None:
                issues.append((i, "bad_text", BAD_TEXT))
                continue
            if not self.pack and len(ids) > self.L - 2:
                issues.append((i, "truncated", f"longer than max_seq_len={self.L}"))
                ids = ids[: self.L - 2]
            doc = np.empty(len(ids) + 2, dtype=self.dtype)
            doc[0], doc[1:-1], doc[-1] = self.tok.bos_id, ids, self.tok.eos_id
            if self.pack:
                self._stream.append(doc)
                self._stream_len += len(doc)
            else:
                self._rows["ids"].append(doc)
        return issues

    def take(self, final: bool = False) -> Optional[Dict[str, List[np.ndarray]]]:
        if self.pack and (self._stream_len >= self.L + 1 or final):
            flat = np.concatenate(self._stream) if self._stream else np.zeros(0, self.dtype)
            w = self.L + 1
            full = len(flat) // w
            self._rows["ids"].extend(flat[: full * w].reshape(full, w))
            tail = flat[full * w:]
            self._stream, self._stream_len = ([tail], len(tail)) if len(tail) else ([], 0)
            if final:
                if len(tail) >= 2:
                    self._rows["ids"].append(tail)
                else:
                    self.dropped_tail_tokens += len(tail)
                self._stream, self._stream_len = [], 0
        return super().take(final)


class Pretrain(Format):
    name = "pretrain"
    record = "{text}"
    columns = ("ids",)
    packs = True
    cross_entropy = True
    encoder_class = PretrainEncoder

    def check(self, rec: dict) -> int:
        if rec.get("text") is None:
            raise BadRecord("missing_field", "field 'text' missing")
        if not isinstance(rec["text"], str):
            raise BadRecord("wrong_type", f"'text' is {type(rec['text']).__name__}, expected a string")
        return len(rec["text"])

    def collate(self, rows, sample_ids, pad_id, max_seq_len):
        """``input_ids``, ``targets`` (B, T), ``sample_ids``."""
        x, y = shift(rows["ids"], rows.get("mask"), batch_length(rows["ids"], max_seq_len), pad_id)
        return {"input_ids": x, "targets": y, "sample_ids": sample_id_tensor(sample_ids)}


FORMAT = Pretrain()
