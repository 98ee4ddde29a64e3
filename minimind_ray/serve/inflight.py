"""One API request in flight: its engine rows (``n`` per prompt), the events they send back, its choices
(reply text, token counts, log-probs), its deadline and its metrics.

The engine thread hands events over once per decode step (:mod:`engine`); :class:`Inbox` is the cheap
hand-off on the request's event loop (a list and one future, not an asyncio.Queue per event).
"""
from __future__ import annotations

import asyncio
import functools
import time
from typing import AsyncIterator, Callable, List, Optional, Tuple

from minimind_ray.serve.engine import GenRequest
from minimind_ray.serve.replies import Choice

TIMEOUT = -1  # the choice index of the deadline's event


class Inbox:
    """Events ``(choice index, event, arrival time)`` for one request, filled on its event loop."""

    def __init__(self):
        self.items: List[tuple] = []
        self.waiter: Optional[asyncio.Future] = None
        self.ending: Optional[asyncio.Future] = None  # set by a choice's last event ("end" or "error")

    def put(self, index: int, event: tuple) -> None:
        self.items.append((index, event, time.monotonic()))
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)
        if event[0] in ("end", "error") and self.ending is not None and not self.ending.done():
            self.ending.set_result(None)

    def has_end(self) -> bool:
        return any(event[0] in ("end", "error") for _, event, _ in self.items)

    async def gather(self, seconds: float) -> None:
        """Let events gather for up to ``seconds``; a choice's last event cuts the wait short (a client waits
        for its end before it sends its next request)."""
        if self.has_end():
            return
        self.ending = asyncio.get_running_loop().create_future()
        await asyncio.wait({self.ending}, timeout=seconds)
        self.ending = None

    async def take(self) -> List[tuple]:
        """Everything that has arrived, waiting for at least one event."""
        if not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None
        items, self.items = self.items, []
        return items


class InFlight:
    """The engine requests of one API request (``groups``: one list per prompt, ``n`` rows each, in choice
    order) and their :class:`Choice` objects."""

    def __init__(self, endpoint: str, groups: List[List[GenRequest]], choices: List[Choice],
                 prompt_tokens: int, metrics=None):
        self.endpoint, self.groups, self.choices, self.metrics = endpoint, groups, choices, metrics
        self.gens = [g for group in groups for g in group]
        self.prompt_tokens = prompt_tokens  # every prompt once, as OpenAI counts them
        self.inbox = Inbox()
        self.t0 = time.monotonic()
        self.first_token_at: Optional[float] = None
        self.last_token_at = [None] * len(self.gens)
        self.timed_out = False
        self.ended: Optional[str] = None  # why the engine rows were let go: finished, timeout, disconnected
        self._timer = None

    @property
    def rows(self) -> int:
        return len(self.gens)

    def submit(self, engine, timeout_s: Optional[float]) -> None:
        loop = asyncio.get_running_loop()
        for i, gen in enumerate(self.gens):
            gen.loop, gen.on_event = loop, functools.partial(self.inbox.put, i)
        for group in self.groups:
            engine.submit(group)
        if timeout_s is not None:
            self._timer = loop.call_later(timeout_s, self._expire)

    def _expire(self) -> None:
        self.timed_out = True
        for gen in self.gens:
            gen.abort("timeout")  # the engine drops the rows at its next step
        self.inbox.put(TIMEOUT, ("error", "timeout"))

    def finished(self) -> bool:
        return all(c.done for c in self.choices)

    async def ticks(self, interval: Optional[Callable[[], float]] = None) -> AsyncIterator[List[Tuple[Choice, list]]]:
        """After each batch of events: ``[(choice, deltas), ...]`` for the choices that changed, at most
        one batch per ``interval()`` seconds (the first at once, and a choice's end at once; None: as events
        come). Ends when every choice is done or the deadline passed (then every unfinished choice has
        ``error == "timeout"``)."""
        last = None
        while not self.finished():
            items = await self.inbox.take()
            ends = any(event[0] in ("end", "error") for _, event, _ in items)
            if last is not None and interval is not None and not self.timed_out and not ends:
                wait = last + interval() - time.monotonic()  # let tokens gather until the interval is up
                if wait > 0:
                    await self.inbox.gather(wait)  # or until a choice ends: its last chunk goes at once
                    items += self.inbox.items
                    self.inbox.items = []
            last = time.monotonic()
            changed = {}
            for index, event, at in items:
                if index == TIMEOUT:
                    for i, c in enumerate(self.choices):
                        if not c.done:
                            c.error = "timeout"
                            changed.setdefault(i, [])
                    continue
                choice = self.choices[index]
                if event[0] == "token":
                    self._timing(index, at)
                deltas = choice.on_event(event, self.gens[index].abort)
                if deltas or (choice.done and not choice.final):
                    changed.setdefault(index, []).extend(deltas)
            out = []
            for index, deltas in sorted(changed.items()):
                choice = self.choices[index]
                if choice.done and not choice.final:  # its last deltas: whatever the reply held back
                    choice.final = True
                    deltas = deltas + choice.reply.finish()
                out.append((choice, deltas))
            if out:
                yield out

    def _timing(self, index: int, at: float) -> None:
        if self.metrics is None:
            return
        if self.first_token_at is None:
            self.first_token_at = at
            self.metrics.ttft.observe(at - self.t0)
        prev = self.last_token_at[index]
        if prev is not None:
            self.metrics.itl.observe(at - prev)
        self.last_token_at[index] = at

    def cached_tokens(self) -> int:
        """Prompt tokens the engine's prefix cache held, every prompt once (as ``prompt_tokens`` counts them)."""
        return sum(group[0].cached_tokens for group in self.groups if group)

    def close(self, reason: str = "disconnected") -> None:
        """Let go of the engine rows (a no-op for those that finished) and count what the request did."""
        if self.ended is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
        cut = not self.finished() or self.timed_out
        self.ended = "timeout" if self.timed_out else (reason if cut else "finished")
        for gen in self.gens:
            gen.abort(reason)
        if self.metrics is not None:
            if self.ended != "finished":
                self.metrics.aborted.inc(1, tags={"reason": self.ended})
            generated = sum(c.completion_tokens for c in self.choices)
            self.metrics.prompt_tokens.inc(self.prompt_tokens)
            if self.cached_tokens():
                self.metrics.cached_tokens.inc(self.cached_tokens())
            if generated:  # Ray's counters refuse an increment of 0
                self.metrics.generated_tokens.inc(generated)
            self.metrics.latency.observe(time.monotonic() - self.t0)
            failures = sum(c.reply.tools.malformed for c in self.choices if c.reply.tools)
            if failures:
                self.metrics.tool_parse_failures.inc(failures)
