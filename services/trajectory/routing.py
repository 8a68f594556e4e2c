"""Which rollout worker serves a request (pure).

A session sticks to the worker that served its previous turn, so the worker's
prefix cache holds the conversation; it moves to the least loaded serving worker
when that worker is gone, not serving, or full.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from shared.heartbeats import WorkerHeartbeats
from shared.messages import WorkerStatus

PREFER_OTHER_WORKER_S = 2.0  # after a preemption, how long to wait for a worker other than the preempter


class WorkerTable(WorkerHeartbeats):
    """The latest heartbeat of every worker (shared/heartbeats.py), plus the requests this
    replica has sent since that heartbeat (so a burst does not all land on one worker)."""

    def __init__(self, stale_after: float):
        super().__init__(stale_after)
        self.inflight: Counter[str] = Counter()

    def load(self, s: WorkerStatus) -> float:
        # the heartbeat's count already includes some of ours: take the larger, not the sum
        return max(s.running, self.inflight[s.worker_id]) / max(s.capacity, 1)

    def choose(self, now: float, sticky: str | None = None, exclude: frozenset[str] = frozenset()) -> str | None:
        candidates = [s for s in self.serving(now) if s.worker_id not in exclude]
        if not candidates:
            return None
        by_id = {s.worker_id: s for s in candidates}
        if sticky in by_id and self.load(by_id[sticky]) < 1.0:
            return sticky
        return min(candidates, key=lambda s: (self.load(s), s.worker_id)).worker_id

    def others(self, now: float, exclude: frozenset[str]) -> bool:
        """Is any worker outside `exclude` alive (heartbeat fresh), serving or not?"""
        return any(w not in exclude for w in self.alive(now))

    def max_model_len(self, now: float, default: int) -> int:
        lens = [s.max_model_len for s in self.serving(now)]
        return min(lens) if lens else default


@dataclass
class Picker:
    """The choice of a worker for one dispatch, asked again while none fits (pure: the caller
    passes the time and does the waiting).

    Sticky first, then least loaded. After a preemption (`exclude` holds the workers that
    preempted this request) it waits up to PREFER_OTHER_WORKER_S for another worker before
    going back to one of those, but only if another worker is alive at all."""

    table: WorkerTable
    sticky: str | None
    exclude: frozenset[str]
    prefer_other_until: float
    give_up_at: float

    @classmethod
    def start(cls, table: WorkerTable, now: float, sticky: str | None, exclude: frozenset[str],
              worker_wait: float) -> "Picker":
        prefer = bool(exclude) and table.others(now, exclude)
        return cls(table, sticky, exclude, now + (PREFER_OTHER_WORKER_S if prefer else 0.0), now + worker_wait)

    def choose(self, now: float) -> str | None:
        """A worker to dispatch to now, or None: ask again a little later (until `expired`)."""
        w = self.table.choose(now, self.sticky, self.exclude)
        if w is None and now >= self.prefer_other_until:
            w = self.table.choose(now, self.sticky)
        return w

    def expired(self, now: float) -> bool:
        return now > self.give_up_at
