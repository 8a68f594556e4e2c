"""Publishing a finished session's TrajectoryCompleted: the step from `finishing` to `finished`.

`finish` stores the event in Redis (store.begin_finish) before the first attempt, so from then on
the trajectory is safe whatever happens to this replica. The replica publishing it holds a lease
(`sf:fin:<sid>:owner`, renewed at every attempt). While the stream is full (it discards nothing),
the publish is retried with bounded back-off (shared/backpressure.py) for up to `wait` seconds;
then the agent gets a 503 with Retry-After, and the publication goes on in the background: every
replica's `sweep` takes pending sessions whose lease lapsed (their replica died, or gave up waiting),
oldest first. The de-dup id `traj-<sid>` makes a second publication of the same event a no-op
within the stream's 120 s window, so a replica dying between the publish and the Redis update
costs nothing.

It knows neither NATS nor HTTP: `publish(event bytes, msg id)` is handed in by service.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import nats.errors

from services.trajectory.store import SessionNotFound, Store
from shared import bus
from shared.backpressure import backoff

log = logging.getLogger("sf.trajectory")

# what a later attempt may cure: a full stream, a NATS outage or timeout
RETRYABLE = (bus.StreamFull, bus.BusUnavailable, nats.errors.Error, TimeoutError, ConnectionError)
LEASE_MS = 3000
SWEEP_BATCH = 32


def msg_id(sid: str) -> str:
    return f"traj-{sid}"


class Publisher:
    def __init__(self, store: Store, publish: Callable[[bytes, str], Awaitable[None]], owner: str,
                 lease_ms: int = LEASE_MS, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.store, self._publish, self.owner = store, publish, owner
        self.lease_ms, self.clock, self.sleep = lease_ms, clock, sleep

    async def publish(self, sid: str, event: bytes, wait: float) -> bool:
        """Publish `sid`'s event, retrying with back-off for up to `wait` seconds. True once it is durable
        and the session is `finished`; False if it is still pending (a sweep carries on)."""
        deadline = self.clock() + wait
        attempt = 0
        while True:
            if await self.store.claim_finish(sid, self.owner, self.lease_ms):
                try:
                    await self._publish(event, msg_id(sid))
                except RETRYABLE as e:
                    if attempt == 0:
                        log.info("session %s: publication waits (%s: %s)", sid, type(e).__name__, e)
                else:
                    await self.store.finish_published(sid)
                    return True
            elif await self._finished(sid):  # another replica held the lease, and has published it
                return True
            delay = backoff(attempt)
            attempt += 1
            if self.clock() + delay > deadline:
                await self.store.release_finish(sid, self.owner)  # the next sweep, anywhere, takes it at once
                return False
            await self.sleep(delay)

    async def sweep(self, batch: int = SWEEP_BATCH) -> tuple[int, bool]:
        """One attempt for each of the oldest pending publications nobody holds. Returns (published, full):
        `full` when the stream refused one (the rest wait for the next sweep: order is kept)."""
        published = 0
        for sid in await self.store.pending_finishes(batch):
            if not await self.store.claim_finish(sid, self.owner, self.lease_ms):
                continue  # a live replica is on it
            event = await self.store.finishing_event(sid)
            if event is None:  # published and finished since the listing
                await self.store.release_finish(sid, self.owner)
                continue
            try:
                await self._publish(event, msg_id(sid))
            except RETRYABLE as e:
                await self.store.release_finish(sid, self.owner)
                return published, isinstance(e, bus.StreamFull)
            await self.store.finish_published(sid)
            published += 1
            log.info("session %s: pending trajectory published", sid)
        return published, False

    async def _finished(self, sid: str) -> bool:
        try:
            return (await self.store.session(sid))["status"] == "finished"
        except SessionNotFound:
            return False
