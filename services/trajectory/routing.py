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
own requests, in proportion to its share of the busy worker's load. With the worth test
(SF_TRAJECTORY_REBALANCE_WORTH, on by default) that share is an upper bound: a request moves only
where shared/lending.py `move_worth` says it finishes sooner, within the rest of the lend, by more than
its re-prefill costs (the simulator runs the same test): its remaining length from `LengthHistory`
(given what it has generated), the two workers' measured speeds at their batches, a re-prefilled token
at REPREFILL_RATIO of a token decoded at full batch, and the rest of the lend the sooner of `lent_until`
and the recent lends' measured length (`LendHistory`, from heartbeats: serving with `lent_until` set,
then not serving).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.heartbeats import WorkerHeartbeats
from shared import lending
from shared.lending import (DEFAULT_RULE, REBALANCE, REPREFILL_RATIO, DecodeSpeed, LendHistory, LengthHistory, Move,
                            Rule)
from shared.messages import WorkerStatus

__all__ = ["LengthHistory", "Picker", "Running", "WorkerTable"]  # LengthHistory lives in shared/lending.py


@dataclass(slots=True)
class Running:
    """One request this replica runs on a worker: the tokens it was dispatched with (`context`: the
    prompt, and on a re-dispatch what it had generated before), the tokens it has generated there
    since, and its budget (max_tokens of the dispatch). What the rebalance's worth test reads."""

    context: int = 0
    generated: int = 0
    budget: int = 0

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
        self.lengths = LengthHistory()  # replies this replica saw (chat.py records them): predicted lending
        self.lends = LendHistory()  # how long lends lasted, by heartbeats: the rebalance's worth test
        self.serving_since: dict[str, float] = {}  # worker id -> when its heartbeats began saying "serving"

    def update(self, status: WorkerStatus) -> None:
        prev = self.get(status.worker_id)
        was = prev is not None and prev.state == "serving"
        if status.state == "serving" and not was:
            self.serving_since[status.worker_id] = status.ts
        elif was and status.state != "serving" and prev.lent_until > 0:  # a lent worker stopped: a reclaim
            self.lends.record(status.ts - self.serving_since.pop(status.worker_id, status.ts))
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

    def sends_receipts(self, worker: str) -> bool:
        """Does `worker` answer a Generate with a receipt when asked (WorkerStatus.receipts)? False if unknown."""
        s = self.get(worker)
        return s is not None and s.receipts

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

    def moves(self, now: float, worker: str, mine: Mapping[str, Sequence[str]],
              running: Mapping[str, Running] | None = None) -> list[tuple[str, str]]:
        """`worker` has just begun serving: the (worker, request id) pairs to move to it, taken from
        `mine` (this replica's requests on each worker, oldest first). Each serving worker at the newest
        version more than REBALANCE more loaded gives up at most the running sequences that even the two
        out (by load: running / capacity), this replica its share of them, its youngest first. With
        `running` (what each request has done: the worth test) only those `move_worth` approves."""
        new = self.get(worker)
        serving = {s.worker_id: s for s in self.serving(now)}
        if new is None or worker not in serving:
            return []
        newest = max(s.version for s in serving.values())
        out: list[tuple[str, str]] = []
        got = max(new.running, self.inflight[worker])
        for s in sorted(serving.values(), key=lambda s: s.worker_id):
            ids = list(mine.get(s.worker_id) or ())
            if s.worker_id == worker or not ids or s.version < newest:
                continue
            busy = max(s.running, self.inflight[s.worker_id], len(ids))
            k = lending.rebalanced(busy, s.capacity, got, new.capacity, REBALANCE)
            k = min(math.floor(k * len(ids) / busy), len(ids))  # this replica's share
            if k <= 0:
                continue
            took = ids[len(ids) - k:] if running is None else self._worth(now, s, new, ids, busy, got, k, running)
            out += [(s.worker_id, rid) for rid in took]
            got += len(took)
        return out

    def _worth(self, now: float, busy_w: WorkerStatus, new: WorkerStatus, ids: list[str], busy: int, got: int,  # noqa: PLR0913 - the two workers' state and the share, as moves has them
               k: int, running: Mapping[str, Running]) -> list[str]:
        """Of this replica's requests `ids` on `busy_w` (oldest first), the first `k` from the youngest
        that shared/lending.py's `move_worth` approves, each at the batches the moves before it left;
        returned oldest first. Requests past the busy worker's slots wait in its engine for one. With no
        speed measured on either worker nothing can be predicted: the share moves, as without the test."""
        rate_b = self.rates.get(busy_w.worker_id, 0.0)
        rate_n = self.rates.get(new.worker_id, 0.0) or rate_b  # a worker never measured: taken as the busy one
        if rate_b <= 0 or rate_n <= 0:
            return ids[len(ids) - k:]
        fast, slow = DecodeSpeed(0.0, 1.0 / rate_n), DecodeSpeed(0.0, 1.0 / rate_b)  # DecodeSpeed.measured
        cap = max(busy_w.capacity, 1)
        window = self.lends.window(now, new.lent_until, self.serving_since.get(new.worker_id, now))
        expected = self.lengths.expected(None)
        waiting = max(0, busy - cap)  # the youngest wait for a slot in the busy worker's engine
        pf = REPREFILL_RATIO / rate_n  # a re-prefilled token, against one decoded at full batch (1 / rate)
        batch = lending.level(busy, cap, got, new.capacity)  # the new worker's, once the two are even
        took: list[int] = []
        stall = 0.0
        for idx in range(len(ids) - 1, -1, -1):
            if len(took) >= k:
                break
            r = running.get(ids[idx]) or Running()
            left = max(0, r.budget - r.generated) if r.budget else None
            ahead = self.lengths.remaining(None, r.generated)
            ahead = left if ahead is None else (ahead if left is None else min(ahead, left))
            queued = idx - (len(ids) - waiting) + 1  # its place in the busy worker's queue (<= 0: running)
            wait = queued * (expected or ahead or 0.0) * slow.step_s(cap) / cap if queued > 0 else 0.0
            m = Move(ahead, r.context + r.generated, slow.step_s(min(busy, cap)), fast.step_s(got + 1), pf, wait,
                     busy_running=min(busy, cap) - 1, lent_batch=batch, lent_stall_s=stall)
            if lending.move_worth(m, window) > 0:
                took.append(idx)
                stall += (r.context + r.generated) * pf
                busy -= 1
                got += 1
        return [ids[i] for i in sorted(took)]

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
