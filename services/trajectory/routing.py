"""Which rollout worker serves a request (pure).

A session sticks to the worker that served its previous turn, so the worker's
prefix cache holds the conversation, as long as that worker serves the newest weight
version and is not full. Otherwise the choice goes, in order, to a worker that is not
full, at the newest version, least loaded (running / capacity), with the most capacity.

Predicted lending: which requests a worker the tag scheduler lent (`WorkerStatus.lent_until`,
its predicted reclaim time) takes is shared/lending.py's `takes_turn`, the rule the simulator
runs too: the request's expected length (`LengthHistory`: the 90th percentile of its GRPO
group's recent replies) at the worker's speed (`DecodeSpeed.measured`, from its heartbeats'
token counts) with the request added to its batch. Under rule "fit" only requests predicted
to finish before the reclaim; under "migrate" (the default) any request whose partial tokens
are worth more than re-prefilling them where the reclaim moves them. Requests a lent worker
does not take go to workers that are not lent, if any serve.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from shared.heartbeats import WorkerHeartbeats
from shared import lending
from shared.lending import DEFAULT_RULE, REPREFILL_RATIO, DecodeSpeed, LengthHistory, Rule
from shared.messages import WorkerStatus

__all__ = ["LengthHistory", "Picker", "WorkerTable"]  # LengthHistory lives in shared/lending.py

PREFER_OTHER_WORKER_S = 2.0  # after a preemption, how long to wait for a worker other than the preempter
RATE_EWMA = 0.3  # weight of the newest heartbeat interval in a worker's token rate


class WorkerTable(WorkerHeartbeats):
    """The latest heartbeat of every worker (shared/heartbeats.py), plus the requests this
    replica has sent since that heartbeat (so a burst does not all land on one worker)."""

    def __init__(self, stale_after: float, rule: Rule = DEFAULT_RULE):
        super().__init__(stale_after)
        self.inflight: Counter[str] = Counter()
        self.rates: dict[str, float] = {}  # worker id -> generated tokens/s, a running mean of heartbeats
        self.reprefill_ratio = REPREFILL_RATIO if rule == "migrate" else None  # shared/lending.py's rule

    def update(self, status: WorkerStatus) -> None:
        prev = self.get(status.worker_id)
        if prev is not None and status.ts > prev.ts and status.generated_tokens >= prev.generated_tokens:
            rate = (status.generated_tokens - prev.generated_tokens) / (status.ts - prev.ts)
            old = self.rates.get(status.worker_id)
            self.rates[status.worker_id] = rate if old is None else RATE_EWMA * rate + (1 - RATE_EWMA) * old
        super().update(status)

    def instance(self, worker: str) -> str:
        """The process id (WorkerStatus.instance) `worker` last reported; "" if unknown."""
        s = self.get(worker)
        return s.instance if s is not None else ""

    def same_process(self, worker: str, instance: str, now: float) -> bool:
        """Is `worker` alive and still the process `instance`? A worker restarted under the same id
        beats as fresh as ever, but the streams its predecessor served are gone."""
        s = self.get(worker)
        return self.is_alive(worker, now) and (not instance or s is None or s.instance == instance)

    def load(self, s: WorkerStatus) -> float:
        # the heartbeat's count already includes some of ours: take the larger, not the sum
        return max(s.running, self.inflight[s.worker_id]) / max(s.capacity, 1)

    def finishes_in_time(self, s: WorkerStatus, now: float, expected_tokens: float | None) -> bool:
        """Does this (lent) worker take a request of `expected_tokens`? shared/lending.py's
        `takes_turn`, at the worker's measured speed with the request added to its batch (True when
        the worker is not lent or nothing is measured; False once lent_until has passed)."""
        speed = DecodeSpeed.measured(self.rates.get(s.worker_id, 0.0))
        step = speed.step_s(max(s.running, self.inflight[s.worker_id]) + 1) if speed else None
        return lending.takes_turn(now, s.lent_until, expected_tokens, step, reprefill_ratio=self.reprefill_ratio)

    def choose(self, now: float, sticky: str | None = None, exclude: frozenset[str] = frozenset(),
               expected_tokens: float | None = None) -> str | None:
        candidates = [s for s in self.serving(now) if s.worker_id not in exclude]
        if not candidates:
            return None
        fits = [s for s in candidates if self.finishes_in_time(s, now, expected_tokens)]
        candidates = fits or candidates
        newest = max(s.version for s in candidates)
        by_id = {s.worker_id: s for s in candidates}
        if sticky in by_id and self.load(by_id[sticky]) < 1.0 and by_id[sticky].version == newest:
            return sticky
        return min(candidates, key=lambda s: (self.load(s) >= 1.0, -s.version, self.load(s), -s.capacity,
                                              s.worker_id)).worker_id

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
    expected_tokens: float | None = None  # for predicted lending (WorkerTable.finishes_in_time)

    @classmethod
    def start(cls, table: WorkerTable, now: float, sticky: str | None, exclude: frozenset[str],
              worker_wait: float, expected_tokens: float | None = None) -> "Picker":
        prefer = bool(exclude) and table.others(now, exclude)
        return cls(table, sticky, exclude, now + (PREFER_OTHER_WORKER_S if prefer else 0.0), now + worker_wait,
                   expected_tokens)

    def choose(self, now: float) -> str | None:
        """A worker to dispatch to now, or None: ask again a little later (until `expired`)."""
        w = self.table.choose(now, self.sticky, self.exclude, self.expected_tokens)
        if w is None and now >= self.prefer_other_until:
            w = self.table.choose(now, self.sticky, expected_tokens=self.expected_tokens)
        return w

    def expired(self, now: float) -> bool:
        return now > self.give_up_at
