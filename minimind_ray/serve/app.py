"""The Ray Serve application: a FastAPI ingress with an OpenAI-compatible API and a chat page.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as server-sent events,
or one JSON body), ``GET /v1/models``, ``GET /health`` (with the engine's counters; no key needed)
and ``GET /`` (the chat page). Metrics go to Prometheus through Ray's metrics export (metrics.py).

Each replica loads the model once and runs one :class:`~minimind_ray.serve.engine.Engine` thread;
request handlers check the key and the replica's room, validate, render the prompt, and turn the
engine's tokens into replies. A Serve config file deploys it with ``import_path:
minimind_ray.serve.app:build_app`` and the fields of :class:`~minimind_ray.serve.options.ServeOptions`
as ``args``.

No ``from __future__ import annotations`` here: Serve's class-based FastAPI views read the
route signatures at runtime, and a string annotation would turn ``request: Request`` into a
query parameter (a 422 for every call).
"""
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import time
from pathlib import Path
from typing import AsyncIterator, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from ray import serve

from minimind_ray.model.grammar import CALL_OPEN
from minimind_ray.serve.engine import Engine, GenRequest
from minimind_ray.serve.inflight import InFlight
from minimind_ray.serve.metrics import ServeMetrics
from minimind_ray.serve.model_io import PrefixCache, StreamDecoder, TokenPieces, load_served_model, render_chat
from minimind_ray.serve.options import API_KEY_ENV, RETRY_AFTER_S, ServeOptions, options_from_dict
from minimind_ray.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_prompt_length,
                                         parse_chat, parse_completion)
from minimind_ray.serve.replies import (Choice, ReplyText, SSE_DONE, ToolCallText, chat_body, chat_logprobs,
                                        chat_message, chunk, completion_body, completion_logprobs, new_id, sse, usage)
from minimind_ray.serve.structured import RequestGrammars

log = logging.getLogger(__name__)
PAGE = Path(__file__).with_name("static") / "index.html"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

app = FastAPI(title="minimind-ray", docs_url=None, redoc_url=None, openapi_url=None)


def _key_hash(opts: ServeOptions) -> Optional[str]:
    """The sha256 the replica compares keys with: the option, else its own MINIMIND_RAY_API_KEY."""
    if opts.api_key_sha256:
        return opts.api_key_sha256
    key = os.environ.get(API_KEY_ENV)
    return hashlib.sha256(key.encode()).hexdigest() if key else None


def _forced_prefix(mode: str) -> str:
    """The start of the reply a ``tool_choice`` of required or a named function puts in the prompt; the rest of the
    call is constrained to a declared function and its parameters (serve/structured.py)."""
    if mode == "required":
        return CALL_OPEN
    if mode.startswith("function:"):  # the name written whole: CALL_OPEN without its opening quote, then the name
        return CALL_OPEN[:-1] + json.dumps(mode[len("function:"):], ensure_ascii=False) + ', "arguments": '
    return ""


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _chat_delta(c: Choice, deltas: list) -> dict:
    """One stream delta of a choice for one tick: its text per field, its calls as OpenAI's indexed tool_calls."""
    out: dict = {}
    for field, value in deltas:
        if field == "tool_call":
            out.setdefault("tool_calls", []).append({"index": c.reply.tool_calls.index(value), **value})
        else:
            out[field] = out.get(field, "") + value
    return out


def _with_prompt(c: Choice, entries: list) -> list:
    """Echo: the prompt tokens' (id, logprob, top) entries in front of the reply's."""
    if not c.echo or c.prompt_logprobs is None:
        return entries
    return [(t, lp, top) for t, (lp, top) in zip(c.echo[1], c.prompt_logprobs)] + entries


def _rss_mb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # peak, KiB on Linux


def _noop(event: tuple) -> None:
    pass


# Everything the class uses must be defined above it: Serve serializes the deployment class
# when the decorators run, and names defined later are missing in the replica.
@serve.deployment(name="MiniMindChat")
@serve.ingress(app)
class ChatServer:
    def __init__(self, options: dict):
        import torch

        self.opts: ServeOptions = options_from_dict(options)
        torch.set_num_threads(self.opts.torch_threads())
        device = self.opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        served = load_served_model(self.opts.weights, tokenizer=self.opts.tokenizer, preset=self.opts.preset,
                                   lora=self.opts.lora, lora_alpha=self.opts.lora_alpha, device=device,
                                   tracking_uri=self.opts.tracking_uri, name=self.opts.model_name,
                                   rope_scaling=self.opts.rope_scaling)
        self.tok, self.name = served.tokenizer, served.name
        self.pieces = TokenPieces(self.tok)
        self.context = min(self.opts.context or served.context, served.context)
        self.trained_context = served.trained_context  # the run's data.max_seq_len (None: not recorded)
        self.engine = Engine(served.model, self.tok.eos_id, self.opts.max_batch, self.context, device,
                             PrefixCache.of_mib(self.opts.prefix_cache_mb))
        self.grammars = RequestGrammars(self.tok, served.model.cfg.vocab_size, self.opts.grammar_timeout_s)
        self.limit = self.opts.max_batch + self.opts.queued()  # rows running + waiting
        self.streams = 0  # streamed responses being sent (their chunks coalesce more when there are many)
        self.key_hash = _key_hash(self.opts)
        self.metrics = ServeMetrics(self.name, self.engine.load)
        self.page = PAGE.read_text(encoding="utf-8")
        self.created = int(time.time())
        log.info("serving %s (%s) on %s, context %d (trained at %s), max batch %d, %d more may wait, timeout %s s, "
                 "API key %s", self.name, self.opts.weights, device, self.context, self.trained_context or "?",
                 self.opts.max_batch, self.opts.queued(), self.opts.request_timeout_s,
                 "required" if self.key_hash else "not required")

    def describe(self) -> dict:
        """What this replica serves, for the command's startup line (serve/serve_verb.py:served_info, through Serve's
        handle): the model id, the weights, the context it serves and the one its run trained at."""
        return {"model": self.name, "weights": self.opts.weights, "context_length": self.context,
                "trained_context_length": self.trained_context}

    async def check_health(self) -> None:
        """Serve's replica health check: a dead engine thread makes Serve replace the replica."""
        if not self.engine.alive():
            raise RuntimeError(f"the generation thread died: {self.engine.error}")

    def __del__(self):
        for part in ("engine", "metrics"):
            if getattr(self, part, None) is not None:
                getattr(self, part).close()

    # ------------------------------------------------------------------ routes

    @app.get("/", response_class=HTMLResponse)
    def page(self) -> HTMLResponse:
        return HTMLResponse(self.page)

    @app.get("/health")
    def health(self) -> dict:
        return {"status": "ok" if self.engine.alive() else "failed", "model": self.name,
                "engine": self.engine.load(), "limits": {"max_batch": self.opts.max_batch,
                                                         "max_queued": self.opts.queued(),
                                                         "request_timeout_s": self.opts.request_timeout_s},
                "rss_mb": _rss_mb()}

    @app.get("/v1/models")
    def models(self, request: Request):
        try:
            self._authorize(request)
        except APIError as e:
            self.metrics.request("/v1/models", e.status)
            return _error(e)
        self.metrics.request("/v1/models", 200)
        return {"object": "list", "data": [{
            "id": self.name, "object": "model", "created": self.created, "owned_by": "minimind-ray",
            "context_length": self.context, "trained_context_length": self.trained_context,
            "max_tokens_cap": self.opts.max_tokens_cap}]}

    @app.post(CHAT)
    async def chat_completions(self, request: Request):
        return await self._serve(request, CHAT, parse_chat, self._prepare_chat)

    @app.post(COMPLETIONS)
    async def completions(self, request: Request):
        return await self._serve(request, COMPLETIONS, parse_completion, self._prepare_completion)

    # ------------------------------------------------------------------ one request

    async def _serve(self, request: Request, endpoint: str, parse, prepare):
        """Key, room, body, prompt, engine; then one JSON body or a stream. Every bad request is a 4xx
        at once, before the engine sees it."""
        try:
            self._authorize(request)
            self._check_room(0)  # before the body is read: a full replica answers at once
            req = parse(await request.body(), self.opts.max_tokens_cap, self.opts.max_batch)
            if req.model is not None and req.model != self.name:
                raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.name!r}",
                               "model", "model_not_found")
            flight = prepare(req, endpoint)
            self._check_room(flight.rows)
        except APIError as e:
            self.metrics.request(endpoint, e.status)
            return _error(e)
        flight.submit(self.engine, self.opts.request_timeout_s)  # no await since the room check: it holds
        if req.stream:
            self.metrics.request(endpoint, 200)
            render = self._chat_stream if endpoint == CHAT else self._completion_stream
            return StreamingResponse(render(req, flight), media_type="text/event-stream", headers=STREAM_HEADERS)
        try:
            async for _ in flight.ticks():
                pass
        finally:
            flight.close()  # stops generation if the client left
        status, body = self._body(req, endpoint, flight)
        self.metrics.request(endpoint, status)
        return JSONResponse(body, status_code=status)

    def _authorize(self, request: Request) -> None:
        if self.key_hash is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        given = hashlib.sha256(key.strip().encode("utf-8", "surrogateescape")).hexdigest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.key_hash):
            # the key sent is never logged or echoed, not even in part
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", None,
                           "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _check_room(self, rows: int) -> None:
        held = self.engine.rows()
        if held + max(rows, 1) > self.limit:
            raise APIError(429, f"this replica is full ({held} sequences running or waiting, {self.limit} at "
                                f"most): try again in {RETRY_AFTER_S} s", None, "server_busy",
                           type="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})

    def _gen(self, req, ids: List[int], max_new: int, index: int, **kw) -> GenRequest:
        seed = None if req.seed is None else (req.seed + index) % (1 << 64)  # n samples differ, reproducibly
        return GenRequest(prompt_ids=ids, on_event=_noop, max_new_tokens=max_new,
                          temperature=self.opts.temperature if req.temperature is None else req.temperature,
                          top_p=self.opts.top_p if req.top_p is None else req.top_p,
                          top_k=self.opts.top_k if req.top_k is None else req.top_k,
                          seed=seed, stop_at_eos=not req.ignore_eos, **kw)

    def _encode(self, text: str, param: str) -> List[int]:
        try:
            return self.tok.encode(text)
        except TypeError:  # a string the Rust tokenizer refuses
            raise APIError(400, f"{param}: text the tokenizer cannot take", param) from None

    def _prepare_chat(self, req: ChatCompletionRequest, endpoint: str) -> InFlight:
        """The chat template (with the tools and the thinking switch), the length check, n rows."""
        mode, think = req.tool_mode(), req.think()
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if mode != "none" else None
        try:
            prompt = render_chat(self.tok, [m.as_template_message() for m in req.messages], think, tools)
        except Exception as e:  # noqa: BLE001 - the template's own refusal (raise_exception), as a 400
            raise APIError(400, f"messages: the chat template cannot render them ({e})", "messages") from None
        prefix = _forced_prefix(mode)
        ids = self._encode(prompt + prefix, "messages")
        check_prompt_length(len(ids), self.context)
        asked = req.requested_max_tokens()
        max_new = asked if asked is not None else min(self.opts.max_tokens_cap, self.context - len(ids))
        # the template opened a <think> block (minimind-3 with thinking on): split reasoning from content
        reasoning = bool(think) and prompt.rstrip().endswith("<think>")
        names = [t.function.name for t in req.tools or []]
        grammar = self.grammars.grammar(req, mode)
        gens, choices = [], []
        for i in range(req.samples()):
            gens.append(self._gen(req, ids, max_new, i, logprobs=req.top_logprobs_k(),
                                  constraint=self.grammars.constraint(grammar)))
            calls = ToolCallText(names, prefix, single=req.parallel_tool_calls is False) if mode != "none" else None
            reply = ReplyText(StreamDecoder(self.tok), req.stop_strings(), reasoning, calls)
            choices.append(Choice(i, reply, self.tok.eos_id, not req.ignore_eos))
        return InFlight(endpoint, [gens], choices, len(ids), self.metrics)

    def _prepare_completion(self, req: CompletionRequest, endpoint: str) -> InFlight:
        """Each prompt as it is (text or token ids; no template), n rows per prompt."""
        groups, choices, prompt_tokens = [], [], 0
        k = req.logprobs if req.echo else None
        grammar = self.grammars.grammar(req, "none")
        for p, prompt in enumerate(req.prompts()):
            param = "prompt" if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else f"prompt.{p}"
            if isinstance(prompt, str):
                ids, text = self._encode(prompt, param), prompt
            else:
                bad = next((t for t in prompt if not 0 <= t < self.tok.vocab_size), None)
                if bad is not None:
                    raise APIError(400, f"{param}: token id {bad} is not in the vocabulary "
                                        f"(0..{self.tok.vocab_size - 1})", param)
                ids, text = list(prompt), self.tok.decode(prompt)
            if not ids:
                raise APIError(400, f"{param}: no tokens", param)
            check_prompt_length(len(ids), self.context, param)
            prompt_tokens += len(ids)
            group = []
            for j in range(req.samples()):
                group.append(self._gen(req, ids, req.max_tokens, j, logprobs=req.logprobs, prompt_logprobs=k,
                                       constraint=self.grammars.constraint(grammar)))
                choice = Choice(len(choices), ReplyText(StreamDecoder(self.tok), req.stop_strings(), False),
                                self.tok.eos_id, not req.ignore_eos)
                choice.echo = (text, ids) if req.echo else None
                choices.append(choice)
            groups.append(group)
        return InFlight(endpoint, groups, choices, prompt_tokens, self.metrics)

    # ------------------------------------------------------------------ replies

    def _body(self, req, endpoint: str, flight: InFlight):
        """(status, body) of a finished non-streamed request."""
        failure = self._failure(flight)
        if failure is not None:
            return failure.status, failure.body()
        use = usage(flight.prompt_tokens, sum(c.completion_tokens for c in flight.choices), flight.cached_tokens())
        cid, created = new_id("chatcmpl" if endpoint == CHAT else "cmpl")
        if endpoint == CHAT:
            choices = [{"index": c.index, "message": chat_message(c), "finish_reason": c.final_reason(),
                        "logprobs": chat_logprobs(c.logprobs, self.pieces) if req.logprobs else None}
                       for c in flight.choices]
            return 200, chat_body(cid, created, self.name, choices, use)
        choices = [{"index": c.index, "text": (c.echo[0] if c.echo else "") + "".join(c.reply.content),
                    "finish_reason": c.finish_reason, "logprobs": None if req.logprobs is None else
                    completion_logprobs(_with_prompt(c, c.logprobs), self.pieces)} for c in flight.choices]
        return 200, completion_body(cid, created, self.name, choices, use)

    async def _chat_stream(self, req: ChatCompletionRequest, flight: InFlight) -> AsyncIterator[str]:
        """Server-sent events: per tick one chunk with a delta for every choice that changed (its role first,
        then its text, tool calls and log-probs; its finish reason with its last delta), optional usage,
        ``[DONE]``."""
        cid, created = new_id("chatcmpl")
        started, sent_lp = set(), [0] * flight.rows
        self.streams += 1
        try:
            async for changed in flight.ticks(self._interval):
                parts = []
                for c, deltas in changed:
                    delta = _chat_delta(c, deltas)
                    if c.error or not (delta or c.final):
                        continue
                    if c.index not in started:
                        started.add(c.index)
                        delta = {"role": "assistant", **(delta or {"content": ""})}
                    lp = None
                    if req.logprobs and len(c.logprobs) > sent_lp[c.index]:
                        lp = chat_logprobs(c.logprobs[sent_lp[c.index]:], self.pieces)
                        sent_lp[c.index] = len(c.logprobs)
                    parts.append({"index": c.index, "delta": delta, "logprobs": lp,
                                  "finish_reason": c.final_reason() if c.final else None})
                if parts:
                    yield chunk("chat.completion.chunk", cid, created, self.name, parts)
            yield self._stream_tail(req, flight, "chat.completion.chunk", cid, created)
        finally:
            self.streams -= 1
            flight.close()  # no-op when it finished; stops generation if the client left

    async def _completion_stream(self, req: CompletionRequest, flight: InFlight) -> AsyncIterator[str]:
        """Server-sent events: per tick one chunk with the new text of every choice that changed (with
        ``echo`` the prompt first), its log-probs and finish reason; optional usage; ``[DONE]``."""
        cid, created = new_id("cmpl")
        sent_lp, offset, begun = [0] * flight.rows, [0] * flight.rows, set()
        self.streams += 1
        try:
            async for changed in flight.ticks(self._interval):
                parts = []
                for c, deltas in changed:
                    if c.error:
                        continue
                    first = c.index not in begun
                    begun.add(c.index)
                    text = ("" if not (first and c.echo) else c.echo[0]) + "".join(
                        v for f, v in deltas if f == "content")
                    lp = None
                    if req.logprobs is not None:
                        new = c.logprobs[sent_lp[c.index]:]
                        sent_lp[c.index] = len(c.logprobs)
                        lp = completion_logprobs(_with_prompt(c, new) if first else new, self.pieces, offset[c.index])
                        offset[c.index] += sum(len(t) for t in lp["tokens"])
                    if text or c.final or (lp and lp["tokens"]):
                        parts.append({"index": c.index, "text": text, "logprobs": lp,
                                      "finish_reason": c.finish_reason if c.final else None})
                if parts:
                    yield chunk("text_completion", cid, created, self.name, parts)
            yield self._stream_tail(req, flight, "text_completion", cid, created)
        finally:
            self.streams -= 1
            flight.close()

    def _failure(self, flight: InFlight) -> Optional[APIError]:
        """The request's timeout (504) or a failed generation (500, the engine's own error), else None."""
        failed = [c.error for c in flight.choices if c.error]
        if not failed:
            return None
        if flight.timed_out:
            return APIError(504, f"the request did not finish within {self.opts.request_timeout_s} s", None,
                            "timeout", type="timeout")
        return APIError(500, failed[0], type="server_error")

    def _interval(self) -> float:
        """Seconds between two chunks of a stream: the interval, longer when the replica serves many streams
        (each chunk costs CPU in the replica and Serve's proxy that the batch could use)."""
        base = self.opts.stream_interval_ms / 1000
        return min(self.opts.stream_interval_max_ms / 1000, base * max(1.0, self.streams / 4))

    def _stream_tail(self, req, flight: InFlight, obj: str, cid: str, created: int) -> str:
        """An error event (timeout or a failed generation), or the usage chunk; then ``[DONE]``."""
        failure = self._failure(flight)
        if failure is not None:
            return sse(failure.body()) + SSE_DONE
        tail = ""
        if req.include_usage():
            tail = chunk(obj, cid, created, self.name, None,
                         usage(flight.prompt_tokens, sum(c.completion_tokens for c in flight.choices),
                               flight.cached_tokens()))
        return tail + SSE_DONE


def build_app(args: dict) -> serve.Application:
    """The application for ``serve.run`` and for Serve config files (``import_path:
    minimind_ray.serve.app:build_app``, ``args:`` the ServeOptions fields)."""
    opts = options_from_dict(dict(args))
    return ChatServer.options(**opts.deployment_options()).bind(dataclasses.asdict(opts))
