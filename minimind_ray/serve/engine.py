"""Continuous batching: one thread runs the model for every request a replica holds.

Requests join and leave the running batch between decode steps, so a short reply never waits
for a long one and a new request starts after one prefill, not after the current batch ends.

The batch keeps one static KV cache (model/kv_cache.py) of ``max_batch`` slots, each row in its own slot from
position 0 with its own length. A joining request takes the lowest free slot; the prompts of every request that joins
between two steps are prefilled together, in one forward (right-padded); a request's ``n`` rows share that prefill
(the first row's slot is copied into the others'). A decode step runs the slots from the lowest to the highest one in
use, one token each; a free slot in between runs a pad that changes nothing. A row that finishes or is aborted gives
its slot back. Nothing in the cache moves when rows come and go.

With a prefix cache (model/prefix_cache.py; ``serve --prefix-cache-mb``), a joining prompt's held blocks are
copied into its slot and only the rest is prefilled; its full blocks are stored after. Joiners that share a new
prefix are prefilled in waves (the first computes it, the others copy it one forward later), and each request's
``cached_tokens`` says how many of its prompt tokens were copied (the API's ``prompt_tokens_details``).

A request alone runs exactly the calls of ``minimind_ray.generate.generate_tokens`` (prefill of the whole prompt,
then one token at a time with no mask), so temperature 0 gives the same tokens as ``minimind-ray generate``; in a
batch, or on a prefix cache hit, every row computes what it would alone, up to float rounding.

A request with a ``constraint`` (structured output: its own grammar matcher, model/grammar.py) samples only what its
grammar allows: before each pick, the step fills one bitmask row per constrained row and applies them to those rows'
logits (``_constrain``); its matcher advances on every emitted token. Free rows in the same batch are untouched.

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

from minimind_ray.serve.model_io import (KVCache, PrefixCache, RowConstraint, apply_token_bitmask, new_bitmask,
                                         sample_tokens)

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
    constraint: Optional[RowConstraint] = None  # structured output: only the tokens its grammar allows (one per row)
    abort_reason: Optional[str] = None
    cached_tokens: int = 0  # set by the engine at its prefill: prompt tokens copied from the prefix cache

    def abort(self, reason: str) -> None:
        """Stop generating for this request (client gone, stop string seen); safe from any thread."""
        self.abort_reason = self.abort_reason or reason


@dataclass
class _Row:
    req: GenRequest
    slot: int  # its row of the KV cache
    last: int  # the newest token, not yet fed to the model
    generated: int  # tokens sampled so far
    generator: Optional[torch.Generator]


@dataclass
class EngineStats:
    requests_finished: int = 0
    requests_aborted: Dict[str, int] = field(default_factory=dict)  # by reason
    tokens_generated: int = 0
    prompt_tokens: int = 0  # prefilled, once per group
    cached_tokens: int = 0  # of them, copied from the prefix cache instead of computed
    prefills: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over decode steps: / decode_steps = mean batch
    waiting_peak: int = 0  # most rows ever waiting to join

    def as_dict(self) -> dict:
        mean = self.decode_rows / self.decode_steps if self.decode_steps else 0.0
        return {"requests_finished": self.requests_finished, "requests_aborted": dict(self.requests_aborted),
                "tokens_generated": self.tokens_generated, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "prefills": self.prefills, "decode_steps": self.decode_steps, "mean_batch": round(mean, 2),
                "waiting_peak": self.waiting_peak}


class Engine:
    """The batching loop of one replica. ``context`` caps prompt + reply tokens per request."""

    def __init__(self, model, eos_id: int, max_batch: int, context: int, device: str = "cpu",
                 prefix_cache: Optional[PrefixCache] = None):
        self.model, self.eos_id, self.max_batch, self.device = model, eos_id, max_batch, device
        self.prefix_cache = prefix_cache  # None: every prompt prefilled whole
        self.context = min(context, model.cfg.max_position_embeddings)
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()  # groups: lists of requests with one prompt
        self._n_waiting = 0  # rows in _waiting
        self._n_joining = 0  # rows taken from _waiting, being prefilled: not in _rows until all of them are
        self._dropped: List[GenRequest] = []  # aborted while waiting, taken out by submit: counted by the loop
        self._rows: Dict[int, _Row] = {}  # slot -> row
        self._cache = KVCache.for_model(model, slots=max_batch, max_len=self.context)
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
        """Rows this engine holds: running, waiting, and joining right now (each counted once: the joining
        ones enter ``_rows`` and leave ``_n_joining`` under the lock, together)."""
        with self._cond:
            return len(self._rows) + self._n_waiting + self._n_joining

    def load(self) -> dict:
        cached = self.prefix_cache.stats() if self.prefix_cache is not None else {}
        return {"running": len(self._rows), "waiting": self._n_waiting, **self.stats.as_dict(), **cached}

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
        """Wait for work; move waiting requests into the batch (prefilled together). False when closed."""
        with self._cond:
            while not self._closed and not self._waiting and not self._rows:
                self._cond.wait()
            if self._closed:
                pending = [r for g in self._waiting for r in g] + [r.req for r in self._rows.values()]
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
        joined = self._admit(joining)
        with self._cond:  # in one move, so that rows() never counts a row twice (or not at all)
            self._rows.update((row.slot, row) for row in joined)
            self._n_joining = 0
        self._flush()  # first tokens out now, not after the next decode step
        return True

    def _step(self) -> None:
        self._drop_aborted()
        if not self._rows:
            return
        lo, hi = min(self._rows), max(self._rows) + 1  # slots lo..hi-1: one view of the cache, no gather
        rows = [self._rows.get(s) for s in range(lo, hi)]  # None: a free slot between two rows
        ids = torch.tensor([[r.last if r else 0] for r in rows], dtype=torch.long, device=self.device)  # (B, 1)
        fed = None if all(rows) else [int(r is not None) for r in rows]  # a free slot's pad does not advance it
        out = self.model(ids, kv_cache=self._cache, slots=range(lo, hi), input_lengths=fed)
        running = [i for i, r in enumerate(rows) if r is not None]
        logits = out.logits[running, -1].float()  # (B running, V)
        rows = [rows[i] for i in running]
        self._constrain(logits, rows)
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(rows)
        done = [row.slot for row, picked in zip(rows, self._pick(logits, rows)) if self._emit(row, *picked)]
        if done:
            self._remove(done)

    # ------------------------------------------------------------------ rows in and out

    def _admit(self, groups: List[List[GenRequest]]) -> List[_Row]:
        """Prefill the prompts of ``groups`` (one per group) in one forward, each in its own slot, emit each
        request's first token, and return the rows that go on decoding."""
        for req in (r for g in groups for r in g if r.abort_reason):
            self._count_abort(req)
        groups = [g for g in ([r for r in g if not r.abort_reason] for g in groups) if g]
        for group in [g for g in groups if len(g[0].prompt_ids) >= self.context]:
            for req in group:  # no room for a token (generate yields none either)
                self.stats.requests_finished += 1
                self._send(req, ("end", "length"))
        groups = [g for g in groups if len(g[0].prompt_ids) < self.context]
        if not groups:
            return []
        if self.prefix_cache is not None:
            self.prefix_cache.check_weights(self.model)  # stale keys never survive a weight change
        joined = []
        for wave in self._waves(groups):
            joined += self._admit_wave(wave)
        return joined

    def _waves(self, groups: List[List[GenRequest]]) -> List[List[List[GenRequest]]]:
        """``groups`` in prefills one after another (PrefixCache.waves: a new prefix shared by groups arriving
        together is computed once, by the first); without a prefix cache, one wave."""
        if self.prefix_cache is None:
            return [groups]
        return [[groups[i] for i in wave] for wave in self.prefix_cache.waves([g[0].prompt_ids for g in groups])]

    def _admit_wave(self, groups: List[List[GenRequest]]) -> List[_Row]:
        slots = [self._cache.alloc(len(g)) for g in groups]  # the batch had room for every row: _next_batch
        prompts = [g[0].prompt_ids for g in groups]
        every = any(r.prompt_logprobs is not None for g in groups for r in g)  # logits at every prompt position
        try:
            cached = [self._from_prefix_cache(g, s[0]) for g, s in zip(groups, slots)]
            out = self._prefill([p[c:] for p, c in zip(prompts, cached)], [s[0] for s in slots], every)
            if self.prefix_cache is not None:
                for prompt, taken in zip(prompts, slots):
                    self.prefix_cache.save(self._cache, taken[0], prompt)
        except Exception as e:  # noqa: BLE001 - these requests fail, the batch goes on
            log.exception("prefill failed")
            for group, taken in zip(groups, slots):
                self._cache.release(taken)
                for req in group:
                    self._send(req, ("error", f"prefill failed: {type(e).__name__}: {e}"))
            return []
        joined = []
        for i, (group, taken, prompt) in enumerate(zip(groups, slots, prompts)):
            self.stats.prefills += 1
            self.stats.prompt_tokens += len(prompt)
            self.stats.cached_tokens += cached[i]
            self._cache.fork(taken[0], taken[1:])  # n rows of one prompt: one prefill
            k = max((r.prompt_logprobs for r in group if r.prompt_logprobs is not None), default=None)
            if k is not None:  # such a group took nothing from the prefix cache: every position was computed
                scored = _prompt_logprobs(out[i, :len(prompt)].float(), prompt, k)
                for req in group:
                    if req.prompt_logprobs is not None:
                        self._send(req, ("prompt_logprobs", scored))
            after = out[i:i + 1, len(prompt) - cached[i] - 1 if every else 0].float()  # (1, V): after the prompt
            for req, slot in zip(group, taken):
                last = after.clone() if req.constraint is not None else after
                gen = None
                if req.seed is not None:
                    gen = torch.Generator(device=self.device).manual_seed(req.seed)
                row = _Row(req, slot, -1, 0, gen)
                self._constrain(last, [row])
                if req.max_new_tokens <= 0:  # the prompt's log-probs were all it asked for (echo, max_tokens 0)
                    self.stats.requests_finished += 1
                    self._send(req, ("end", "length"))
                elif not self._emit(row, *self._pick(last, [row])[0]):
                    joined.append(row)
                    continue
                self._cache.release([slot])
        return joined

    def _from_prefix_cache(self, group: List[GenRequest], slot: int) -> int:
        """Copy the cached prefix of the group's prompt into ``slot`` -> its length (0: none; always 0 for a
        group that wants its prompt's log-probs, which need the logits at every prompt position)."""
        if self.prefix_cache is None or any(r.prompt_logprobs is not None for r in group):
            return 0
        n = self.prefix_cache.load(self._cache, slot, group[0].prompt_ids)
        for req in group:
            req.cached_tokens = n
        return n

    def _prefill(self, prompts: List[List[int]], slots: List[int], every_position: bool) -> torch.Tensor:
        """One forward of the right-padded prompts (or what of each the prefix cache did not hold: the slot's
        length says where it starts) into their slots -> logits (G, P, V), or (G, 1, V) at each prompt's last
        token unless ``every_position`` (a request wants its prompt's log-probs)."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        lengths = [len(p) for p in prompts]
        last = None if every_position else torch.tensor(lengths, device=self.device) - 1
        return self.model(ids.to(self.device), kv_cache=self._cache, slots=slots, input_lengths=lengths,
                          logits_at=last).logits

    def _remove(self, slots: List[int]) -> None:
        for s in slots:
            del self._rows[s]
        self._cache.release(slots)

    def _drop_aborted(self) -> None:
        gone = [s for s, r in self._rows.items() if r.req.abort_reason]
        for s in gone:
            self._count_abort(self._rows[s].req)
        if gone:
            self._remove(gone)

    def _fail_all(self, message: str) -> None:
        for r in self._rows.values():
            self._send(r.req, ("error", message))
        self._cache.release(list(self._rows))
        self._rows = {}

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

    def _constrain(self, logits: torch.Tensor, rows: List[_Row]) -> None:
        """Structured output: each constrained row's logits (one row of ``logits`` per row) keep only the tokens
        its grammar allows next: one bitmask per row, filled by its matcher, applied in one call."""
        held = [i for i, row in enumerate(rows) if row.req.constraint is not None]
        if not held:
            return
        bitmask = new_bitmask(len(held), logits.shape[-1])
        for j, i in enumerate(held):
            rows[i].req.constraint.fill(bitmask[j])
        logits[held] = apply_token_bitmask(logits[held], bitmask)

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
            else:  # each row its own parameters and generator: the one sampler, row by row
                token = int(sample_tokens(logits[i:i + 1], req.temperature, req.top_p, req.top_k, row.generator))
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
        if req.constraint is not None:
            req.constraint.advance(token)
        if req.stop_at_eos and token == self.eos_id:
            reason = "stop"
        elif req.constraint is not None and (req.constraint.failed or (req.constraint.complete and
                                                                       not req.stop_at_eos)):
            if req.constraint.failed:  # never under its own mask: a bug, said so, and the reply ends where it is
                log.error("structured output: the grammar refused token %d: %s", token, req.constraint.failed)
            reason = "stop"  # ignore_eos: nothing may follow the grammar's end (else its mask leaves only the EOS)
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
    return [(i, v) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]  # masked: not candidates


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
