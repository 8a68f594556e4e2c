"""Heartbeat tables: the latest report of every sender, and which senders are still alive (pure).

One table serves every listener of a periodic status: the trajectory manager's router, the
gateway's admin view and the trainer's served-version pins all keep the latest
`WorkerStatus` per worker; a scheduler keeps host heartbeats the same way, keyed by host id.

A report is alive while its age is at most `stale_after` seconds. The age is measured on the
clock the caller names in `beat(..., at=)` and `alive(now)`: the sender's own timestamp
(`WorkerStatus.ts`, wall clock) or the receive time (`time.monotonic()`); one table uses one.
This module knows nothing about NATS: service.py decodes the message and calls `beat`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from shared.messages.rollout import WorkerStatus
from shared.timeouts import HEARTBEAT_STALE_AFTER

V = TypeVar("V")


class Heartbeats(Generic[V]):
    """The latest value per key, with the time it was reported."""

    def __init__(self, stale_after: float = HEARTBEAT_STALE_AFTER):
        self.stale_after = stale_after
        self._latest: dict[str, tuple[V, float]] = {}

    def beat(self, key: str, value: V, at: float) -> None:
        """Record `value` as `key`'s latest report, made at time `at`."""
        self._latest[key] = (value, at)

    def forget(self, key: str) -> None:
        self._latest.pop(key, None)

    def get(self, key: str) -> V | None:
        found = self._latest.get(key)
        return found[0] if found else None

    def age(self, key: str, now: float) -> float | None:
        """Seconds since `key` last reported; None if it never did."""
        found = self._latest.get(key)
        return now - found[1] if found else None

    def is_alive(self, key: str, now: float) -> bool:
        age = self.age(key, now)
        return age is not None and age <= self.stale_after

    def alive(self, now: float) -> dict[str, V]:
        """Key -> latest value, for every sender whose report is at most `stale_after` old."""
        return {k: v for k, (v, at) in self._latest.items() if now - at <= self.stale_after}

    def fresh(self, now: float) -> list[V]:
        """The live values, ordered by key (stable for display and for ties)."""
        alive = self.alive(now)
        return [alive[k] for k in sorted(alive)]

    def latest(self) -> dict[str, V]:
        """Every sender's latest value, alive or not."""
        return {k: v for k, (v, _) in self._latest.items()}

    def __contains__(self, key: object) -> bool:
        return key in self._latest

    def __len__(self) -> int:
        return len(self._latest)

    def __iter__(self) -> Iterator[str]:
        return iter(self._latest)


class WorkerHeartbeats(Heartbeats[WorkerStatus]):
    """Rollout workers' `WorkerStatus` by worker id, aged by the worker's own `ts` (wall clock)."""

    def update(self, status: WorkerStatus) -> None:
        self.beat(status.worker_id, status, status.ts)

    def serving(self, now: float) -> list[WorkerStatus]:
        return [s for s in self.fresh(now) if s.state == "serving"]
