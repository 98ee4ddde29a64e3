"""Record formats: how a jsonl record becomes stored token rows, and a row a training batch.

Six formats, following MiniMind's ``dataset/lm_dataset.py`` (83e52f6 / d65ef2c):

``pretrain`` ``{"text": ...}``
    Each document is ``bos + ids + eos``. Packed (default): the documents of a shard are
    concatenated and cut into non-overlapping windows of ``max_seq_len + 1`` tokens; a
    window ``w`` trains ``input = w[:-1]``, ``targets = w[1:]``, so every token lies in
    exactly one window and no compute is spent on padding. The shard's last partial
    window is kept and padded (targets -100); a 1-token tail (always an ``eos``, with
    nothing to predict) is not stored and is counted in ``dropped_tail_tokens``.
    ``pack=False`` is MiniMind's pad mode: one document per row, truncated to
    ``bos + ids[:max_seq_len-2] + eos`` (counted as ``truncated``), pads never trained.

``sft`` ``{"conversations": [{"role", "content", ...}, ...]}``
    Rendered with the tokenizer's chat template (``tools`` passed when the first system
    message carries ``functions`` (MiniMind2) or ``tools`` (minimind-3); JSON-string
    ``tools``/``tool_calls`` are parsed as minimind-3 does), truncated to ``max_seq_len``,
    and labelled exactly as MiniMind's ``generate_labels``: a label span starts after
    each occurrence of the token sequence of ``f"{bos}assistant\\n"`` and runs through
    the first following occurrence of the tokens of ``f"{eos}\\n"`` (included), or to the
    end of the truncated row. Deterministic: none of MiniMind's random system prompts or
    random removal of empty ``<think>`` blocks. One difference, on purpose: MiniMind
    labels after padding, so an assistant span cut by truncation also trains on the
    pad tokens after it; here labels are computed before padding and pads never train.
    SFT is not packed: the model attends with SDPA ``is_causal=True`` and has no
    block-diagonal mask, so packed conversations would attend across each other.

``dpo`` ``{"chosen": [...], "rejected": [...]}``
    Both conversations rendered and labelled like SFT, each with its own assistant mask.

``rlaif`` ``{"conversations": [..., {"role": "assistant", ...}]}``, ``prompt`` ``{"prompt", "answer"}``
    RL prompts (stages ``grpo``, ``ppo``): MiniMind's ``rlaif.jsonl`` (the last turn, the assistant's, is the one
    to generate; its content is kept as the reference answer), or a question with its known answer (a
    string or number). Rendered with the generation prompt; a longer prompt keeps its last ``max_seq_len``
    tokens (MiniMind's rule, counted ``truncated``). No random system prompt or thinking switch.
    ``agent_rl`` ``{"conversations", "gt"}`` (stage ``agent``, MiniMind's agent_rl.jsonl): an rlaif conversation
    with tools, its ``gt`` values and the messages and tools kept for the rollouts (data/prompt_formats.py).

Bad input never reaches training silently. :func:`parse_line` and :func:`check_record`
raise :class:`BadRecord` with a reason from :data:`REASONS`; the prepare job counts
them per reason (policy ``skip``) or stops at the first (``strict``).
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
from jinja2.exceptions import TemplateError

from minimind_ray.data.prompt_formats import agent_context, agent_problem, collate_prompts, gt_values
from minimind_ray.data.config import FORMATS, RL_FORMATS  # the one format list

REASONS = {
    "missing_file": "a source path matched no file",
    "empty_file": "a file with no bytes",
    "empty_line": "a blank line",
    "not_utf8": "bytes that are not UTF-8",
    "bad_json": "a line that is not valid JSON (e.g. truncated)",
    "missing_field": "the record lacks a field its format needs",
    "wrong_type": "a field has the wrong type (e.g. a non-string text) or an unknown role",
    "no_labels": "sft/dpo: no assistant token left to train on (no assistant turn, or truncated before it)",
    "bad_text": "valid JSON whose text is not valid Unicode (a lone surrogate such as \\ud800)",
    "too_long": "longer than data.max_record_chars (its jsonl line; a Parquet row's text fields)",
    "truncated_file": "a .jsonl.gz that breaks off or is not gzip: the lines before the break are kept",
    "truncated": "longer than max_seq_len: truncated and KEPT (counted, not skipped)",
    "no_prompt": "rlaif/prompt: nothing to prompt with (an empty prompt, or no turn before the assistant's)",
}
ROLES = ("system", "user", "assistant", "tool")
_BAD_TEXT = "text holds a lone surrogate (e.g. \\ud800), which is not Unicode and cannot be tokenized"
COLUMNS = {"pretrain": ["ids"], "sft": ["ids", "mask"],  # stored list columns of each format
           "dpo": ["chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"],
           "rlaif": ["prompt_ids", "answer_utf8"], "prompt": ["prompt_ids", "answer_utf8"],
           "agent_rl": ["prompt_ids", "answer_utf8", "context_utf8"]}


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


def _check_messages(rec: dict, field: str) -> None:
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


def check_record(fmt: str, rec: dict, max_chars: Optional[int] = None) -> None:
    """Raise BadRecord(missing_field | wrong_type) unless ``rec`` has what ``fmt`` needs, or
    BadRecord(too_long) if its text fields hold more than ``max_chars`` characters (used for
    Parquet rows; a jsonl line was measured whole by :func:`parse_line`)."""
    if fmt == "pretrain":
        if rec.get("text") is None:
            raise BadRecord("missing_field", "field 'text' missing")
        if not isinstance(rec["text"], str):
            raise BadRecord("wrong_type", f"'text' is {type(rec['text']).__name__}, expected a string")
        chars = len(rec["text"])
    elif fmt in ("sft", "dpo"):
        fields = ["conversations"] if fmt == "sft" else ["chosen", "rejected"]
        for field in fields:
            _check_messages(rec, field)
        chars = sum(len(m["content"]) for field in fields for m in rec[field])
    elif fmt in RL_FORMATS:
        chars = _check_prompt_record(fmt, rec)
    else:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    if max_chars is not None and chars > max_chars:
        raise too_long(chars, max_chars)


def _check_prompt_record(fmt: str, rec: dict) -> int:
    """The rlaif/prompt checks of :func:`check_record`; returns the record's text length."""
    if fmt in ("rlaif", "agent_rl"):
        _check_messages(rec, "conversations")
        conv = rec["conversations"]
        if conv and conv[-1]["role"] != "assistant":
            raise BadRecord("wrong_type", f"'conversations[-1].role' is {conv[-1]['role']!r}, expected 'assistant'")
        if len(conv) < 2:
            raise BadRecord("no_prompt", "'conversations' has no turn before the assistant's")
        if fmt == "agent_rl" and agent_problem(rec):
            raise BadRecord(*agent_problem(rec))
        return sum(len(m["content"]) for m in conv) + len(str(rec.get("gt", "")))
    for key, types, expected in (("prompt", (str,), "a string"), ("answer", (str, int, float), "a string or number")):
        if rec.get(key) is None:
            raise BadRecord("missing_field", f"field '{key}' missing")
        if not isinstance(rec[key], types) or isinstance(rec[key], bool):
            raise BadRecord("wrong_type", f"'{key}' is {type(rec[key]).__name__}, expected {expected}")
    if not rec["prompt"].strip():
        raise BadRecord("no_prompt", "'prompt' is empty")
    return len(rec["prompt"]) + len(str(rec["answer"]))


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


class Encoder:
    """Turns batches of checked records of one shard into stored rows (numpy arrays).

    Stored columns: pretrain ``ids``; sft ``ids``, ``mask``; dpo ``chosen_ids``,
    ``chosen_mask``, ``rejected_ids``, ``rejected_mask`` (ids in :func:`id_dtype`, masks
    uint8). Rows are kept unshifted; :func:`collate` shifts them into (input, target).
    """

    def __init__(self, fmt: str, tokenizer, max_seq_len: int, pack: bool = True):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
        self.fmt, self.tok, self.L, self.pack = fmt, tokenizer, max_seq_len, pack and fmt == "pretrain"
        self.dtype = id_dtype(tokenizer.vocab_size)
        self.start_seq = tokenizer.encode(f"{tokenizer.bos_token}assistant\n")
        self.end_seq = tokenizer.encode(f"{tokenizer.eos_token}\n")
        self.columns = COLUMNS[fmt]
        self._rows: Dict[str, List[np.ndarray]] = {c: [] for c in self.columns}
        self._stream: List[np.ndarray] = []  # pretrain pack: documents not yet cut into windows
        self._stream_len = 0
        self.dropped_tail_tokens = 0

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

    def dtype_of(self, column: str):
        return np.uint8 if column.endswith(("mask", "_utf8")) else self.dtype

    def schema(self) -> pa.Schema:
        return pa.schema([pa.field("sample_id", pa.int64())] +
                         [pa.field(c, pa.list_(pa.from_numpy_dtype(self.dtype_of(c)))) for c in self.columns])

    def add(self, records: List[dict]) -> List[Tuple[int, str, str]]:
        """Encode checked records; return [(index, reason, detail)] for rows truncated
        (kept) and for records dropped (no labels, or a conversation the template rejects)."""
        if self.fmt == "pretrain":
            return self._add_pretrain([r["text"] for r in records])
        if self.fmt in RL_FORMATS:
            return self._add_prompts(records)
        keys = ["conversations"] if self.fmt == "sft" else ["chosen", "rejected"]
        issues, texts, kept = [], [], []
        for i, r in enumerate(records):
            try:
                texts += [render_chat(self.tok, r[k]) for k in keys]
                kept.append(i)
            except BadRecord as e:
                issues.append((i, e.reason, e.detail))
        encoded = self._encode(texts)
        for j, i in enumerate(kept):
            sides, truncated = [], False
            both = encoded[j * len(keys):(j + 1) * len(keys)]
            if any(ids is None for ids in both):
                issues.append((i, "bad_text", _BAD_TEXT))
                continue
            for ids in both:
                truncated |= len(ids) > self.L
                arr = np.asarray(ids[: self.L], dtype=self.dtype)
                sides.append((arr, assistant_mask(arr, self.start_seq, self.end_seq)))
            if not all(m[1:].any() for _, m in sides):
                issues.append((i, "no_labels", "no assistant tokens within max_seq_len"))
                continue
            if truncated:
                issues.append((i, "truncated", f"longer than max_seq_len={self.L}"))
            prefixes = [""] if self.fmt == "sft" else ["chosen_", "rejected_"]
            for prefix, (arr, m) in zip(prefixes, sides):
                self._rows[prefix + "ids"].append(arr)
                self._rows[prefix + "mask"].append(m.astype(np.uint8))
        return issues

    def _add_pretrain(self, texts: List[str]) -> List[Tuple[int, str, str]]:
        issues = []
        for i, ids in enumerate(self._encode(texts)):
            if ids is None:
                issues.append((i, "bad_text", _BAD_TEXT))
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

    def _add_prompts(self, records: List[dict]) -> List[Tuple[int, str, str]]:
        issues, texts, answers, kept, contexts = [], [], [], [], []
        for i, r in enumerate(records):
            rlaif, agent = self.fmt != "prompt", self.fmt == "agent_rl"
            try:
                texts.append(render_chat(self.tok, r["conversations"][:-1] if rlaif else
                                         [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True))
                answers.append(json.dumps(gt_values(r), ensure_ascii=False) if agent else  # agent_rl: gt, and the
                               r["conversations"][-1]["content"] if rlaif else str(r["answer"]))  # messages + tools
                contexts.append(np.frombuffer(agent_context(r).encode("utf-8"), np.uint8) if agent else None)
                kept.append(i)
            except BadRecord as e:
                issues.append((i, e.reason, e.detail))
        for i, ids, answer, context in zip(kept, self._encode(texts), answers, contexts):
            try:
                answer_bytes = np.frombuffer(answer.encode("utf-8"), dtype=np.uint8)
            except UnicodeEncodeError:  # a lone surrogate
                ids = None
            if ids is None:
                issues.append((i, "bad_text", _BAD_TEXT))
                continue
            if len(ids) > self.L:  # MiniMind keeps the prompt's end: the question and the generation prompt
                issues.append((i, "truncated", f"prompt longer than max_seq_len={self.L}: kept its last tokens"))
            self._rows["prompt_ids"].append(np.asarray(ids[-self.L:], dtype=self.dtype))
            self._rows["answer_utf8"].append(answer_bytes)
            if context is not None:
                self._rows["context_utf8"].append(context)
        return issues

    def take(self, final: bool = False) -> Optional[Dict[str, List[np.ndarray]]]:
        """The rows ready so far (column -> list of arrays), or None. With ``final`` the
        packed stream's partial last window is flushed too."""
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
        if not self._rows[self.columns[0]]:
            return None
        rows, self._rows = self._rows, {c: [] for c in self.columns}
        return rows


def to_arrow(values: List[np.ndarray], dtype) -> pa.ListArray:
    """A list column from numpy rows without a Python loop over elements."""
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(values).astype(dtype, copy=False) if values else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _shift(rows_ids: List[np.ndarray], rows_mask: Optional[List[np.ndarray]], T: int, pad_id: int):
    """(input, target) int64 arrays of shape (B, T): input = ids[:-1], target = ids[1:] where
    labelled, -100 elsewhere and on pads."""
    import torch

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


def collate(fmt: str, rows: Dict[str, List[np.ndarray]], sample_ids: np.ndarray, pad_id: int,
            max_seq_len: int) -> dict:
    """Stored rows -> one micro-batch of tensors (pre-shifted targets, -100 = no loss).

    pretrain/sft: ``input_ids``, ``targets``; dpo: ``chosen_input_ids``,
    ``chosen_targets``, ``rejected_input_ids``, ``rejected_targets`` (one common length,
    so the objective can run both in one forward); all with ``sample_ids``. The length
    T is the longest row in this micro-batch rounded up to a multiple of 8 (kernels
    like aligned shapes), capped at ``max_seq_len``: short SFT rows do not pay for a
    full ``max_seq_len`` of padding. Packed pretrain rows are full, so T = max_seq_len.
    """
    import torch

    if fmt in RL_FORMATS:
        return collate_prompts(rows, sample_ids, pad_id)
    sides = [""] if fmt != "dpo" else ["chosen_", "rejected_"]
    longest = max(len(r) - 1 for s in sides for r in rows[s + "ids"])
    T = min(max_seq_len, _round8(max(longest, 1)))
    out = {}
    for s in sides:
        x, y = _shift(rows[s + "ids"], rows.get(s + "mask"), T, pad_id)
        out[s + "input_ids"], out[s + "targets"] = x, y
    out["sample_ids"] = torch.from_numpy(np.asarray(sample_ids, dtype=np.int64))
    return out
