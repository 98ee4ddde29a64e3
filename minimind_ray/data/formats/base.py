"""What every record format shares: the :class:`Format` a format module defines, the :class:`RowEncoder` that turns
its checked records into stored rows, the bad-record reasons, and the pieces of more than one format (a line's JSON,
a conversation's checks, the chat template, MiniMind's assistant mask, the shift into (input, target)).

A format (``data/formats/<name>.py``, registered in ``data/formats/__init__.py``) is four things, each used at one
time of a run: at prepare time its record check (:meth:`Format.check`) and its encoding (:meth:`Format.encoder`,
records -> rows of its ``columns``); in a training worker its collation (:meth:`Format.collate`, stored rows -> one
micro-batch of tensors). Rows are stored unshifted; the collation shifts them.

Bad input never reaches training silently. :func:`parse_line` and a format's check raise :class:`BadRecord` with a
reason from :data:`REASONS`; the prepare job counts them per reason (policy ``skip``) or stops at the first
(``strict``), naming the file and line; the detail names the field.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
from jinja2.exceptions import TemplateError

REASONS = {
    "missing_file": "a source path matched no file",
    "empty_file": "a file with no bytes",
    "empty_line": "a blank line",
    "not_utf8": "bytes that are not UTF-8",
    "bad_json": "a line that is not valid JSON (e.g. truncated)",
    "missing_field": "the record lacks a field its format needs",
    "wrong_type": "a field has the wrong type (e.g. a non-string text) or an unknown role",
    "no_labels": "a conversation format: no assistant token left to train on (no assistant turn, or truncated "
                 "before it)",
    "bad_text": "valid JSON whose text is not valid Unicode (a lone surrogate such as \\ud800)",
    "too_long": "longer than data.max_record_chars (its jsonl line; a Parquet row's text fields)",
    "truncated_file": "a .jsonl.gz that breaks off or is not gzip: the lines before the break are kept",
    "truncated": "longer than max_seq_len: truncated and KEPT (counted, not skipped)",
    "no_prompt": "a prompt format: nothing to prompt with (an empty prompt, or no turn before the assistant's)",
}
ROLES = ("system", "user", "assistant", "tool")
BAD_TEXT = "text holds a lone surrogate (e.g. \\ud800), which is not Unicode and cannot be tokenized"
Issues = List[Tuple[int, str, str]]  # (index of the record in its batch, reason, detail)


class BadRecord(ValueError):
    """A record that cannot be used; ``reason`` is a key of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def id_dtype(vocab_size: int):
    """uint16 when every id fits (MiniMind's 6400): a quarter of int64's bytes on disk and in RAM."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def too_long(chars: int, max_chars: int) -> BadRecord:
    return BadRecord("too_long", f"{chars} characters > data.max_record_chars={max_chars}")


def parse_line(raw: bytes, max_chars: Optional[int] = None) -> dict:
    """One jsonl line -> a dict, or BadRecord(empty_line | not_utf8 | too_long | bad_json | wrong_type)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord("not_utf8", f"invalid byte at offset {e.start}") from None
    if not text.strip():
        raise BadRecord("empty_line", "blank line")
    if max_chars is not None and len(text) > max_chars:
        raise too_long(len(text), max_chars)
    try:
        rec = json.loads(text)
    except ValueError as e:
        raise BadRecord("bad_json", str(e)) from None
    except RecursionError:  # valid JSON nested deeper than Python's recursion limit
        raise BadRecord("bad_json", "nested too deep to parse") from None
    if not isinstance(rec, dict):
        raise BadRecord("wrong_type", f"record is a JSON {type(rec).__name__}, expected an object")
    return rec


def check_messages(rec: dict, field: str) -> int:
    """BadRecord(missing_field | wrong_type) unless ``rec[field]`` is a list of {role, content} messages with known
    roles; returns the characters of their contents."""
    if field not in rec or rec[field] is None:
        raise BadRecord("missing_field", f"field '{field}' missing")
    msgs = rec[field]
    if not isinstance(msgs, list):
        raise BadRecord("wrong_type", f"'{field}' is {type(msgs).__name__}, expected a list of messages")
    for i, m in enumerate(msgs):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise BadRecord("wrong_type", f"'{where}' is {type(m).__name__}, expected an object")
        for key in ("role", "content"):
            if m.get(key) is None:
                raise BadRecord("missing_field", f"'{where}.{key}' missing")
            if not isinstance(m[key], str):
                raise BadRecord("wrong_type", f"'{where}.{key}' is {type(m[key]).__name__}, expected a string")
        if m["role"] not in ROLES:
            raise BadRecord("wrong_type", f"'{where}.role' is {m['role']!r}, expected one of {ROLES}")
    return sum(len(m["content"]) for m in msgs)


def check_reply(rec: dict, field: str = "conversations") -> int:
    """:func:`check_messages`, and the conversation ends with the assistant's turn after at least one other (an RL
    prompt's reference answer, a KTO record's judged reply): BadRecord(wrong_type | no_prompt) otherwise."""
    chars = check_messages(rec, field)
    conv = rec[field]
    if conv and conv[-1]["role"] != "assistant":
        raise BadRecord("wrong_type", f"'{field}[-1].role' is {conv[-1]['role']!r}, expected 'assistant'")
    if len(conv) < 2:
        raise BadRecord("no_prompt", f"'{field}' has no turn before the assistant's")
    return chars


def render_chat(tokenizer, messages: List[dict], add_generation_prompt: bool = False) -> str:
    """A conversation as training text, with tools taken from the first system message; with
    ``add_generation_prompt`` it ends where the next assistant turn starts (an RL prompt)."""
    tools = None
    msgs = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if isinstance(m.get("tool_calls"), str):
            try:
                m["tool_calls"] = json.loads(m["tool_calls"])
            except ValueError:
                raise BadRecord("wrong_type", "'tool_calls' is a string that is not JSON") from None
        msgs.append(m)
    if msgs and msgs[0]["role"] == "system":
        tools = msgs[0].get("functions") or msgs[0].get("tools")
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except ValueError:
                raise BadRecord("wrong_type", "'tools' is a string that is not JSON") from None
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tools or None)
    except (TemplateError, TypeError, RecursionError) as e:  # e.g. a template that raise_exception()s on role order
        raise BadRecord("wrong_type", f"chat template rejected the conversation: {e}") from None


def _find(ids: np.ndarray, seq: Sequence[int]) -> np.ndarray:
    """Start positions of every occurrence of ``seq`` in ``ids``."""
    n, k = len(ids), len(seq)
    if k == 0 or n < k:
        return np.zeros(0, dtype=np.int64)
    cand = np.flatnonzero(ids[: n - k + 1] == seq[0])
    for j in range(1, k):
        cand = cand[ids[cand + j] == seq[j]]
    return cand


def assistant_mask(ids: np.ndarray, start_seq: Sequence[int], end_seq: Sequence[int]) -> np.ndarray:
    """MiniMind's label rule as a boolean mask over ``ids`` (True = this token is a label).

    From each ``start_seq`` occurrence (searched left to right, resuming after the last
    span), label from just after it through the next ``end_seq`` inclusive, or to the end.
    """
    mask = np.zeros(len(ids), dtype=bool)
    starts, ends = _find(ids, start_seq), _find(ids, end_seq)
    resume = 0
    for s in starts:
        if s < resume:
            continue
        a = int(s) + len(start_seq)
        k = np.searchsorted(ends, a)
        e = int(ends[k]) + len(end_seq) if k < len(ends) else len(ids)
        mask[a:e] = True
        resume = e
    return mask


def to_arrow(values: List[np.ndarray], dtype) -> pa.ListArray:
    """A list column from numpy rows without a Python loop over elements."""
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(values).astype(dtype, copy=False) if values else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def batch_length(rows: Sequence[np.ndarray], max_seq_len: int) -> int:
    """A micro-batch's length T: its longest row's inputs (the row less its last token) rounded up to a multiple of 8
    (kernels like aligned shapes), capped at ``max_seq_len``: short rows do not pay for a full ``max_seq_len`` of
    padding. Packed pretrain rows are full, so T = max_seq_len there."""
    longest = max(len(r) - 1 for r in rows)
    return min(max_seq_len, (max(longest, 1) + 7) // 8 * 8)


def shift(rows_ids: List[np.ndarray], rows_mask: Optional[List[np.ndarray]], T: int, pad_id: int):
    """(input, target) int64 tensors of shape (B, T): input = ids[:-1], target = ids[1:] where
    labelled, -100 elsewhere and on pads."""
    import torch  # lazy: torch, in the training workers only (prepare never collates)

    B = len(rows_ids)
    x = np.full((B, T), pad_id, dtype=np.int64)
    y = np.full((B, T), -100, dtype=np.int64)
    for i, ids in enumerate(rows_ids):
        n = min(len(ids) - 1, T)
        x[i, :n] = ids[:n]
        y[i, :n] = ids[1:n + 1]
        if rows_mask is not None:
            y[i, :n][rows_mask[i][1:n + 1] == 0] = -100
    return torch.from_numpy(x), torch.from_numpy(y)


def sample_id_tensor(sample_ids):
    import torch  # lazy: torch, in the training workers only

    return torch.from_numpy(np.asarray(sample_ids, dtype=np.int64))


class RowEncoder:
    """Turns batches of checked records of one shard into stored rows (numpy arrays), one list per column of its
    format: token ids in :func:`id_dtype`, the format's ``byte_columns`` in uint8. A format's encoder subclasses it
    with :meth:`add`; :meth:`take` hands over what is ready."""

    def __init__(self, fmt: "Format", tokenizer, max_seq_len: int, pack: bool = True):
        self.format, self.fmt, self.tok, self.L = fmt, fmt.name, tokenizer, max_seq_len
        self.pack = pack and fmt.packs
        self.dtype = id_dtype(tokenizer.vocab_size)
        self.start_seq = tokenizer.encode(f"{tokenizer.bos_token}assistant\n")  # MiniMind's assistant span
        self.end_seq = tokenizer.encode(f"{tokenizer.eos_token}\n")
        self.columns = list(fmt.columns)
        self._rows: Dict[str, List[np.ndarray]] = {c: [] for c in self.columns}
        self.dropped_tail_tokens = 0  # pretrain's packing: the 1-token tail of a shard, not stored

    def _encode(self, texts: List[str]) -> List[Optional[List[int]]]:
        """Token ids of each text; None for a text that is not valid Unicode (a lone surrogate
        from a JSON escape such as \\ud800, which HF tokenizers refuse with a TypeError for the
        whole batch). The clean batch pays nothing: texts are checked one by one only after a failure."""
        try:
            return self.tok.encode_batch(texts)
        except TypeError:
            out = []
            for t in texts:
                try:
                    t.encode("utf-8")
                except UnicodeEncodeError:
                    out.append(None)
                else:
                    out.append(self.tok.encode(t))  # a TypeError here is not the text's fault: raise it
            return out

    def _labelled(self, ids: List[int]) -> Tuple[np.ndarray, np.ndarray, bool]:
        """A rendered conversation's ids truncated to max_seq_len, their assistant mask, and whether it was cut."""
        arr = np.asarray(ids[: self.L], dtype=self.dtype)
        return arr, assistant_mask(arr, self.start_seq, self.end_seq), len(ids) > self.L

    def dtype_of(self, column: str):
        return np.uint8 if column in self.format.byte_columns else self.dtype

    def schema(self) -> pa.Schema:
        return pa.schema([pa.field("sample_id", pa.int64())] +
                         [pa.field(c, pa.list_(pa.from_numpy_dtype(self.dtype_of(c)))) for c in self.columns])

    def add(self, records: List[dict]) -> Issues:
        """Encode checked records; return [(index, reason, detail)] for rows truncated
        (kept) and for records dropped (no labels, or a conversation the template rejects)."""
        raise NotImplementedError

    def take(self, final: bool = False) -> Optional[Dict[str, List[np.ndarray]]]:
        """The rows ready so far (column -> list of arrays), or None. With ``final`` everything held back is
        flushed too (pretrain's packed stream)."""
        if not self._rows[self.columns[0]]:
            return None
        rows, self._rows = self._rows, {c: [] for c in self.columns}
        return rows


class Format:
    """One record format. A format module defines a subclass and its instance ``FORMAT``; the registry
    (``data/formats/__init__.py:FORMAT_MODULES``) lists the module."""

    name: str = ""
    record: str = ""  # what a record holds, for --help ("{text}")
    columns: Tuple[str, ...] = ()  # its stored list columns, in order (after sample_id); the first is never empty
    byte_columns: Tuple[str, ...] = ()  # the columns stored as uint8 (masks, UTF-8 text, labels), not token ids
    packs: bool = False  # data.pack applies (pretrain's windows)
    # its batches are next-token `input_ids`/`targets` of text that a model imitates: the cross-entropy's eval loss,
    # perplexity and bits per byte mean something on it (evals/loss.py)
    cross_entropy: bool = False
    encoder_class = RowEncoder

    def check(self, rec: dict) -> int:
        """BadRecord(missing_field | wrong_type | no_prompt) unless ``rec`` has what this format needs; else the
        characters of its text fields (checked against data.max_record_chars for a Parquet row)."""
        raise NotImplementedError

    def encoder(self, tokenizer, max_seq_len: int, pack: bool = True) -> RowEncoder:
        return self.encoder_class(self, tokenizer, max_seq_len, pack)

    def collate(self, rows: Dict[str, List[np.ndarray]], sample_ids: np.ndarray, pad_id: int,
                max_seq_len: int) -> dict:
        """Stored rows -> one micro-batch of tensors (pre-shifted targets, -100 = no loss), with ``sample_ids``."""
        raise NotImplementedError
