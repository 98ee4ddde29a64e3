"""A stream's events between the engine and its handler (serve/inflight.py:Inbox), without a server."""
from __future__ import annotations

import asyncio

from minimind_ray.serve.inflight import Inbox


def test_tokens_gather_for_the_interval_and_a_reply_s_end_cuts_the_wait_short():
    """Tokens wait for the stream interval (one chunk for several); the end of a reply does not: a client that
    waits for its reply before it sends the next request would idle for the rest of the interval."""

    async def scenario():
        inbox, loop = Inbox(), asyncio.get_running_loop()
        inbox.put(0, ("token", 5))
        loop.call_later(0.01, inbox.put, 0, ("token", 6))
        await inbox.gather(0.2)  # no end: the whole interval
        tokens = [event for _, event, _ in inbox.items]
        inbox.items = []
        loop.call_later(0.01, inbox.put, 0, ("end", "stop"))
        # a 600 s interval, cut short by the end (wait_for would raise after 60 s if it were not)
        await asyncio.wait_for(inbox.gather(600.0), 60.0)
        ended = [event for _, event, _ in inbox.items]
        inbox.items = [(0, ("end", "stop"), 0.0)]
        await asyncio.wait_for(inbox.gather(600.0), 60.0)  # an end already there: no wait at all
        return tokens, ended

    tokens, ended = asyncio.run(scenario())
    assert tokens == [("token", 5), ("token", 6)] and ended == [("end", "stop")]
