"""shared/bus.py stream_request over real NATS: replies arrive in order, `ready()` takes
what has arrived, one inbox subscription per connection serves every request, and a
closed connection leaves no routing state behind."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from shared import bus
from shared.config import Connections

pytestmark = pytest.mark.integration


async def test_streamed_requests_share_one_inbox_and_leave_nothing_behind(nats_url):
    conn = Connections(nats_url=nats_url)
    responder = await bus.connect(conn, name="responder")

    async def on(msg):
        for part in (b"1", b"2", b"3"):
            await responder.publish(msg.reply, msg.data + part)

    await responder.subscribe("test.bus.echo", cb=on)
    await responder.flush()
    nc = await bus.connect(conn, name="caller")
    try:
        subs_before = None
        for i in range(5):
            async with bus.stream_request(nc, "test.bus.echo", f"r{i}-".encode(), 5, 5) as replies:
                first = await anext(replies)
                await asyncio.sleep(0.05)  # the rest arrive meanwhile
                got = [first, *replies.ready()]
            assert got == [f"r{i}-{k}".encode() for k in (1, 2, 3)]
            if subs_before is None:
                subs_before = len(nc._subs)
            assert len(nc._subs) == subs_before  # no subscription per request
        with pytest.raises(bus.BusUnavailable):
            async with bus.stream_request(nc, "test.bus.nobody", b"x", 5, 5) as replies:
                await anext(replies)
    finally:
        await bus.wait_closed(nc)
        await bus.wait_closed(responder)
    ref = weakref.ref(nc)
    del nc
    gc.collect()
    assert ref() is None  # the reply mux does not keep a closed connection alive
