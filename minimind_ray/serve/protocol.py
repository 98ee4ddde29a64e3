"""The OpenAI wire format of requests: what ``/v1/chat/completions`` and ``/v1/completions`` take,
checked so that no field is silently ignored, and OpenAI-style errors.

Every field a request may carry is in one of three groups (docs/serving.md lists them all, and
``tests/integration/test_serve_protocol.py`` checks the page against the tables here):

* **honoured**: a field of the request models below, used as OpenAI defines it;
* **inert** (:data:`INERT`): accepted, and changes nothing about the reply (``user``, ``metadata``...);
* **refused unless default** (:data:`REFUSED`): ``null`` or the default is accepted, any other
  value is a 400 naming the field, because this server cannot do what it asks (penalties,
  audio...).

Any other field is a 400 naming it ("unknown field"), and so is a string anywhere in the body
that is not valid Unicode text (a lone surrogate such as ``"\\ud800"``, valid JSON that the
tokenizer cannot take). Every bad request becomes :class:`APIError`: a 4xx status and OpenAI's
error body ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """A request the server refuses: ``status`` and OpenAI's error body; ``headers`` for the reply."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: str = "invalid_request_error", headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        def text(s):  # never a lone surrogate in a reply: the JSON encoder of the response would fail
            return None if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")

        return {"error": {"message": text(self.message), "type": self.type, "param": text(self.param),
                          "code": self.code}}


# --------------------------------------------------------------------------- the field groups

#: accepted, and nothing about the reply depends on them
INERT = {
    "user": "an end-user id for the caller's own records",
    "metadata": "the caller's key-value tags",
    "store": "this server stores no completions",
    "service_tier": "one tier here",
    "prompt_cache_key": "a cache hint",
    "safety_identifier": "an end-user id for abuse reports",
    "messages.N.name": "a participant name; MiniMind's chat template has no place for it",
    "messages.N.tool_call_id": "the template orders tool results by position",
    "messages.N.refusal, .annotations, .reasoning_content": "fields of a reply sent back as history",
    "stream_options.include_obfuscation": "no obfuscation padding is sent either way",
}

#: a value other than null or these defaults is refused, with the reason
REFUSED = {
    "frequency_penalty": (0, "penalties are not implemented"),
    "presence_penalty": (0, "penalties are not implemented"),
    "logit_bias": ({}, "logit_bias is not implemented"),
    "modalities": (["text"], "this model only writes text"),
    "audio": (None, "this model only writes text"),
    "prediction": (None, "predicted outputs are not implemented"),
    "reasoning_effort": (None, "use chat_template_kwargs.enable_thinking for minimind-3's thinking switch"),
    "web_search_options": (None, "this server has no web search"),
    "verbosity": (None, "not implemented"),
    "functions": (None, "deprecated by OpenAI: use tools"),
    "function_call": (None, "deprecated by OpenAI: use tool_choice"),
    "suffix": (None, "insertion (a suffix) is not implemented"),
    "best_of": (1, "best_of is not implemented; use n"),
}
REFUSED_CHAT = [f for f in REFUSED if f not in ("suffix", "best_of")]
REFUSED_COMPLETIONS = ["frequency_penalty", "presence_penalty", "logit_bias", "suffix", "best_of"]
TOP_LOGPROBS_MAX, COMPLETION_LOGPROBS_MAX, STOP_MAX = 20, 5, 4
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what torch.Generator.manual_seed takes


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1.0 is not an int; a field not declared here is an error
    model_config = ConfigDict(strict=True, extra="forbid")


# --------------------------------------------------------------------------- chat


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[TextPart], None] = None
    tool_calls: Optional[List[ToolCall]] = None  # assistant turns that called tools
    # inert (INERT): a reply's own fields come back when a client appends the message to its history
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None
    annotations: Optional[List[Any]] = None
    reasoning_content: Optional[str] = None
    audio: None = None
    function_call: None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])

    def as_template_message(self) -> dict:
        """The message as the chat template reads it (OpenAI's ``developer`` is a system turn)."""
        msg: Dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in self.tool_calls]
        return msg


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _Name(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _Name


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``, as OpenAI defines it; without ``schema``, any JSON object."""

    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None  # every reply follows the schema whatever it says: constrained decoding


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    def constraint_schema(self) -> Optional[Dict[str, Any]]:
        """The schema to constrain to; None for any JSON object (json_object, or json_schema without one)."""
        return self.json_schema.schema_ if self.json_schema else None


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None  # inert


class _Sampling(_Strict):
    """Fields both endpoints take."""

    model: Optional[str] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)  # vLLM's name; 0 = off
    max_tokens: Optional[int] = None
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: Optional[int] = Field(None, ge=1)
    ignore_eos: Optional[bool] = None  # vLLM's name: keep going past the end-of-turn token
    user: Optional[str] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, Any]] = None

    def structured(self) -> bool:
        """A response_format that constrains the reply (json_object or json_schema)."""
        fmt = getattr(self, "response_format", None)
        return fmt is not None and fmt.type != "text"

    def stop_strings(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def samples(self) -> int:
        return self.n or 1

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=TOP_LOGPROBS_MAX)
    tools: Optional[List[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # {"enable_thinking": bool}, as vLLM/MiniMind take it
    open_thinking: Optional[bool] = None  # MiniMind's own server's switch
    # inert
    metadata: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    # refused unless null/default
    modalities: Optional[List[str]] = None
    audio: Optional[Any] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[Any] = None
    verbosity: Optional[str] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None

    def think(self) -> Optional[bool]:
        """The thinking switch: chat_template_kwargs.enable_thinking / open_thinking, or open_thinking."""
        kw = self.chat_template_kwargs or {}
        for key in ("enable_thinking", "open_thinking"):
            if key in kw:
                return kw[key]
        return self.open_thinking

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_k(self) -> Optional[int]:
        """None: no logprobs; k: the sampled token's and the k most likely ones'."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self) -> str:
        """none (no tools in the prompt, nothing parsed), auto, required, or a function's name."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function:" + self.tool_choice.function.name
        return self.tool_choice or "auto"


class CompletionRequest(_Sampling):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = Field(None, ge=0, le=COMPLETION_LOGPROBS_MAX)
    suffix: Optional[str] = None  # refused unless null
    response_format: Optional[ResponseFormat] = None  # vLLM takes it on completions too
    best_of: Optional[int] = None  # refused unless null or 1

    def prompts(self) -> List[Union[str, List[int]]]:
        """The prompts, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# --------------------------------------------------------------------------- parsing


def parse_chat(raw: bytes, max_tokens_cap: int, max_n: int) -> ChatCompletionRequest:
    """Body bytes -> a validated chat request, or APIError(400) naming the field."""
    req = _validate(ChatCompletionRequest, raw)
    _refuse(req, REFUSED_CHAT)
    _check_sampling(req, max_tokens_cap, max_n, req.requested_max_tokens(), "max_tokens", allow_zero=False)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    _check_response_format(req.response_format)
    if req.tool_mode() not in ("none", "auto") and req.structured():
        raise APIError(400, "response_format: a forced tool call (tool_choice required or a function) is already "
                            "constrained to the tool's parameters; leave response_format unset or text",
                       "response_format")
    for key, value in (req.chat_template_kwargs or {}).items():
        if key not in ("enable_thinking", "open_thinking"):
            raise APIError(400, f"chat_template_kwargs.{key}: unknown; this server takes enable_thinking "
                                f"(or open_thinking)", f"chat_template_kwargs.{key}")
        if not isinstance(value, bool):
            raise APIError(400, f"chat_template_kwargs.{key} must be true or false", f"chat_template_kwargs.{key}")
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools with the same function name", "tools")
    if req.tool_choice is not None and not req.tools and req.tool_choice != "none":
        raise APIError(400, "tool_choice: needs tools", "tool_choice")
    if isinstance(req.tool_choice, NamedToolChoice) and req.tool_choice.function.name not in names:
        raise APIError(400, f"tool_choice.function.name: {req.tool_choice.function.name!r} is not one of the "
                            f"tools", "tool_choice.function.name")
    for i, m in enumerate(req.messages):
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, f"messages.{i}.tool_calls: only an assistant message calls tools",
                           f"messages.{i}.tool_calls")
    return req


def parse_completion(raw: bytes, max_tokens_cap: int, max_n: int) -> CompletionRequest:
    """Body bytes -> a validated completions request, or APIError(400) naming the field.
    ``max_tokens`` defaults to 16 (OpenAI's default); 0 is allowed with ``echo`` (score the prompt)."""
    req = _validate(CompletionRequest, raw)
    _refuse(req, REFUSED_COMPLETIONS, also_ok={"best_of": [req.samples()]})
    if req.max_tokens is None:
        req.max_tokens = min(16, max_tokens_cap)
    _check_sampling(req, max_tokens_cap, max_n, req.max_tokens, "max_tokens", allow_zero=bool(req.echo))
    _check_response_format(req.response_format)
    prompts = req.prompts()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt: must not be empty (nor hold an empty prompt)", "prompt")
    if len(prompts) * req.samples() > max_n:
        raise APIError(400, f"prompt, n: {len(prompts)} prompt(s) x n={req.samples()} is more than the {max_n} "
                            f"sequences one request may hold here", "n")
    return req


def _check_response_format(fmt: Optional[ResponseFormat]) -> None:
    if fmt is None:
        return
    if fmt.type == "json_schema" and fmt.json_schema is None:
        raise APIError(400, "response_format.json_schema: required with type json_schema ({name, schema, strict})",
                       "response_format.json_schema")
    if fmt.type != "json_schema" and fmt.json_schema is not None:
        raise APIError(400, f"response_format.json_schema: only with type json_schema (not {fmt.type!r})",
                       "response_format.json_schema")


def _validate(model, raw: bytes):
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    bad = _unencodable(data, "")
    if bad is not None:
        raise APIError(400, f"{bad}: text that is not valid Unicode (a lone surrogate such as \\ud800); the "
                            f"tokenizer cannot take it", bad)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _unencodable(value, path: str) -> Optional[str]:
    """The dotted path of the first string (or key) in ``value`` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        sub = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _unencodable(key, sub) is not None:
            return path or "body"
        found = _unencodable(item, sub)
        if found is not None:
            return found
    return None


def _refuse(req, fields: List[str], also_ok: Optional[Dict[str, list]] = None) -> None:
    """A refused field (REFUSED) set to anything but null or its default: a 400 naming it."""
    for name in fields:
        value = getattr(req, name)
        default, why = REFUSED[name]
        if value is None or value == default or value in (also_ok or {}).get(name, []):
            continue
        unset = "leave it unset" + (f" or {json.dumps(default)}" if default is not None else "")
        raise APIError(400, f"{name}: not supported by this server ({why}); {unset}", name)


def _check_sampling(req: _Sampling, cap: int, max_n: int, asked: Optional[int], field: str,
                    allow_zero: bool) -> None:
    stops = req.stop_strings()
    if len(stops) > STOP_MAX or any(not s for s in stops):
        raise APIError(400, f"stop: up to {STOP_MAX} non-empty strings", "stop")
    if asked is not None and (asked < 0 or (asked == 0 and not allow_zero)):
        raise APIError(400, f"{field} must be at least {0 if allow_zero else 1} (got {asked})", field)
    if asked is not None and asked > cap:
        raise APIError(400, f"{field} {asked} is over this server's cap of {cap}", field)
    if req.samples() > max_n:
        raise APIError(400, f"n: at most {max_n} (the replica's batch) (got {req.samples()})", "n")


def _validation_error(e: ValidationError) -> APIError:
    """The most specific invalid field as one line: its dotted path (``messages.0.role``) and what it should
    be. A field with several allowed types fails once per type; those messages are joined."""
    def path(loc) -> str:  # pydantic names the union member it tried ('str', 'list[TextPart]'): drop those
        return ".".join(str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))

    errors = e.errors()
    # the most specific place: a list part of the wrong type beats "content should be a string"
    first = max(errors, key=lambda err: len(path(err["loc"]).split(".")))
    field = path(first["loc"])
    if first["type"] == "extra_forbidden":
        return APIError(400, f"{field}: unknown field (docs/serving.md lists the fields this server takes)", field)
    same = [err for err in errors if path(err["loc"]) == field]
    msgs = list(dict.fromkeys(err["msg"] for err in same))
    what = " or ".join([msgs[0]] + [m.removeprefix("Input should be ") for m in msgs[1:]])
    got = first.get("input")
    shown = "" if first["type"] == "missing" or isinstance(got, (dict, list)) else f" (got {repr(got)[:60]})"
    return APIError(400, f"{field}: {what}{shown}", field)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "TextPart", "NamedToolChoice"}


def check_prompt_length(n_prompt: int, context: int, param: str = "messages") -> None:
    if n_prompt >= context:
        raise APIError(400, f"the prompt is {n_prompt} tokens; this model's context is {context} tokens "
                            f"(prompt + reply)", param, "context_length_exceeded")
