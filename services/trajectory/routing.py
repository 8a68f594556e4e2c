"""Which rollout worker serves a request (pure).

A session sticks to the worker that served its previous turn, so the worker's
prefix cache holds the conversation, as long as that worker serves the newest weight
version, is not full and is not much busier than another: a worker at least
more than `REBALANCE` (a quarter of its slots) less loaded takes the turn instead, so that a worker
the scheduler has just lent is not left idle while every session sticks to the workers
that served its earlier turns (the turn's context is prefilled again there, a small cost
against a turn decoded on an idle worker). Otherwise the choice goes, in order, to a
worker that is not full, at the newest version, least loaded (running / capacity), with
the most capacity.

Predicted lending: which requests a worker the tag scheduler lent (`WorkerStatus.lent_until`,
its predicted reclaim time) takes is shared/lending.py's `takes_turn`, the rule the simulator
runs too: the request's expected length (`LengthHistory`: the 90th percentile of its GRPO
group's recent replies) at the worker's speed (`DecodeSpeed.measured`, from its heartbeats'
token counts, taken only from heartbeats where it generated: a worker that slept while lent
out of rollout keeps the speed it served at, it does not look slow) with the request added
to its batch. Under rule "fit" only requests predicted
to finish before the reclaim; under "migrate" (the default) any request whose partial tokens
are worth more than re-prefilling them where the reclaim moves them. Requests a lent worker
does not take go to workers that are not lent, if any serve.

Rebalancing (`WorkerTable.moves`): a worker that starts serving (a lend, a restart) takes turns only as
new ones come, and with admission bounded by staleness the turns in flight may all sit on the
workers that served before it: a lent host then idles until their turns end (live, SIMULATED, 2 hosts:
a quarter of the lend window). So when a worker comes back to serving, each worker more than
`REBALANCE` more loaded hands it its share of the load difference: the trajectory manager ends those
requests on the busy worker (`RolloutControl(op="abort", scheduled=True)`: no failure counted) and they
re-dispatch with their partial tokens to the least loaded worker, the new one. The youngest requests
move (the least context to prefill again, the most tokens left to decode). Each replica moves only its
own requests, in proportion to its share of the busy worker's load.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.heartbeats import WorkerHeartbeats
from shared import lending
from shared.lending import DEFAULT_RULE, REBALANCE, REPREFILL_RATIO, DecodeSpeed, LengthHistory, Rule
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
        # only intervals where it generated: an idle or sleeping worker's rate is not its speed (a worker
        # lent after sleeping would otherwise look slow, and takes_turn would give it nothing)
        if prev is not None:
            rate = lending.busy_rate(self.rates.get(status.worker_id), prev.ts, prev.generated_tokens, status.ts,
                                     status.generated_tokens, RATE_EWMA)
            if rate is not None:
                self.rates[status.worker_id] = rate
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
        best = min(candidates, key=lambda s: (self.load(s) >= 1.0, -s.version, self.load(s), -s.capacity,
                                              s.worker_id))
        if sticky in by_id:
            mine = by_id[sticky]
            if self.load(mine) < 1.0 and mine.version == newest and self.load(mine) <= self.load(best) + REBALANCE:
                return sticky
        return best.worker_id

    def moves(self, now: float, worker: str, mine: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
        """`worker` has just begun serving: the (worker, request id) pairs to move to it, taken from
        `mine` (this replica's requests on each worker, oldest first). Each serving worker at the newest
        version more than REBALANCE more loaded gives up the running sequences that even the two out
        (by load: running / capacity), this replica its share of them, its youngest first."""
        new = self.get(worker)
        serving = {s.worker_id: s for s in self.serving(now)}
        if new is None or worker not in serving:
            return []
        newest = max(s.version for s in serving.values())
        out: list[tuple[str, str]] = []
        got = max(new.running, self.inflight[worker])
        for s in sorted(serving.values(), key=lambda s: s.worker_id):
            ids = mine.get(s.worker_id) or ()
            if s.worker_id == worker or not ids or s.version < newest:
                continue
            busy = max(s.running, self.inflight[s.worker_id], len(ids))
            k = lending.rebalanced(busy, s.capacity, got, new.capacity, REBALANCE)
            k = min(math.floor(k * len(ids) / busy), len(ids))  # this replica's share
            out += [(s.worker_id, rid) for rid in list(ids)[len(ids) - k:]]
            got += k
        return out

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
