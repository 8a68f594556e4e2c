"""Which rollout worker serves a request (pure).

A session sticks to the worker that served its previous turn, so the worker's
prefix cache holds the conversation; it moves to the least loaded serving worker
when that worker is gone, not serving, or full.
"""

from __future__ import annotations

from collections import Counter

from shared.messages import WorkerStatus


class WorkerTable:
    """The latest heartbeat of every worker, plus the requests this replica has sent
    since that heartbeat (so a burst does not all land on one worker)."""

    def __init__(self, stale_after: float):
        self.stale_after = stale_after
        self.status: dict[str, WorkerStatus] = {}
        self.inflight: Counter[str] = Counter()

    def update(self, status: WorkerStatus) -> None:
        self.status[status.worker_id] = status

    def serving(self, now: float) -> list[WorkerStatus]:
        return [
            s for s in self.status.values()
            if s.state == "serving" and now - s.ts <= self.stale_after
        ]

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
        return any(w not in exclude and now - s.ts <= self.stale_after for w, s in self.status.items())

    def max_model_len(self, now: float, default: int) -> int:
        lens = [s.max_model_len for s in self.serving(now)]
        return min(lens) if lens else default
