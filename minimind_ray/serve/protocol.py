"""The OpenAI chat-completions wire format: request validation, OpenAI-style errors, reply text
(stop strings, minimind-3's thinking split) and response bodies.

Fields taken (beyond OpenAI's ``model``, ``messages``, ``stream``, ``stream_options``,
``temperature``, ``top_p``, ``max_tokens``/``max_completion_tokens``, ``stop``, ``seed``, ``n``=1):

* ``chat_template_kwargs: {"enable_thinking": bool}`` (or ``open_thinking``), and a top-level
  ``open_thinking``: the thinking switch, as MiniMind's own server takes it;
* ``top_k`` and ``ignore_eos`` (as vLLM names them).

Every bad request becomes :class:`APIError`: a 4xx status and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

THINK_END = "</think>"


class APIError(Exception):
    """A request the server refuses: ``status`` (4xx) and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------- the request


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1.0 is not an int; unknown fields (user, logprobs, ...) are ignored
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[str, List[TextPart], None] = None

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": text}


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    messages: List[ChatMessage] = Field(min_length=1)
    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = None
    n: int = 1
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    open_thinking: Optional[bool] = None
    ignore_eos: bool = False
    tools: Optional[list] = None

    def think(self) -> Optional[bool]:
        """The thinking switch: chat_template_kwargs.enable_thinking / open_thinking, or open_thinking."""
        kw = self.chat_template_kwargs or {}
        for key in ("enable_thinking", "open_thinking"):
            if key in kw:
                if not isinstance(kw[key], bool):
                    raise APIError(400, f"chat_template_kwargs.{key} must be true or false",
                                   f"chat_template_kwargs.{key}")
                return kw[key]
        return self.open_thinking

    def stop_strings(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def parse_request(raw: bytes, max_tokens_cap: int) -> ChatCompletionRequest:
    """Body bytes -> a validated request, or APIError(400) naming the field."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    if req.n != 1:
        raise APIError(400, "n: only n=1 is supported", "n")
    if req.tools:
        raise APIError(400, "tools: tool calling is not supported by this server", "tools")
    stops = req.stop_strings()
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError(400, "stop: up to 4 non-empty strings", "stop")
    asked = requested_max_tokens(req)
    if asked is not None and asked <= 0:
        raise APIError(400, f"max_tokens must be at least 1 (got {asked})", "max_tokens")
    if asked is not None and asked > max_tokens_cap:
        raise APIError(400, f"max_tokens {asked} is over this server's cap of {max_tokens_cap}", "max_tokens")
    req.think()  # type-checks the switch
    return req


def _validation_error(e: ValidationError) -> APIError:
    """The first invalid field as one line: its dotted path (``messages.0.role``) and what it should be.
    A field with several allowed types fails once per type; those messages are joined."""
    def path(loc) -> str:  # pydantic appends the union member it tried ('str', 'list[TextPart]'): drop it
        parts = [str(p) for p in loc]
        while parts and (parts[-1] in _TYPE_TAGS or "[" in parts[-1]):
            parts.pop()
        return ".".join(parts)

    errors = e.errors()
    field = path(errors[0]["loc"])
    same = [err for err in errors if path(err["loc"]) == field]
    msgs = list(dict.fromkeys(err["msg"] for err in same))
    what = " or ".join([msgs[0]] + [m.removeprefix("Input should be ") for m in msgs[1:]])
    got = errors[0].get("input")
    shown = "" if errors[0]["type"] == "missing" or isinstance(got, (dict, list)) else f" (got {got!r})"
    return APIError(400, f"{field}: {what}{shown}", field)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def requested_max_tokens(req: ChatCompletionRequest) -> Optional[int]:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def check_prompt_length(n_prompt: int, context: int) -> None:
    if n_prompt >= context:
        raise APIError(400, f"the prompt is {n_prompt} tokens; this model's context is {context} tokens "
                            f"(prompt + reply)", "messages", "context_length_exceeded")


# --------------------------------------------------------------------------- reply text


class ReplyText:
    """Token ids -> text deltas of a reply, as ``(field, text)`` pairs with field ``content`` or
    ``reasoning_content``.

    * Multi-byte characters are never split (the same decoder ``minimind-ray generate`` uses).
    * Stop strings: text that might be the start of one is held back; when one appears the
      reply ends before it (``stopped`` becomes True) and the caller stops generation.
    * Thinking (``reasoning=True``, when the prompt opened a ``<think>`` block): text before
      ``</think>`` is reasoning, the rest is content, leading newlines dropped, as MiniMind's
      server splits it.
    """

    def __init__(self, decoder, stop: List[str], reasoning: bool):
        self.decoder, self.stop = decoder, stop
        self.text, self.released = "", 0  # all decoded text; how much of it is out
        self.stopped = False
        self.in_reasoning = reasoning
        self._split_buf = ""  # released reasoning text held back: it may be the start of </think>
        self._after_think = False  # just left the reasoning: drop the newlines before the answer
        self.content, self.reasoning = [], []

    def push(self, token_id: int) -> List[Tuple[str, str]]:
        if self.stopped:
            return []
        self.text += self.decoder.push(token_id)
        end = len(self.text)
        for s in self.stop:
            i = self.text.find(s, max(0, self.released - len(s) + 1))
            if i >= 0 and i < end:
                end, self.stopped = i, True
        if not self.stopped:  # hold back a tail that may grow into a stop string
            hold = max((n for s in self.stop for n in range(len(s) - 1, 0, -1) if self.text.endswith(s[:n])),
                       default=0)
            end = len(self.text) - hold
        return self._release(end)

    def finish(self) -> List[Tuple[str, str]]:
        """Whatever was held back, at the end of the reply."""
        out = [] if self.stopped else self._release(len(self.text))
        if self._split_buf:  # a held tail that never became </think>
            out += self._out("reasoning_content", self._split_buf)
            self._split_buf = ""
        return out

    def _release(self, end: int) -> List[Tuple[str, str]]:
        if end <= self.released:
            return []
        piece, self.released = self.text[self.released:end], end
        out = []
        if self.in_reasoning:
            buf = self._split_buf + piece
            i = buf.find(THINK_END)
            if i < 0:  # all reasoning, but for a tail that may be the start of </think>
                hold = max((n for n in range(len(THINK_END) - 1, 0, -1) if buf.endswith(THINK_END[:n])), default=0)
                self._split_buf = buf[len(buf) - hold:]
                return self._out("reasoning_content", buf[:len(buf) - hold])
            out += self._out("reasoning_content", buf[:i])
            piece, self._split_buf = buf[i + len(THINK_END):], ""
            self.in_reasoning, self._after_think = False, True
        if self._after_think:
            piece = piece.lstrip("\n")
            self._after_think = not piece
        return out + self._out("content", piece)

    def _out(self, field: str, text: str) -> List[Tuple[str, str]]:
        if not text:
            return []
        (self.reasoning if field == "reasoning_content" else self.content).append(text)
        return [(field, text)]


# --------------------------------------------------------------------------- response bodies


def new_completion_id() -> Tuple[str, int]:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(cid: str, created: int, model: str, reply: ReplyText, finish_reason: str, use: dict) -> dict:
    message = {"role": "assistant", "content": "".join(reply.content)}
    if reply.reasoning:
        message["reasoning_content"] = "".join(reply.reasoning)
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": use}


def chunk(cid: str, created: int, model: str, delta: Optional[dict], finish_reason: Optional[str] = None,
          use: Optional[dict] = None) -> str:
    """One server-sent event of a streamed reply. ``delta=None`` is the trailing usage-only chunk."""
    body: Dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [] if delta is None else
                            [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
    if use is not None:
        body["usage"] = use
    return sse(body)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
