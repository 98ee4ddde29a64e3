"""Continuous batching: one thread runs the model for every request a replica holds.

Requests join and leave the running batch between decode steps, so a short reply never waits
for a long one and a new request starts after one prefill, not after the current batch ends.

The batch keeps one KV cache, per layer (B, S, nkv, hs), in the model's own format. Rows are
**left-padded** to a common length S: row i's real tokens fill the last ``S - pad[i]``
positions and an attention mask hides the pads. The model gives every row the same query
position S, so row i's cached keys must sit at positions ``pad[i] + j``; a joining prompt,
prefilled alone at positions 0..P-1, has its keys turned by RoPE to where they land
(:func:`model_io.shift_keys`), and when rows leave, the padding every remaining row shares
is cut off and the keys are turned back. Attention depends only on position differences,
so every row computes what it would alone, up to float rounding.

A request alone in the batch with no padding runs exactly the calls of
``minimind_ray.model.minimind.generate`` (prefill of the whole prompt, then one token at a
time with no mask), so temperature 0 gives the same tokens as ``minimind-ray generate``.

Requests talk to the thread through :class:`GenRequest`: ``on_event`` receives ``("token", id)``
(``("token", id, (logprob, top))`` when the request asks for log-probs; ``("prompt_logprobs", [...])``
first when it asks for its prompt's), then ``("end", finish_reason)`` or ``("error", text)``;
``abort(reason)`` (any thread) drops the row at the next step. :meth:`Engine.submit` takes a list of
requests with one prompt (the ``n`` samples of one API request): they join the batch together as
``n`` rows after **one** prefill, each with its own generator. Events are handed over once per step:
a request with an asyncio ``loop`` gets them on that loop, one wake-up per loop and step however many
rows it serves (not one per token); without a loop ``on_event`` is called on the engine thread.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from minimind_ray.serve.model_io import sample_filter, shift_keys

log = logging.getLogger(__name__)


@dataclass
class GenRequest:
    prompt_ids: List[int]
    max_new_tokens: int
    on_event: Callable[[tuple], None]  # on ``loop`` if given, else on the engine thread; must not block
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: Optional[int] = None
    stop_at_eos: bool = True  # False: keep going past the end-of-turn token (benchmarks)
    logprobs: Optional[int] = None  # k: each token's log-prob and the k most likely; None: none
    prompt_logprobs: Optional[int] = None  # k: the prompt tokens' log-probs too (completions' echo)
    loop: Optional[asyncio.AbstractEventLoop] = None  # deliver events on this event loop
    abort_reason: Optional[str] = None

    def abort(self, reason: str) -> None:
        """Stop generating for this request (client gone, stop string seen); safe from any thread."""
        self.abort_reason = self.abort_reason or reason


@dataclass
class _Row:
    req: GenRequest
    pad: int  # left pads in the batch cache
    last: int  # the newest token, not yet fed to the model
    generated: int  # tokens sampled so far
    generator: Optional[torch.Generator]


@dataclass
class EngineStats:
    requests_finished: int = 0
    requests_aborted: Dict[str, int] = field(default_factory=dict)  # by reason
    tokens_generated: int = 0
    prompt_tokens: int = 0  # prefilled, once per group
    prefills: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over decode steps: / decode_steps = mean batch
    waiting_peak: int = 0  # most rows ever waiting to join

    def as_dict(self) -> dict:
        mean = self.decode_rows / self.decode_steps if self.decode_steps else 0.0
        return {"requests_finished": self.requests_finished, "requests_aborted": dict(self.requests_aborted),
                "tokens_generated": self.tokens_generated, "prompt_tokens": self.prompt_tokens,
                "prefills": self.prefills, "decode_steps": self.decode_steps, "mean_batch": round(mean, 2),
                "waiting_peak": self.waiting_peak}


class Engine:
    """The batching loop of one replica. ``context`` caps prompt + reply tokens per request."""

    def __init__(self, model, eos_id: int, max_batch: int, context: int, device: str = "cpu"):
        self.model, self.eos_id, self.max_batch, self.device = model, eos_id, max_batch, device
        self.context = min(context, model.cfg.max_position_embeddings)
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()  # groups: lists of requests with one prompt
        self._n_waiting = 0  # rows in _waiting
        self._n_joining = 0  # rows taken from _waiting, being prefilled
        self._dropped: List[GenRequest] = []  # aborted while waiting, taken out by submit: counted by the loop
        self._rows: List[_Row] = []
        self._past = None  # per layer (k, v), each (B, S, nkv, hs); None when no row is running
        self._closed = False
        self._outbox: List[tuple] = []  # (request, event) of the current step, delivered together
        self.error: Optional[str] = None  # set if the loop itself died
        self._thread = threading.Thread(target=self._loop, name="minimind-serve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public, any thread

    def submit(self, req) -> None:
        """Queue a request, or a list of requests with the same prompt (one prefill for all)."""
        group = list(req) if isinstance(req, (list, tuple)) else [req]
        if not group or len(group) > self.max_batch or any(g.prompt_ids != group[0].prompt_ids for g in group):
            raise ValueError(f"a group is 1 to {self.max_batch} requests with one prompt")
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            if any(r.abort_reason for g in self._waiting for r in g):  # timed out or left while waiting
                kept = [g for g in self._waiting if not all(r.abort_reason for r in g)]
                self._dropped += [r for g in self._waiting if all(r.abort_reason for r in g) for r in g]
                self._waiting = collections.deque(kept)
                self._n_waiting = sum(len(g) for g in kept)
            self._waiting.append(group)
            self._n_waiting += len(group)
            self.stats.waiting_peak = max(self.stats.waiting_peak, self._n_waiting)
            self._cond.notify()

    def rows(self) -> int:
        """Rows this engine holds: running, waiting, and joining right now."""
        return len(self._rows) + self._n_waiting + self._n_joining

    def load(self) -> dict:
        return {"running": len(self._rows), "waiting": self._n_waiting, **self.stats.as_dict()}

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while self._next_batch():
                    try:
                        self._step()
                    except Exception as e:  # noqa: BLE001 - a bad step fails its requests, not the server
                        log.exception("generation step failed")
                        self._fail_all(f"generation failed: {type(e).__name__}: {e}")
                    finally:
                        self._flush()
        except BaseException as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
            log.exception("engine loop died")
            raise

    def _next_batch(self) -> bool:
        """Wait for work; move waiting requests into the batch (prefill each). False when closed."""
        with self._cond:
            while not self._closed and not self._waiting and not self._rows:
                self._cond.wait()
            if self._closed:
                pending = [r for g in self._waiting for r in g] + [r.req for r in self._rows]
                self._waiting.clear()
                self._n_waiting = 0
                for req in pending:
                    self._send(req, ("error", "the server is shutting down"))
                self._flush()
                return False
            dropped, self._dropped = self._dropped, []
            joining, room = [[r] for r in dropped], self.max_batch - len(self._rows)  # _admit counts them
            while self._waiting and len(self._waiting[0]) <= room:  # in order; a group joins whole
                group = self._waiting.popleft()
                joining.append(group)
                room -= len(group)
                self._n_waiting -= len(group)
            self._n_joining = sum(len(g) for g in joining)
        for group in joining:
            self._admit(group)
        self._n_joining = 0
        self._flush()  # first tokens out now, not after the next decode step
        return True

    def _step(self) -> None:
        self._drop_aborted()
        if not self._rows:
            return
        rows = self._rows
        ids = torch.tensor([[r.last] for r in rows], dtype=torch.long, device=self.device)  # (B, 1)
        mask = None
        if any(r.pad for r in rows):
            S = self._past[0][0].shape[1] + 1
            pads = torch.tensor([r.pad for r in rows], device=self.device)
            mask = torch.arange(S, device=self.device)[None, :] >= pads[:, None]  # (B, S): True = real token
        out = self.model(ids, past_key_values=self._past, use_cache=True, attention_mask=mask)
        self._past = out.past_key_values
        logits = out.logits[:, -1].float()  # (B, V)
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(rows)
        done = [i for i, (row, picked) in enumerate(zip(rows, self._pick(logits, rows))) if self._emit(row, *picked)]
        if done:
            self._remove(done)

    # ------------------------------------------------------------------ rows in and out

    def _admit(self, group: List[GenRequest]) -> None:
        """Prefill the group's prompt alone (exactly generate's first call), emit each request's first
        token, and add one row per request to the batch."""
        for req in group:
            if req.abort_reason:
                self._count_abort(req)
        group = [r for r in group if not r.abort_reason]
        if not group:
            return
        prompt = group[0].prompt_ids
        if len(prompt) >= self.context:  # no room for a token (generate yields none either)
            for req in group:
                self.stats.requests_finished += 1
                self._send(req, ("end", "length"))
            return
        try:
            ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
            out = self.model(ids, use_cache=True)
        except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
            log.exception("prefill failed")
            for req in group:
                self._send(req, ("error", f"prefill failed: {type(e).__name__}: {e}"))
            return
        self.stats.prefills += 1
        self.stats.prompt_tokens += len(prompt)
        k = max((r.prompt_logprobs for r in group if r.prompt_logprobs is not None), default=None)
        if k is not None:
            scored = _prompt_logprobs(out.logits[0].float(), prompt, k)
            for req in group:
                if req.prompt_logprobs is not None:
                    self._send(req, ("prompt_logprobs", scored))
        last = out.logits[:, -1].float()
        for req in group:
            if req.max_new_tokens <= 0:  # the prompt's log-probs were all it asked for (echo, max_tokens 0)
                self.stats.requests_finished += 1
                self._send(req, ("end", "length"))
                continue
            gen = None
            if req.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(req.seed)
            row = _Row(req, 0, -1, 0, gen)
            if not self._emit(row, *self._pick(last, [row])[0]):
                self._join(row, out.past_key_values)

    def _join(self, row: _Row, cache) -> None:
        P = cache[0][0].shape[1]
        if self._past is None:
            self._past, self._rows = cache, [row]
            return
        S = self._past[0][0].shape[1]
        if P > S:  # the newcomer is longer: everyone else moves right by P - S
            grow = P - S
            self._past = [(_pad_left(shift_keys(self.model, k, grow), grow), _pad_left(v, grow))
                          for k, v in self._past]
            for r in self._rows:
                r.pad += grow
            S = P
        row.pad = S - P
        cache = [(_pad_left(shift_keys(self.model, k, row.pad), row.pad), _pad_left(v, row.pad)) for k, v in cache]
        self._past = [(torch.cat([k0, k1]), torch.cat([v0, v1])) for (k0, v0), (k1, v1) in zip(self._past, cache)]
        self._rows.append(row)

    def _remove(self, indices: List[int]) -> None:
        gone = set(indices)
        keep = [i for i in range(len(self._rows)) if i not in gone]
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._past = None
            return
        idx = torch.tensor(keep, device=self.device)
        cut = min(r.pad for r in self._rows)  # padding every remaining row shares: drop it
        past = []
        for k, v in self._past:
            k, v = k.index_select(0, idx), v.index_select(0, idx)
            if cut:
                k, v = shift_keys(self.model, k[:, cut:], -cut), v[:, cut:]
            past.append((k, v))
        self._past = past
        for r in self._rows:
            r.pad -= cut

    def _drop_aborted(self) -> None:
        gone = [i for i, r in enumerate(self._rows) if r.req.abort_reason]
        for i in gone:
            self._count_abort(self._rows[i].req)
        if gone:
            self._remove(gone)

    def _fail_all(self, message: str) -> None:
        for r in self._rows:
            self._send(r.req, ("error", message))
        self._rows, self._past = [], None

    def _count_abort(self, req: GenRequest) -> None:
        reason = req.abort_reason or "unknown"
        self.stats.requests_aborted[reason] = self.stats.requests_aborted.get(reason, 0) + 1

    # ------------------------------------------------------------------ events

    def _send(self, req: GenRequest, event: tuple) -> None:
        self._outbox.append((req, event))

    def _flush(self) -> None:
        """Deliver this step's events: one call per event loop, direct calls for the rest."""
        outbox, self._outbox = self._outbox, []
        by_loop: Dict[asyncio.AbstractEventLoop, List[tuple]] = {}
        for req, event in outbox:
            if req.loop is None:
                req.on_event(event)
            else:
                by_loop.setdefault(req.loop, []).append((req, event))
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the loop is closed: nobody listens for these requests any more
                for req, _ in events:
                    req.abort("disconnected")

    # ------------------------------------------------------------------ tokens

    def _pick(self, logits: torch.Tensor, rows: List[_Row]) -> List[tuple]:
        """Next token per row, as ``generate`` picks it: argmax at temperature 0, else temperature,
        top-k, top-p and a draw from the row's own generator (seeded requests are reproducible).
        Each is ``(token,)``, or ``(token, (logprob, top))`` for a row that asks for log-probs."""
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, row in enumerate(rows):
            req = row.req
            if req.temperature == 0:
                token = greedy[i]
            else:
                filtered = sample_filter(logits[i] / req.temperature, req.top_k, req.top_p)
                token = int(torch.multinomial(F.softmax(filtered, dim=-1), 1, generator=row.generator))
            if req.logprobs is None:
                out.append((token,))
                continue
            # the log-prob at the request's temperature (the model's own at 0), before top-k/top-p
            lsm = F.log_softmax(logits[i] / (req.temperature or 1.0), dim=-1)
            out.append((token, (float(lsm[token]), _top(lsm, req.logprobs))))
        return out

    def _emit(self, row: _Row, token: int, logprob: Optional[tuple] = None) -> bool:
        """Hand ``token`` to the request; True when the request is finished (and told so)."""
        req = row.req
        row.generated += 1
        row.last = token
        self.stats.tokens_generated += 1
        self._send(req, ("token", token) if logprob is None else ("token", token, logprob))
        reason = None
        if req.stop_at_eos and token == self.eos_id:
            reason = "stop"
        elif row.generated >= req.max_new_tokens or len(req.prompt_ids) + row.generated >= self.context:
            reason = "length"
        if reason:
            self.stats.requests_finished += 1
            self._send(req, ("end", reason))
            return True
        return False


def _top(lsm: torch.Tensor, k: int) -> List[tuple]:
    if k <= 0:
        return []
    values, ids = torch.topk(lsm, k)
    return list(zip(ids.tolist(), values.tolist()))


def _prompt_logprobs(logits: torch.Tensor, prompt: List[int], k: int) -> List[tuple]:
    """Each prompt token's log-prob given the tokens before it, and the top ``k`` there; the first
    token has none (``(None, None)``). logits (P, V) of the prefill."""
    lsm = F.log_softmax(logits[:-1], dim=-1)  # position j predicts token j + 1
    target = torch.tensor(prompt[1:], device=lsm.device)
    lps = lsm.gather(1, target[:, None])[:, 0].tolist()
    tops = [_top(lsm[j], k) for j in range(len(prompt) - 1)] if k > 0 else [[] for _ in prompt[1:]]
    return [(None, None)] + list(zip(lps, tops))


def _deliver(events: List[tuple]) -> None:
    for req, event in events:
        req.on_event(event)


def _pad_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, S, ...) -> (B, n + S, ...) with n zero positions in front."""
    if n == 0:
        return x
    return torch.cat([x.new_zeros((x.shape[0], n, *x.shape[2:])), x], dim=1)
