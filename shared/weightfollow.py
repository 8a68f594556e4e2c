"""Following published weight versions: the newest `WeightsPublished`, pushed and polled.

A core subscription to sf.weights.published delivers each event at once (a JetStream publish
is also a core message), and the event itself is used: the stream's last value can lag the
push. The WEIGHTS stream's last value is also read at start and every `poll` seconds, so a
follower that starts late, missed an event or was disconnected jumps to the newest version.

    follower = WeightFollower(nc, on_newest, poll=5.0, malformed=service_malformed)
    task = asyncio.create_task(follower.run())      # until cancelled

`on_newest` gets the newest event known at each wake-up (it may be one it saw before) and
decides what to do with it: the rollout worker loads a newer version, the trajectory manager
records the policy version. Callers own the connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared import subjects, weightstore
from shared.deadletter import Malformed
from shared.messages.weights import WeightsPublished

log = logging.getLogger(__name__)

OnNewest = Callable[[WeightsPublished], Awaitable[None]]


def newest(*events: WeightsPublished | None) -> WeightsPublished | None:
    """The highest version among `events` (None where none is known)."""
    known = [e for e in events if e is not None]
    return max(known, key=lambda e: e.version) if known else None


class WeightFollower:
    def __init__(self, nc: NATS, on_newest: OnNewest, poll: float, malformed: Malformed | None = None):
        self.nc, self.on_newest, self.poll = nc, on_newest, poll
        # the service's: counts and dead-letters an event it cannot read (without one: counted and logged)
        self.malformed = malformed if malformed is not None else Malformed("weightfollow")
        self._pushed: list[WeightsPublished] = []
        self._hint = asyncio.Event()

    async def _on_published(self, msg: Msg) -> None:
        ev = self.malformed.decode(msg, WeightsPublished, subjects.WEIGHTS_PUBLISHED)
        if ev is not None:
            self._pushed.append(ev)
            self._hint.set()

    async def _last_value(self) -> WeightsPublished | None:
        try:
            return await weightstore.current(self.nc.jetstream())
        except Exception as e:  # NATS reconnecting, or no WEIGHTS stream yet: the push or the next poll
            log.debug("weights poll: %s", e)
            return None

    async def run(self) -> None:
        sub = await self.nc.subscribe(subjects.WEIGHTS_PUBLISHED, cb=self._on_published)
        try:
            while True:
                pushed, self._pushed = self._pushed, []
                event = newest(await self._last_value(), *pushed)
                if event is not None:
                    await self.on_newest(event)
                try:
                    await asyncio.wait_for(self._hint.wait(), self.poll)
                except TimeoutError:
                    pass
                self._hint.clear()
        finally:
            try:
                await sub.unsubscribe()
            except Exception as e:  # the connection is closing: nothing to unsubscribe from
                log.debug("weights unsubscribe: %s", e)
