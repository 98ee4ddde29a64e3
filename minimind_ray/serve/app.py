"""The Ray Serve application: a FastAPI ingress with an OpenAI-compatible API and a chat page.

Routes: ``POST /v1/chat/completions`` (streamed as server-sent events, or one JSON body),
``GET /v1/models``, ``GET /health`` (with the engine's counters) and ``GET /`` (the chat page).

Each replica loads the model once and runs one :class:`~minimind_ray.serve.engine.Engine` thread;
request handlers only validate, render the chat template, and turn the engine's tokens into text.
A Serve config file deploys it with ``import_path: minimind_ray.serve.app:build_app`` and the
fields of :class:`~minimind_ray.serve.options.ServeOptions` as ``args``.

No ``from __future__ import annotations`` here: Serve's class-based FastAPI views read the
route signatures at runtime, and a string annotation would turn ``request: Request`` into a
query parameter (a 422 for every call).
"""
import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import AsyncIterator, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from ray import serve

from minimind_ray.serve.engine import Engine, GenRequest
from minimind_ray.serve.options import ServeOptions, options_from_dict
from minimind_ray.serve.protocol import (SSE_DONE, APIError, ChatCompletionRequest, ReplyText, check_prompt_length,
                                         chunk, completion_body, new_completion_id, parse_request,
                                         requested_max_tokens, sse, usage)

log = logging.getLogger(__name__)
PAGE = Path(__file__).with_name("static") / "index.html"

app = FastAPI(title="minimind-ray", docs_url=None, redoc_url=None, openapi_url=None)


@dataclasses.dataclass
class _Outcome:
    """How one request's generation ended, filled while its tokens are consumed."""

    completion_tokens: int = 0  # every token the model produced for the reply (end-of-turn included)
    finish_reason: Optional[str] = None
    error: Optional[str] = None


def _merge(deltas: List[tuple]) -> List[tuple]:
    """Consecutive deltas of the same field as one."""
    out: List[list] = []
    for field, text in deltas:
        if out and out[-1][0] == field:
            out[-1][1] += text
        else:
            out.append([field, text])
    return [tuple(d) for d in out]


def _noop(event: tuple) -> None:
    pass


# Everything the class uses must be defined above it: Serve serializes the deployment class
# when the decorators run, and names defined later are missing in the replica.
@serve.deployment(name="MiniMindChat")
@serve.ingress(app)
class ChatServer:
    def __init__(self, options: dict):
        import torch

        from minimind_ray.serve.model_io import load_served_model

        self.opts: ServeOptions = options_from_dict(options)
        torch.set_num_threads(self.opts.torch_threads())
        device = self.opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        served = load_served_model(self.opts.weights, tokenizer=self.opts.tokenizer, preset=self.opts.preset,
                                   lora=self.opts.lora, lora_alpha=self.opts.lora_alpha, device=device,
                                   tracking_uri=self.opts.tracking_uri, name=self.opts.model_name,
                                   rope_scaling=self.opts.rope_scaling)
        self.tok, self.name = served.tokenizer, served.name
        self.context = min(self.opts.context or served.context, served.context)
        self.engine = Engine(served.model, self.tok.eos_id, self.opts.max_batch, self.context, device)
        self.page = PAGE.read_text(encoding="utf-8")
        self.created = int(time.time())
        log.info("serving %s (%s) on %s, context %d, max batch %d", self.name, self.opts.weights, device,
                 self.context, self.opts.max_batch)

    async def check_health(self) -> None:
        """Serve's replica health check: a dead engine thread makes Serve replace the replica."""
        if not self.engine.alive():
            raise RuntimeError(f"the generation thread died: {self.engine.error}")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(timeout_s=2)

    # ------------------------------------------------------------------ routes

    @app.get("/", response_class=HTMLResponse)
    def page(self) -> HTMLResponse:
        return HTMLResponse(self.page)

    @app.get("/health")
    def health(self) -> dict:
        return {"status": "ok" if self.engine.alive() else "failed", "model": self.name, "engine": self.engine.load()}

    @app.get("/v1/models")
    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.name, "object": "model", "created": self.created, "owned_by": "minimind-ray",
            "context_length": self.context, "max_tokens_cap": self.opts.max_tokens_cap}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        try:
            req = parse_request(await request.body(), self.opts.max_tokens_cap)
            gen, reply = self._prepare(req)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        cid, created = new_completion_id()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(gen, reply, cid, created, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        outcome = _Outcome()
        try:
            async for _ in self._deltas(gen, reply, outcome):
                pass
        finally:
            gen.abort("disconnected")  # no-op when it finished; stops generation if the client left
        if outcome.error:
            return JSONResponse(APIError(500, outcome.error, type="server_error").body(), status_code=500)
        return completion_body(cid, created, self.name, reply, outcome.finish_reason,
                               usage(len(gen.prompt_ids), outcome.completion_tokens))

    # ------------------------------------------------------------------ one request

    def _prepare(self, req: ChatCompletionRequest) -> Tuple[GenRequest, ReplyText]:
        """Check the model name, render the chat template, check the length: the engine request."""
        from minimind_ray.serve.model_io import StreamDecoder, render_prompt

        if req.model is not None and req.model != self.name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.name!r}", "model",
                           "model_not_found")
        think = req.think()
        try:
            prompt = render_prompt(self.tok, [m.as_template_message() for m in req.messages], think)
        except Exception as e:  # noqa: BLE001 - the template's own refusal (raise_exception), as a 400
            raise APIError(400, f"messages: the chat template cannot render them ({e})", "messages") from None
        ids = self.tok.encode(prompt)
        check_prompt_length(len(ids), self.context)
        asked = requested_max_tokens(req)
        gen = GenRequest(
            prompt_ids=ids, on_event=_noop,
            max_new_tokens=asked if asked is not None else min(self.opts.max_tokens_cap, self.context - len(ids)),
            temperature=self.opts.temperature if req.temperature is None else req.temperature,
            top_p=self.opts.top_p if req.top_p is None else req.top_p,
            top_k=self.opts.top_k if req.top_k is None else req.top_k,
            seed=req.seed, stop_at_eos=not req.ignore_eos)
        # the template opened a <think> block (minimind-3 with thinking on): split reasoning from content
        reasoning = bool(think) and prompt.rstrip().endswith("<think>")
        return gen, ReplyText(StreamDecoder(self.tok), req.stop_strings(), reasoning)

    async def _events(self, gen: GenRequest, interval_s: float = 0.0) -> AsyncIterator[List[tuple]]:
        """The engine's events for ``gen``, in lists of whatever arrived together, at most one list per
        ``interval_s`` (the first at once). Leaving early (client gone, stop string) aborts the request,
        so its batch row is freed at the next step."""
        queue: asyncio.Queue = asyncio.Queue()
        gen.on_event, gen.loop = queue.put_nowait, asyncio.get_running_loop()
        self.engine.submit(gen)
        finished, last = False, None
        try:
            while not finished:
                events = [await queue.get()]
                if last is not None and events[0][0] == "token":  # let tokens gather until the interval is up
                    wait = last + interval_s - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                while not queue.empty():
                    events.append(queue.get_nowait())
                last = time.monotonic()
                finished = any(e[0] in ("end", "error") for e in events)
                yield events
        finally:
            if not finished:
                gen.abort("disconnected")

    async def _deltas(self, gen: GenRequest, reply: ReplyText, outcome: _Outcome,
                      interval_s: float = 0.0) -> AsyncIterator[List[tuple]]:
        """Text deltas ``[(field, text), ...]`` of the reply; ``outcome`` says how it ended."""
        eos = self.tok.eos_id
        async for events in self._events(gen, interval_s):
            deltas = []
            for kind, value in events:
                if kind == "token":
                    if reply.stopped:  # made before the engine saw the abort: not part of the reply
                        continue
                    outcome.completion_tokens += 1
                    if not (gen.stop_at_eos and value == eos):  # the end-of-turn token is not text
                        deltas += reply.push(value)
                    if reply.stopped:
                        gen.abort("stop")
                        outcome.finish_reason = "stop"
                elif kind == "end":
                    outcome.finish_reason = outcome.finish_reason or value
                else:
                    outcome.error = value
            done = reply.stopped or outcome.finish_reason is not None or outcome.error is not None
            if done:
                deltas += reply.finish()
            if deltas:
                yield deltas
            if done:
                return

    async def _stream(self, gen: GenRequest, reply: ReplyText, cid: str, created: int,
                      include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: deltas (one event per field per batch of tokens), the finish reason,
        optional usage, ``[DONE]``."""
        outcome = _Outcome()
        first = True
        try:
            async for deltas in self._deltas(gen, reply, outcome, self.opts.stream_interval_ms / 1000):
                events = []
                for field, text in _merge(deltas):
                    delta = {"role": "assistant", field: text} if first else {field: text}
                    first = False
                    events.append(chunk(cid, created, self.name, delta))
                yield "".join(events)
            if outcome.error:
                yield sse(APIError(500, outcome.error, type="server_error").body()) + SSE_DONE
                return
            tail = chunk(cid, created, self.name, {"role": "assistant", "content": ""} if first else {},
                         outcome.finish_reason)
            if include_usage:
                tail += chunk(cid, created, self.name, None, use=usage(len(gen.prompt_ids),
                                                                         outcome.completion_tokens))
            yield tail + SSE_DONE
        finally:
            gen.abort("disconnected")  # no-op when it finished; stops generation if the client left


def build_app(args: dict) -> serve.Application:
    """The application for ``serve.run`` and for Serve config files (``import_path:
    minimind_ray.serve.app:build_app``, ``args:`` the ServeOptions fields)."""
    opts = options_from_dict(dict(args))
    return ChatServer.options(**opts.deployment_options()).bind(dataclasses.asdict(opts))
