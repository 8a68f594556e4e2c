"""Issue 30: NATS without a single point of failure. A real 3-server JetStream cluster on this
machine; every stream at 3 replicas (SF_JETSTREAM_REPLICAS). Mid-traffic the TRAJECTORIES leader
is SIGKILLed, brought back, then a second server (the one the publisher is connected to) is killed.
The clients, given the comma-separated seed list, reconnect; the durable consumer resumes; every
published message is delivered, and the publisher had no failure beyond its bounded retries.
Also: start-up never lowers an existing stream's replicas or limits."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from nats.js.api import ConsumerConfig

from seamlessflow.stack.servers import NatsCluster
from shared import bus, subjects
from shared.config import Connections

pytestmark = pytest.mark.integration

N = 600
log = logging.getLogger(__name__)


@pytest.fixture
def cluster(tmp_path):
    c = NatsCluster(tmp_path / "nats", 3, log_dir=tmp_path).start()
    yield c
    c.stop()


async def until(what, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            got = await check()
            if got:
                return got
        except AssertionError:
            raise
        except Exception as e:  # the cluster is electing: try again
            last = e
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout}s (last error: {last!r})")


async def ensure_r3(js):
    async def made():
        await bus.ensure_streams(js, subjects.streams(replicas=3))
        return True
    await until("streams created at R3", made)


async def leader(js, stream: str = subjects.TRAJECTORIES_STREAM) -> str:
    async def elected():
        info = await js.stream_info(stream)
        return info.cluster.leader if info.cluster else None
    return await until(f"{stream} leader", elected)


async def all_current(js, stream: str = subjects.TRAJECTORIES_STREAM) -> bool:
    info = await js.stream_info(stream)
    return bool(info.cluster and info.cluster.leader and len(info.cluster.replicas or []) == 2
                and all(r.current and not r.offline for r in info.cluster.replicas))


@pytest.mark.slow  # ~25 s: two leader elections and a catch-up (pyproject.toml)
async def test_streams_survive_losing_their_leader_then_another_server(cluster):
    conn = Connections(nats_url=cluster.url)
    assert conn.nats_servers == cluster.url.split(",")
    pub, sub = await bus.connect(conn, "publisher"), await bus.connect(conn, "consumer")
    js = pub.jetstream()
    try:
        await ensure_r3(js)
        for s in subjects.streams(replicas=3):
            assert (await js.stream_info(s.name)).config.num_replicas == 3
        cjs = sub.jetstream()
        await until("consumer", lambda: cjs.add_consumer(subjects.TRAJECTORIES_STREAM, ConsumerConfig(
            durable_name="trainer", ack_policy="explicit", ack_wait=5.0, filter_subject=subjects.TRAJ_COMPLETED,
            num_replicas=3)))
        psub = await cjs.pull_subscribe_bind("trainer", subjects.TRAJECTORIES_STREAM)
        got: set[int] = set()
        published: list[int] = []

        async def publish():
            for i in range(N):
                await bus.publish_durable(js, subjects.TRAJ_COMPLETED, str(i).encode(), f"m{i}", timeout=2.0,
                                          retry_for=60.0)
                published.append(i)
                await asyncio.sleep(0.01)

        async def consume():
            while len(got) < N:
                try:
                    msgs = await psub.fetch(50, timeout=1.0)
                except Exception:  # a timeout, or the consumer's leader is moving: fetch again
                    continue
                for m in msgs:
                    got.add(int(m.data))
                    try:
                        await m.ack_sync(timeout=2.0)
                    except Exception:
                        pass  # redelivered after ack_wait: a set absorbs the second copy

        tasks = [asyncio.create_task(publish()), asyncio.create_task(consume())]

        async def _true(v: bool) -> bool:  # a failed task fails the test now, not at the end
            for t in tasks:
                if t.done() and t.exception():
                    raise AssertionError(f"{t.get_coro().__name__} failed: {t.exception()!r}")
            return v
        await until("traffic under way", lambda: _true(len(published) > N // 5))
        first = await leader(js)
        log.info("killing the leader %s at %d published, %d received", first, len(published), len(got))
        cluster.kill(int(first[1:]))  # names are n0, n1, n2
        await until("a new leader", lambda: _leader_other_than(js, first), timeout=15)
        await until("traffic after the first kill", lambda: _true(len(published) > N // 2), timeout=60)
        log.info("restarting %s at %d published, %d received", first, len(published), len(got))
        cluster.start(int(first[1:]))
        await until("the restarted server caught up", lambda: all_current(js), timeout=60)
        second = next(i for i, p in enumerate(cluster.ports) if f":{p}" in (pub.connected_url.netloc or ""))
        reconnects = pub.stats["reconnects"]
        log.info("killing n%d (the publisher's) at %d published, %d received", second, len(published), len(got))
        cluster.kill(second)
        await until("all published", lambda: _true(len(published) == N), timeout=60)
        log.info("all published; %d received", len(got))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert pub.stats["reconnects"] > reconnects  # the publisher moved to another member
        assert published == list(range(N))
        assert got == set(range(N))
        info = await js.stream_info(subjects.TRAJECTORIES_STREAM)
        assert info.state.messages == N  # each once: retried publishes were de-duplicated by Msg-Id
        cinfo = await cjs.consumer_info(subjects.TRAJECTORIES_STREAM, "trainer")
        assert cinfo.num_pending == 0
    finally:
        await bus.wait_closed(pub)
        await bus.wait_closed(sub)


async def _leader_other_than(js, old: str):
    info = await js.stream_info(subjects.TRAJECTORIES_STREAM)
    return info.cluster and info.cluster.leader and info.cluster.leader != old


async def test_start_up_never_lowers_replicas_or_limits(cluster, caplog):
    nc = await bus.connect(Connections(nats_url=cluster.url), "ops")
    js = nc.jetstream()
    try:
        await ensure_r3(js)
        traj = next(s for s in subjects.streams(replicas=3) if s.name == subjects.TRAJECTORIES_STREAM)
        before = (await js.stream_info(traj.name)).config
        caplog.set_level(logging.WARNING, "shared.bus")
        from dataclasses import replace
        smaller = replace(traj, num_replicas=1, max_bytes=1 << 20, max_msgs=10)
        await bus.ensure_streams(js, [smaller])
        after = (await js.stream_info(traj.name)).config
        assert (after.num_replicas, after.max_bytes, after.max_msgs) == (3, before.max_bytes, before.max_msgs)
        assert f"nats stream edit {traj.name} --replicas 1 --max-bytes {1 << 20} --max-msgs 10" in caplog.text
        larger = replace(traj, max_bytes=before.max_bytes * 2 if before.max_bytes > 0 else -1)
        await bus.ensure_streams(js, [larger])
        assert (await js.stream_info(traj.name)).config.max_bytes == larger.max_bytes  # raising is applied
    finally:
        await bus.wait_closed(nc)
