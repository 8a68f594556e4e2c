"""Issue 30: two scheduler instances, one leader (a lease in Redis with a term, leader.py).
Real processes: two schedulers and two host agents (no resident worker), on a NATS and a Redis
of the test's own. The leader is SIGKILLed; the standby leads within 5 s and rebuilds from the
registry; a deposed leader's late assignment, injected on the HOSTS stream, is ignored by the host
agent; no host applies two assignments for one epoch or goes back in epochs (one mode at a time)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import redis.asyncio as aioredis

from seamlessflow.stack import servers
from services.scheduler import leader
from shared import bus, subjects
from shared.codec import decode
from shared.config import Connections
from shared.messages.scheduler import HostAssignment, HostHeartbeat, HostModeChanged, SchedulerLeader

pytestmark = pytest.mark.integration


@pytest.fixture
def infra(tmp_path):
    nport, rport = servers.free_port(), servers.free_port()
    nats = servers.start_nats(nport, tmp_path / "nats")
    redis = servers.start_redis(rport, tmp_path / "redis")
    yield Connections(nats_url=f"nats://127.0.0.1:{nport}", redis_url=f"redis://127.0.0.1:{rport}/0")
    servers.stop(nats)
    servers.stop(redis)


class Procs:
    def __init__(self, conn: Connections, logs):
        self.conn, self.logs, self.procs = conn, logs, {}

    def start(self, name: str, module: str, **env: str) -> None:
        full = {**os.environ, "PYTHONPATH": os.getcwd(), "SF_NATS_URL": self.conn.nats_url,
                "SF_REDIS_URL": self.conn.redis_url, **env}
        out = open(self.logs / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", module], env=full, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


async def until(what: str, check, timeout: float, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(every)
    raise AssertionError(f"{what} not within {timeout}s")


async def test_the_standby_leads_within_5s_and_a_deposed_leaders_assignment_is_ignored(infra, tmp_path):
    procs = Procs(infra, tmp_path)
    nc = await bus.connect(infra, "test")
    r = aioredis.from_url(infra.redis_url)
    beats: dict[str, HostHeartbeat] = {}
    changed: list[HostModeChanged] = []
    terms: list[SchedulerLeader] = []

    async def on_beat(msg):
        hb = decode(msg.data, HostHeartbeat)
        beats[hb.host] = hb

    await nc.subscribe(subjects.SCHED_HOST, cb=on_beat)
    async def on_changed(msg):
        changed.append(decode(msg.data, HostModeChanged))

    async def on_leader(msg):
        terms.append(decode(msg.data, SchedulerLeader))

    await nc.subscribe(subjects.SCHED_CHANGED, cb=on_changed)
    await nc.subscribe(subjects.SCHED_LEADER, cb=on_leader)
    sched = {"SF_SCHEDULER_POLICY": "disaggregated", "SF_SCHEDULER_LEASE_S": "3"}
    try:
        procs.start("sched-a", "services.scheduler", SF_SCHEDULER_INSTANCE="a", **sched)
        await until("a leads", lambda: "leading as a, term 1" in procs.log("sched-a"), 60, 0.3)
        procs.start("sched-b", "services.scheduler", SF_SCHEDULER_INSTANCE="b", **sched)
        await until("b stands by", lambda: "standby: a:1 leads" in procs.log("sched-b"), 60, 0.3)
        procs.start("host-0", "services.scheduler.host", SF_HOST_ID="host-0", SF_HOST_TAGS="train,cpu")
        procs.start("host-1", "services.scheduler.host", SF_HOST_ID="host-1", SF_HOST_TAGS="rollout,cpu")
        first = leader.first_epoch(1)
        await until("both hosts assigned by term 1",
                    lambda: all(beats.get(h) and beats[h].epoch > first for h in ("host-0", "host-1")), 90, 0.3)
        before = {h: (beats[h].mode, beats[h].epoch) for h in ("host-0", "host-1")}

        procs.kill("sched-a")
        killed = time.monotonic()
        await until("b leads", lambda: any(t.term == 2 and t.instance == "b" for t in terms), 10, 0.05)
        took = time.monotonic() - killed
        print(f"the standby led {took:.2f} s after the leader's SIGKILL")
        assert took <= 5.0
        assert (await r.get(leader.LEADER_KEY)) == b"b:2"
        assert "leading as b, term 2 (took over)" in procs.log("sched-b")
        await asyncio.sleep(1.5)  # the hosts heard term 2 as the test did

        # a deposed leader's late assignment: term 1, newer than anything term 1 issued
        late = HostAssignment("host-1", "idle", first + 999, "late, from the deposed leader", issued_at=time.time())
        await bus.publish_durable(nc.jetstream(), subjects.sched_assign("host-1"), late, "late-1")
        await until("the host ignored it", lambda: "ignoring assignment epoch" in procs.log("host-1"), 10, 0.2)
        await asyncio.sleep(2.0)
        assert (beats["host-1"].mode, beats["host-1"].epoch) == before["host-1"]
        assert all(c.epoch != late.epoch for c in changed)

        # one mode at a time: per host, each applied epoch once and in order
        for h in ("host-0", "host-1"):
            epochs = [c.epoch for c in changed if c.host == h]
            assert epochs == sorted(set(epochs)), (h, epochs)
    finally:
        procs.stop()
        await r.aclose()
        await bus.wait_closed(nc)

