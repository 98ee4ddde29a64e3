"""Replies: token ids -> text deltas (stop strings, minimind-3's thinking split, ``<tool_call>`` blocks),
per-choice state while a request's tokens arrive, and OpenAI's response bodies and stream chunks
for chat completions and (text) completions.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

THINK_END = "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def _held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    return max((n for n in range(len(marker) - 1, 0, -1) if text.endswith(marker[:n])), default=0)


class ToolCallText:
    """Reply text -> ``("content", text)`` and ``("tool_call", call)`` events, as MiniMind's models write
    tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks.

    Text that may be the start of a block is held back; a complete block whose JSON is an object with a
    known ``name`` becomes a call. A malformed block (bad JSON, no name, an unknown function) stays in the
    reply as text and is logged as a warning: never an error. ``prefix`` is text the server put at the
    start of the reply (a forced ``tool_choice``); ``single`` (``parallel_tool_calls: false``) ends the
    reply after the first call. Whitespace around calls is not content."""

    def __init__(self, names: Sequence[str], prefix: str = "", single: bool = False):
        self.names, self.single = set(names), single
        self.buf, self.in_call, self.after_call = "", False, False
        self.calls: List[dict] = []
        self.malformed = 0
        self.done = False  # single: the one call is in
        self._pending: List[Tuple[str, Any]] = []
        if prefix:
            self._pending = self.push(prefix)

    def push(self, text: str) -> List[Tuple[str, Any]]:
        if self.done:
            return []
        out, self._pending = self._pending, []
        self.buf += text
        while True:
            if not self.in_call:
                i = self.buf.find(CALL_OPEN)
                if i < 0:
                    # hold a tail that may start a block, and the whitespace before it (not content
                    # if a call follows)
                    head = self.buf[:len(self.buf) - _held_prefix(self.buf, CALL_OPEN)]
                    keep = len(self.buf) - len(head.rstrip())
                    out += self._content(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out += self._content(self.buf[:i].rstrip())
                self.buf, self.in_call = self.buf[i:], True
            j = self.buf.find(CALL_CLOSE)
            if j < 0:
                return out
            block, self.buf = self.buf[:j + len(CALL_CLOSE)], self.buf[j + len(CALL_CLOSE):]
            self.in_call = False
            call = self._parse(block[len(CALL_OPEN):-len(CALL_CLOSE)])
            if call is None:
                out += self._content(block, keep_space=True)
                continue
            self.calls.append(call)
            self.after_call = True
            out.append(("tool_call", call))
            if self.single:
                self.done = True
                return out

    def finish(self) -> List[Tuple[str, Any]]:
        """What is held at the end: an unterminated block is text (and a warning)."""
        out, self._pending = self._pending, []
        if self.in_call:
            self._warn("an unterminated <tool_call> block")
            out += self._content(self.buf, keep_space=True)
        elif not (self.calls and self.buf.isspace()):
            out += self._content(self.buf, keep_space=True)
        self.buf, self.in_call = "", False
        return out

    def _content(self, text: str, keep_space: bool = False) -> List[Tuple[str, Any]]:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        if not text or (not keep_space and not text.strip() and self.calls):
            return []
        return [("content", text)]

    def _parse(self, inner: str) -> Optional[dict]:
        try:
            obj = json.loads(inner)
        except ValueError:
            return self._warn("a <tool_call> block that is not JSON")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return self._warn("a <tool_call> block without a function name")
        if self.names and obj["name"] not in self.names:
            return self._warn(f"a call of {obj['name'][:40]!r}, which is not one of the request's tools")
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError:
                return self._warn("a <tool_call> whose arguments are not JSON")
        else:
            args = json.dumps(args, ensure_ascii=False)
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": obj["name"], "arguments": args}}

    def _warn(self, what: str) -> None:
        self.malformed += 1
        log.warning("tool call parsing: %s; returned as text", what)
        return None


class ReplyText:
    """Token ids -> text deltas of a reply, as ``(field, value)`` pairs: ``content`` or
    ``reasoning_content`` text, or ``tool_call`` (a call dict) when ``tools`` parses calls.

    * Multi-byte characters are never split (the same decoder ``minimind-ray generate`` uses).
    * Stop strings: text that might be the start of one is held back; when one appears the
      reply ends before it (``stopped`` becomes True) and the caller stops generation.
    * Thinking (``reasoning=True``, when the prompt opened a ``<think>`` block): text before
      ``</think>`` is reasoning, the rest is content, leading newlines dropped, as MiniMind's
      server splits it.
    """

    def __init__(self, decoder, stop: List[str], reasoning: bool, tools: Optional[ToolCallText] = None):
        self.decoder, self.stop, self.tools = decoder, stop, tools
        self.text, self.released = "", 0  # all decoded text; how much of it is out
        self.stopped = False
        self.in_reasoning = reasoning
        self._split_buf = ""  # released reasoning text held back: it may be the start of </think>
        self._after_think = False  # just left the reasoning: drop the newlines before the answer
        self.content, self.reasoning = [], []

    @property
    def tool_calls(self) -> List[dict]:
        return self.tools.calls if self.tools else []

    def push(self, token_id: int) -> List[Tuple[str, Any]]:
        if self.stopped:
            return []
        self.text += self.decoder.push(token_id)
        end = len(self.text)
        for s in self.stop:
            i = self.text.find(s, max(0, self.released - len(s) + 1))
            if i >= 0 and i < end:
                end, self.stopped = i, True
        if not self.stopped:  # hold back a tail that may grow into a stop string
            end = len(self.text) - max((_held_prefix(self.text, s) for s in self.stop), default=0)
        out = self._release(end)
        if self.tools and self.tools.done:
            self.stopped = True  # the one call allowed is in
        return out

    def finish(self) -> List[Tuple[str, Any]]:
        """Whatever was held back, at the end of the reply."""
        out = [] if self.stopped else self._release(len(self.text))
        if self._split_buf:  # a held tail that never became </think>
            out += self._out("reasoning_content", self._split_buf)
            self._split_buf = ""
        if self.tools:
            out += self._record(self.tools.finish())
        return out

    def _release(self, end: int) -> List[Tuple[str, Any]]:
        if end <= self.released:
            return []
        piece, self.released = self.text[self.released:end], end
        out = []
        if self.in_reasoning:
            buf = self._split_buf + piece
            i = buf.find(THINK_END)
            if i < 0:  # all reasoning, but for a tail that may be the start of </think>
                hold = _held_prefix(buf, THINK_END)
                self._split_buf = buf[len(buf) - hold:]
                return self._out("reasoning_content", buf[:len(buf) - hold])
            out += self._out("reasoning_content", buf[:i])
            piece, self._split_buf = buf[i + len(THINK_END):], ""
            self.in_reasoning, self._after_think = False, True
        if self._after_think:
            piece = piece.lstrip("\n")
            self._after_think = not piece
        return out + self._out("content", piece)

    def _out(self, field: str, text: str) -> List[Tuple[str, Any]]:
        if not text:
            return []
        if field == "content" and self.tools:
            return self._record(self.tools.push(text))
        (self.reasoning if field == "reasoning_content" else self.content).append(text)
        return [(field, text)]

    def _record(self, events: List[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
        for field, value in events:
            if field == "content":
                self.content.append(value)
        return events


class Choice:
    """One sample of a request while its engine events arrive: the reply text, its token count, how it
    ended and, when asked for, its tokens' log-probs."""

    def __init__(self, index: int, reply: ReplyText, eos_id: int, stop_at_eos: bool):
        self.index, self.reply, self.eos_id, self.stop_at_eos = index, reply, eos_id, stop_at_eos
        self.completion_tokens = 0  # every token the model produced for the reply (end-of-turn included)
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.logprobs: List[tuple] = []  # (token id, logprob, [(id, logprob), ...]) of each reply token
        self.prompt_logprobs: Optional[list] = None  # echo: [(logprob or None, top), ...] per prompt token
        self.final = False  # its last deltas (and finish reason) are out
        self.echo: Optional[tuple] = None  # completions' echo: (prompt text, prompt ids)

    @property
    def done(self) -> bool:
        return self.reply.stopped or self.finish_reason is not None or self.error is not None

    def on_event(self, event: tuple, abort: Callable[[str], None]) -> List[Tuple[str, Any]]:
        """The deltas ``event`` adds; calls ``abort`` when the reply ends before generation does."""
        kind = event[0]
        if self.done:  # tokens made before the engine saw the abort (stop string, timeout): not the reply's
            return []
        if kind == "token":
            self.completion_tokens += 1
            token = event[1]
            if self.stop_at_eos and token == self.eos_id:  # the end-of-turn token is not text
                return []
            if len(event) > 2:
                self.logprobs.append((token, *event[2]))
            deltas = self.reply.push(token)
            if self.reply.stopped:
                abort("stop")
                self.finish_reason = "stop"
            return deltas
        if kind == "prompt_logprobs":
            self.prompt_logprobs = event[1]
        elif kind == "end":
            self.finish_reason = self.finish_reason or event[1]
        else:
            self.error = event[1]
        return []

    def final_reason(self) -> Optional[str]:
        return "tool_calls" if self.reply.tool_calls and self.finish_reason == "stop" else self.finish_reason


# --------------------------------------------------------------------------- response bodies


def new_id(prefix: str) -> Tuple[str, int]:
    return f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(entries: List[tuple], piece) -> dict:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``;
    ``piece(id)`` -> (text, bytes) of a token."""
    def one(token_id, lp):
        text, raw = piece(token_id)
        return {"token": text, "logprob": lp, "bytes": raw}

    return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top in entries],
            "refusal": None}


def completion_logprobs(entries: List[tuple], piece, offset: int = 0) -> dict:
    """OpenAI's (legacy) completions ``logprobs``: parallel lists of tokens, their log-probs (None for a
    prompt's first token), the top alternatives as ``{token: logprob}`` and each token's text offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for token_id, lp, top in entries:
        text = piece(token_id)[0]
        tokens.append(text)
        lps.append(lp)
        tops.append(None if top is None else {piece(i)[0]: v for i, v in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_message(choice: Choice) -> dict:
    reply = choice.reply
    content = "".join(reply.content)
    message: Dict[str, Any] = {"role": "assistant", "content": content if content or not reply.tool_calls else None}
    if reply.reasoning:
        message["reasoning_content"] = "".join(reply.reasoning)
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return message


def chat_body(cid: str, created: int, model: str, choices: List[dict], use: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": use}


def completion_body(cid: str, created: int, model: str, choices: List[dict], use: dict) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": use}


def chunk(obj: str, cid: str, created: int, model: str, choices: Optional[List[dict]],
          use: Optional[dict] = None) -> str:
    """One server-sent event of a streamed reply (``obj``: chat.completion.chunk or text_completion);
    ``choices=None`` is the trailing usage-only chunk."""
    body: Dict[str, Any] = {"id": cid, "object": obj, "created": created, "model": model, "choices": choices or []}
    if use is not None:
        body["usage"] = use
    return sse(body)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
