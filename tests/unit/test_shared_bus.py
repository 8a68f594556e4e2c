"""shared/bus.py without a server: streamed replies, the reply mux, the bounded drain, and the
durable publish's bounded retry, the streams' declaration's bounded wait for JetStream.

Only the connection is faked; Replies, _ReplyMux and wait_closed are the real code."""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import pytest
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from shared import bus, subjects


class Msg:
    def __init__(self, subject: str = "", data: bytes = b"", headers: dict | None = None):
        self.subject, self.data, self.headers = subject, data, headers


async def test_replies_come_in_order_and_ready_takes_what_has_arrived():
    r = bus.Replies("sf.x", first_timeout=1.0, idle_timeout=1.0)
    for d in (b"a", b"b", b"c"):
        r.queue.put_nowait(Msg(data=d))
    assert await r.__anext__() == b"a"
    assert r.ready() == [b"b", b"c"] and r.ready() == []


async def test_first_reply_and_idle_timeouts_differ():
    r = bus.Replies("sf.x", first_timeout=0.05, idle_timeout=5.0)
    with pytest.raises(bus.ReplyTimeout, match="0.1s"):
        await r.__anext__()
    r.queue.put_nowait(Msg(data=b"first"))
    assert await r.__anext__() == b"first"
    assert r._timeout == 5.0  # later replies get the idle timeout


async def test_with_a_receipt_the_first_token_timeout_counts_from_the_receipt():
    # a Generate that core NATS dropped: no receipt, found within the receipt timeout, not the first-reply one
    r = bus.Replies("sf.x", first_timeout=60.0, idle_timeout=30.0, receipt_timeout=0.05)
    with pytest.raises(bus.ReplyTimeout, match="no receipt on sf.x within 0.1s"):
        await r.__anext__()
    r.queue.put_nowait(Msg(data=b"receipt"))
    assert await r.__anext__() == b"receipt"
    assert r._timeout == 60.0  # then the first token, as long as vLLM's warm-up takes
    r.queue.put_nowait(Msg(data=b"token"))
    assert await r.__anext__() == b"token" and r._timeout == 30.0


async def test_a_receipt_taken_by_ready_moves_the_timeouts_on_too():
    r = bus.Replies("sf.x", first_timeout=60.0, idle_timeout=30.0, receipt_timeout=5.0)
    for d in (b"receipt", b"token"):
        r.queue.put_nowait(Msg(data=d))
    assert r.ready() == [b"receipt", b"token"] and r._timeout == 30.0


async def test_no_responders_is_a_typed_bus_unavailable():
    r = bus.Replies("sf.rollout.gen.w9", 1.0, 1.0)
    r.queue.put_nowait(Msg(headers={"Status": "503"}))
    with pytest.raises(bus.NoResponders, match="nobody serves sf.rollout.gen.w9") as info:
        await r.__anext__()
    assert isinstance(info.value, bus.BusUnavailable) and info.value.subject == "sf.rollout.gen.w9"


async def test_the_mux_routes_by_token_and_drops_late_replies():
    mux = bus._ReplyMux("_INBOX.abc")
    a, b = bus.Replies("s", 1, 1), bus.Replies("s", 1, 1)
    ta, tb = mux.open(a), mux.open(b)
    assert ta != tb
    await mux._on_msg(Msg(f"_INBOX.abc.{tb}", b"for b"))
    await mux._on_msg(Msg("_INBOX.abc.999", b"late"))  # a request that already ended: dropped
    assert b.ready() == [b"for b"] and a.ready() == []


class FailingDrain:
    def __init__(self):
        self.closed = 0

    async def drain(self):
        raise RuntimeError("connection reset")

    async def close(self):
        self.closed += 1


async def test_a_failed_drain_is_logged_once_per_cause_and_still_closes(caplog):
    caplog.set_level(logging.DEBUG, logger="shared.bus")
    bus._warn.seen.clear()
    nc1, nc2 = FailingDrain(), FailingDrain()
    await bus.wait_closed(nc1)
    await bus.wait_closed(nc2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "drain failed" in r.message]
    assert nc1.closed == nc2.closed == 1
    assert len(warnings) == 1 and "connection reset" in warnings[0].message


async def test_a_drain_that_hangs_is_bounded():
    class Hangs(FailingDrain):
        async def drain(self):
            await asyncio.sleep(60)

    nc = Hangs()
    await asyncio.wait_for(bus.wait_closed(nc, timeout=0.05), 2)
    assert nc.closed == 1


async def test_a_stream_whose_responder_goes_silent_ends_by_heartbeat_age_not_by_the_idle_timeout(monkeypatch):
    import asyncio
    import time

    from shared.bus import Replies, ReplyTimeout

    monkeypatch.setattr(Replies, "ALIVE_POLL", 0.1)  # 0.5 s in bus.py; the poll is what is under test
    alive = {"ok": True}
    r = Replies("sf.rollout.gen.w1", first_timeout=60.0, idle_timeout=60.0, alive=lambda: alive["ok"])
    asyncio.get_running_loop().call_later(0.15, lambda: alive.update(ok=False))
    t0 = time.monotonic()
    try:
        await r.__anext__()
    except ReplyTimeout as e:
        assert "heartbeat stale" in str(e)
    else:
        raise AssertionError("no timeout")
    assert time.monotonic() - t0 < 2 * Replies.ALIVE_POLL + 0.5  # not the 60 s idle timeout


async def test_a_live_responder_still_gets_its_timeout():
    import pytest

    from shared.bus import Replies, ReplyTimeout

    r = Replies("s", first_timeout=0.3, idle_timeout=0.3, alive=lambda: True)
    with pytest.raises(ReplyTimeout, match="within 0.3s"):
        await r.__anext__()


async def test_a_stream_ends_when_the_connection_reconnects_meanwhile(monkeypatch):
    # found by tests/faults: a NATS restart dropped a GenerateDone and the turn waited out the 60 s token timeout
    import time

    monkeypatch.setattr(bus.Replies, "ALIVE_POLL", 0.1)  # 0.5 s in bus.py: the reconnect is seen at a poll

    class Conn:
        is_connected = True
        stats = {"reconnects": 0}

        def new_inbox(self):
            return "_INBOX.rc"

        async def subscribe(self, subject, cb):
            pass

        async def publish(self, subject, payload, reply=""):
            pass

    nc = Conn()
    async with bus.stream_request(nc, "sf.rollout.gen.w1", b"", 60.0, 60.0) as replies:
        asyncio.get_running_loop().call_later(0.15, lambda: nc.stats.update(reconnects=1))
        t0 = time.monotonic()
        with pytest.raises(bus.ReplyTimeout, match="reconnected"):
            await replies.__anext__()
        assert time.monotonic() - t0 < 2 * bus.Replies.ALIVE_POLL + 0.5


class FlakyJetStream:
    """js.publish that raises the given errors in turn, then acks; it records each try's Nats-Msg-Id."""

    def __init__(self, *errors: Exception):
        self.errors = list(errors)
        self.tries: list[str] = []

    async def publish(self, subject, data, timeout, headers):
        self.tries.append(headers["Nats-Msg-Id"])
        if self.errors:
            raise self.errors.pop(0)


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(bus, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(bus, "RETRY_MAX_S", 0.02)


async def test_a_durable_publish_retries_what_an_outage_throws_with_the_same_msg_id(fast_backoff):
    js = FlakyJetStream(nats.errors.TimeoutError(), nats.errors.NoRespondersError(),
                        nats.errors.ConnectionReconnectingError(), ServiceUnavailableError())
    await bus.publish_durable(js, "sf.x", b"m", "id-1", retry_for=5.0)
    assert js.tries == ["id-1"] * 5


async def test_without_retry_for_the_first_error_is_raised(fast_backoff):
    js = FlakyJetStream(nats.errors.TimeoutError())
    with pytest.raises(nats.errors.TimeoutError):
        await bus.publish_durable(js, "sf.x", b"m", "id-1")
    assert len(js.tries) == 1


async def test_retries_stop_at_retry_for_with_the_last_error(fast_backoff):
    js = FlakyJetStream(*[nats.errors.TimeoutError() for _ in range(1000)])
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(nats.errors.TimeoutError):
        await bus.publish_durable(js, "sf.x", b"m", "id-1", retry_for=0.2)
    assert 0.2 <= asyncio.get_running_loop().time() - t0 < 1.0
    assert 5 <= len(js.tries) < 100


async def test_a_full_stream_and_a_refusal_are_not_retried(fast_backoff):
    full = ServiceUnavailableError(code=503, err_code=10077, description="maximum messages exceeded")
    js = FlakyJetStream(full)
    with pytest.raises(bus.StreamFull):
        await bus.publish_durable(js, "sf.x", b"m", "id-1", retry_for=5.0)
    js = FlakyJetStream(APIError(code=400, err_code=10058, description="stream name in subject does not match"))
    with pytest.raises(APIError):
        await bus.publish_durable(js, "sf.x", b"m", "id-1", retry_for=5.0)
    assert len(js.tries) == 1


class ElectingJetStream:
    """A JetStream whose first requests get no answer (a fresh cluster electing its meta leader), then
    has no streams: it records the streams added."""

    def __init__(self, silent: int):
        self.silent = silent
        self.asked = 0
        self.added: list[str] = []

    async def stream_info(self, name):
        self.asked += 1
        if self.asked <= self.silent:
            raise nats.errors.TimeoutError()
        raise NotFoundError()

    async def add_stream(self, cfg):
        self.added.append(cfg.name)


async def test_declaring_streams_waits_for_a_cluster_that_does_not_answer_yet(fast_backoff):
    """Found while building bench/ha_stack.py: streams declared right after a fresh 3-server cluster's
    servers listened timed out on the first stream_info (5 s), and the service failed its start."""
    js = ElectingJetStream(silent=3)
    wanted = subjects.streams(replicas=3)
    await bus.ensure_streams(js, iter(wanted), retry_for=5.0)  # an iterator too: read once, declared whole
    assert js.added == [s.name for s in wanted]


async def test_declaring_streams_gives_up_at_retry_for_with_the_last_error(fast_backoff):
    js = ElectingJetStream(silent=10_000)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(nats.errors.TimeoutError):
        await bus.ensure_streams(js, subjects.streams(replicas=1), retry_for=0.2)
    assert 0.2 <= asyncio.get_running_loop().time() - t0 < 1.0 and js.added == []


async def test_declaring_streams_does_not_retry_a_refusal(fast_backoff):
    class Refusing(ElectingJetStream):
        async def add_stream(self, cfg):
            raise APIError(code=400, err_code=10052, description="replicas > 1 not supported in non-clustered mode")

    js = Refusing(silent=0)
    with pytest.raises(APIError):
        await bus.ensure_streams(js, subjects.streams(replicas=3), retry_for=5.0)
    assert js.asked == 1
