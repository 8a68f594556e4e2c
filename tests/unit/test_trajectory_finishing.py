"""services/trajectory/finishing.py with Redis and NATS faked at the edge: a finish retries while the
stream is full, within its wait and with bounded back-off; it gives the publication up to the sweep,
which takes it once nobody holds the lease; the gateway maps a pending finish to 503 + Retry-After."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError
from services.gateway.sessions import _check
from services.trajectory.finishing import Publisher
from shared import bus
from shared.messages import SessionReply


class Store:
    """The few store calls finishing.py makes, in memory; leases never lapse unless released."""

    def __init__(self):
        self.lease: dict[str, str] = {}
        self.status: dict[str, str] = {}
        self.events: dict[str, bytes] = {}

    async def claim_finish(self, sid, owner, lease_ms):
        if self.lease.get(sid, owner) != owner:
            return False
        self.lease[sid] = owner
        return True

    async def release_finish(self, sid, owner):
        if self.lease.get(sid) == owner:
            del self.lease[sid]

    async def finish_published(self, sid):
        self.status[sid] = "finished"
        self.events.pop(sid, None)
        self.lease.pop(sid, None)

    async def session(self, sid):
        return {"status": self.status.get(sid, "finishing")}

    async def pending_finishes(self, limit):
        return list(self.events)[:limit]

    async def finishing_event(self, sid):
        return self.events.get(sid)


class Clock:
    def __init__(self):
        self.t = 0.0
        self.sleeps: list[float] = []

    def __call__(self):
        return self.t

    async def sleep(self, d):
        self.sleeps.append(d)
        self.t += d


def stream(full_for: int):
    """A publish that finds the stream full `full_for` times, then succeeds."""
    sent: list[str] = []

    async def publish(event, msg_id):
        if len(sent) < full_for:
            sent.append("full")
            raise bus.StreamFull("maximum bytes exceeded")
        sent.append(msg_id)

    return publish, sent


def publisher(store, publish, clock, owner="a"):
    return Publisher(store, publish, owner, clock=clock, sleep=clock.sleep)


async def test_a_finish_retries_while_full_then_returns_once_durable():
    store, clock = Store(), Clock()
    publish, sent = stream(full_for=3)
    assert await publisher(store, publish, clock).publish("s1", b"ev", wait=5.0)
    assert sent == ["full", "full", "full", "traj-s1"] and store.status["s1"] == "finished"
    assert len(clock.sleeps) == 3 and all(0 < d <= 1.0 for d in clock.sleeps)


async def test_a_finish_gives_up_within_its_wait_and_leaves_the_publication_to_the_sweep():
    store, clock = Store(), Clock()
    publish, sent = stream(full_for=10**6)
    store.events["s1"] = b"ev"
    assert not await publisher(store, publish, clock).publish("s1", b"ev", wait=3.0)
    assert clock.t <= 3.0 and "s1" not in store.lease  # released: any replica's sweep takes it at once
    assert store.status.get("s1") is None and store.events["s1"] == b"ev"  # still pending, never lost


async def test_another_replica_holding_the_lease_is_waited_for():
    store, clock = Store(), Clock()
    store.lease["s1"] = "b"  # replica b is publishing it
    publish, sent = stream(full_for=0)

    async def b_finishes(d):
        clock.t += d
        store.status["s1"] = "finished"

    p = Publisher(store, publish, "a", clock=clock, sleep=b_finishes)
    assert await p.publish("s1", b"ev", wait=5.0) and sent == []  # published once, by b


async def test_the_sweep_publishes_oldest_first_and_stops_at_a_full_stream():
    store, clock = Store(), Clock()
    for sid in ("s1", "s2", "s3"):
        store.events[sid] = b"ev-" + sid.encode()
    store.lease["s2"] = "dead-replica"  # still leased: skipped this pass
    publish, sent = stream(full_for=0)
    assert await publisher(store, publish, clock).sweep() == (2, False)
    assert sent == ["traj-s1", "traj-s3"] and list(store.events) == ["s2"]

    del store.lease["s2"]  # the dead replica's lease lapsed
    full, _ = stream(full_for=1)
    assert await publisher(store, full, clock).sweep() == (0, True)
    assert store.events["s2"] and "s2" not in store.lease


@pytest.mark.parametrize("reply,status,retry_after,code", [
    (SessionReply(503, "s", "pending", retry_after=5.0, code="trajectory_pending"), 503, "5", "trajectory_pending"),
    (SessionReply(429, message="back-pressure", retry_after=2.5, code="backpressure"), 429, "3", "backpressure"),
    (SessionReply(429, message="staleness bound"), 429, "5", "admission_paused"),  # staleness admission as before
])
def test_the_gateway_answers_refusals_with_retry_after(reply, status, retry_after, code):
    with pytest.raises(ApiError) as e:
        _check(reply, "s")
    assert e.value.status == status and e.value.headers["retry-after"] == retry_after and e.value.code == code
