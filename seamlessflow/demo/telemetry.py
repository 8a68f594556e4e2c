"""What the demo watches while it runs, over NATS: rollout workers' heartbeats
(sf.rollout.status), published weight versions (sf.weights.published) and, when the stack
runs the tag scheduler, each host's mode (SchedulerControl "status") and, at the end, every
host's timeline (SchedulerControl "timeline").

It keeps the latest state for the live view (seamlessflow/demo/live.py) and the sampled history
for the report (seamlessflow/demo/report.py); it knows nothing about either's drawing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import msgspec

from shared import bus, subjects
from shared.codec import decode
from shared.config import Connections
from shared.messages import WeightsPublished, WorkerStatus
from shared.messages.scheduler import HostInfo


@dataclass
class Sample:
    """One heartbeat as received (wall clock)."""

    ts: float
    worker: str
    state: str
    version: int
    generated_tokens: int
    host: str = ""


@dataclass
class Telemetry:
    conn: Connections
    scheduler: bool = False  # the stack runs with --policy: poll the scheduler too
    host_poll_s: float = 2.0
    workers: dict[str, WorkerStatus] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    published: list[tuple[float, int]] = field(default_factory=list)  # (wall clock, version)
    hosts: list[HostInfo] = field(default_factory=list)
    policy: str = ""
    _nc: object = None
    _poller: asyncio.Task | None = None

    @property
    def version(self) -> int:
        """The newest weight version published, or the newest any worker serves."""
        served = max((s.version for s in self.workers.values()), default=0)
        return max(served, self.published[-1][1] if self.published else 0)

    async def start(self) -> None:
        self._nc = await bus.connect(self.conn, name="sf-demo-telemetry")
        await self._nc.subscribe(subjects.ROLLOUT_STATUS, cb=self._on_status)
        # JetStream publishes are ordinary NATS messages too: a core subscriber sees them live
        await self._nc.subscribe(subjects.WEIGHTS_PUBLISHED, cb=self._on_weights)
        if self.scheduler:
            self._poller = asyncio.create_task(self._poll_hosts())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._nc is not None:
            await bus.wait_closed(self._nc)
            self._nc = None

    def serving(self) -> set[str]:
        """The workers whose latest heartbeat says they serve."""
        return {w for w, s in self.workers.items() if s.state == "serving"}

    async def wait_serving(self, n: int, timeout: float, every: float = 0.5) -> set[str]:
        """Until `n` workers serve (by their heartbeats); TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.serving()) < n:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{len(self.serving())} of {n} rollout workers serving after {timeout:.0f}s")
            await asyncio.sleep(every)
        return self.serving()

    async def host_timeline(self) -> dict | None:
        """Every host's activity intervals (seamlessflow/ops/hosts.py timeline_doc), or None
        without a scheduler."""
        if not self.scheduler:
            return None
        from seamlessflow.ops import hosts

        try:
            return hosts.timeline_doc(await hosts.ask(self.conn, "timeline", timeout=10))
        except SystemExit:  # ask() says so for operators; here the report just goes without
            return None

    async def _on_status(self, msg) -> None:
        try:
            s = decode(msg.data, WorkerStatus)
        except msgspec.DecodeError:  # undecodable, or another type (ValidationError is a DecodeError)
            return
        self.workers[s.worker_id] = s
        self.samples.append(Sample(s.ts, s.worker_id, s.state, s.version, s.generated_tokens, s.host))

    async def _on_weights(self, msg) -> None:
        try:
            w = decode(msg.data, WeightsPublished)
        except msgspec.DecodeError:  # undecodable, or another type (ValidationError is a DecodeError)
            return
        self.published.append((w.published_at or time.time(), w.version))

    async def _poll_hosts(self) -> None:
        from seamlessflow.ops import hosts

        while True:
            try:
                reply = await hosts.ask(self.conn, "status", timeout=self.host_poll_s)
                self.hosts, self.policy = list(reply.hosts), reply.policy
            except (SystemExit, bus.BusUnavailable, TimeoutError):
                pass  # no scheduler yet (or busy): keep the last answer
            await asyncio.sleep(self.host_poll_s)
