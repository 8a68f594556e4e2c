"""Which turns a lent rollout worker takes: one rule for the live router and the simulator.

    from shared.lending import DecodeSpeed, LengthHistory, takes_turn
    ok = takes_turn(now, worker.lent_until, history.expected(group), speed.step_s(worker.running + 1))

The tag scheduler lends a train host to rollout until `lent_until`, its predicted reclaim. A
reclaim vacates the host: what it still runs migrates with its partial tokens (partial
rollout) and is prefilled again where it lands. Two rules decide which turns a lent worker
takes (`Rule`):

- "fit": only a turn predicted to end before `lent_until`, so a reclaim finds little to move.
- "migrate": any turn, as long as re-prefilling what the reclaim moves costs less than the
  rollout the lent worker adds: the tokens it decodes before the reclaim, each worth a token
  decoded at full batch elsewhere, against the context those tokens make, prefilled again at
  `reprefill_ratio` of that cost per token.

A turn's length is predicted by `LengthHistory` (a high quantile of recent replies, its GRPO
group's first); a worker's speed by `DecodeSpeed` (a decode step of `a + b*k` seconds for `k`
running sequences), taken at the batch the worker has with the turn added. The live router
(services/trajectory/routing.py) and the simulator (services/scheduler/sim/simulator.py) call
`takes_turn` and `lent_offer`; the policy's lend verdict (services/scheduler/policy.py) calls
`offer_worth` on the same figures.

This module knows nothing about NATS, heartbeats or virtual time: numbers in, answers out.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

Rule = Literal["fit", "migrate"]
RULES: tuple[Rule, ...] = ("fit", "migrate")
# measured in the simulator on the one-gpu calibration (docs/capacity-planning.md, "Which turns a lent
# host takes"): "fit" with the live length predictor finds almost no turn that fits a lend window
DEFAULT_RULE: Rule = "migrate"
# a re-prefilled token against a token decoded at full batch, where the live router has no measure of
# its own: prefill is compute-bound and several times faster per token (one-gpu: 0.17; decode-heavy: 0.22)
REPREFILL_RATIO = 0.25
# a sticky worker yields to one at least this much less loaded (running / capacity): 2 of 8 slots; and a
# worker that begins serving takes from those more loaded than it by this much (`rebalanced`)
REBALANCE = 0.25
QUANTILE = 0.9  # LengthHistory's: the requests a reclaim catches are the long ones


class LengthHistory:
    """Expected reply length (tokens) per GRPO group: the `quantile` of the group's recent
    replies, falling back to that of all recent replies. Bounded: the oldest groups are
    forgotten."""

    def __init__(self, keep: int = 4096, per_group: int = 16, overall: int = 256, quantile: float = QUANTILE):
        self.keep, self.quantile = keep, quantile
        self.by_group: dict[Hashable, deque[float]] = {}
        self.per_group = per_group
        self.recent: deque[float] = deque(maxlen=overall)
        self._recent_q: float | None = None  # the quantile of `recent`, until it changes

    def record(self, group: Hashable, tokens: float) -> None:
        lengths = self.by_group.pop(group, None) or deque(maxlen=self.per_group)
        lengths.append(tokens)
        self.by_group[group] = lengths  # re-inserted: the most recently used group is kept longest
        self.recent.append(tokens)
        self._recent_q = None
        while len(self.by_group) > self.keep:
            self.by_group.pop(next(iter(self.by_group)))

    def record_recent(self, tokens: list[float]) -> None:
        """Replies of groups that are over (no member will ask again): only the overall window."""
        self.recent.extend(tokens)
        self._recent_q = None

    def expected(self, group: Hashable | None) -> float | None:
        lengths = self.by_group.get(group) if group is not None else None
        if lengths:
            return quantile(lengths, self.quantile)
        if self._recent_q is None and self.recent:
            self._recent_q = quantile(self.recent, self.quantile)
        return self._recent_q


    def remaining(self, group: Hashable | None, done: float) -> float | None:
        """Tokens a reply that has `done` so far still has to go: the `quantile` of the recent replies
        longer than `done` (its group's, else all), less `done`. A reply that has run long is predicted
        to run longer where lengths have a tail, and nearly done where they do not. None: no recent
        reply was that long (nothing to predict from)."""
        lengths = self.by_group.get(group) if group is not None else None
        above = [x for x in (lengths or self.recent) if x > done]
        return quantile(above, self.quantile) - done if above else None


def quantile(values, q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


@dataclass(frozen=True, slots=True)
class DecodeSpeed:
    """A worker's decode step: `a_s + b_s * k` seconds for `k` running sequences, one token each."""

    a_s: float
    b_s: float

    def step_s(self, running: float) -> float:
        return self.a_s + self.b_s * running

    @classmethod
    def measured(cls, tokens_per_s: float) -> DecodeSpeed | None:
        """From a worker's measured throughput alone (its heartbeats' token counts): one figure cannot
        separate the fixed part from the per-sequence part, so the whole step is taken as per
        sequence (a = 0): throughput does not grow with the batch, the pessimistic reading for a
        busy worker. None: nothing measured yet."""
        return cls(0.0, 1.0 / tokens_per_s) if tokens_per_s > 0 else None


def busy_rate(old: float | None, prev_ts: float, prev_tokens: int, ts: float, tokens: int,
              ewma: float = 0.3) -> float | None:
    """A worker's decode throughput (tokens/s), a running mean over the heartbeat intervals in which it
    generated (`prev_*` and `ts`/`tokens`: two heartbeats' time and generated-token count). An interval
    with no new token leaves it as it was: a worker that slept or idled is not slow, and a lent worker
    judged by its sleep would be given nothing. None: nothing measured yet. The live router
    (services/trajectory/routing.py) and the scheduler's offer (services/scheduler/registry.py) both read it."""
    if ts <= prev_ts or tokens <= prev_tokens:
        return old
    rate = (tokens - prev_tokens) / (ts - prev_ts)
    return rate if old is None else ewma * rate + (1 - ewma) * old


def takes_turn(now: float, lent_until: float, expected_tokens: float | None, step_s: float | None,
               context_tokens: float = 0.0, reprefill_ratio: float | None = None) -> bool:
    """Does a lent worker take a turn of `expected_tokens`, decoded at `step_s` seconds a token
    (its speed at its batch with this turn added), carrying `context_tokens` (prompt and earlier
    turns)? `reprefill_ratio` None: rule "fit"; a number: rule "migrate" with that cost ratio.

    True when the worker is not lent (lent_until 0) or there is nothing to predict from; False
    once lent_until has passed (the scheduler drains a lent host by setting it to now)."""
    if lent_until <= 0:
        return True
    if lent_until <= now:
        return False
    if not expected_tokens or not step_s or step_s <= 0:
        return True
    window = lent_until - now
    if expected_tokens * step_s <= window:
        return True
    if reprefill_ratio is None:
        return False
    decoded = window / step_s  # what the worker adds before the reclaim moves the turn on
    return reprefill_ratio * (context_tokens + decoded) < decoded


def rebalanced(busy: float, busy_slots: float, got: float, new_slots: float, threshold: float) -> int:
    """How many of a worker's `busy` running sequences (of `busy_slots`) a worker that has just begun
    serving (`got` running of `new_slots`: a lend) takes from it: those that even the two out by load
    (running / slots), when the busy one is more than `threshold` more loaded; 0 otherwise. The live
    router (services/trajectory/routing.py `WorkerTable.moves`) and the simulator (Options.rebalance)
    move them with their partial tokens."""
    bs, ns = max(busy_slots, 1.0), max(new_slots, 1.0)
    if busy <= 0 or busy / bs - got / ns <= threshold:
        return 0
    even = (busy + got) / (bs + ns)  # the load both end at
    return max(0, min(math.floor(busy - even * bs), math.floor(ns - got)))


class LendHistory:
    """How long recent lends lasted (a worker's serving from the lend to the reclaim), to check the
    scheduler's predicted reclaim (`lent_until`) against. The prediction divides the samples still
    missing by the recent completion rate, which right after a publish still measures the previous
    batch's tail: one-gpu at split 60, 80 s predicted at the lend's start (median) for 22 s lent."""

    def __init__(self, keep: int = 16):
        self.recent: deque[float] = deque(maxlen=keep)

    def record(self, seconds: float) -> None:
        if seconds > 0:
            self.recent.append(seconds)

    def window(self, now: float, lent_until: float, began: float) -> float:
        """The rest of a lend that began at `began`, predicted to end at `lent_until` (0: no reclaim
        predicted): the sooner of the prediction and the median of recent lends' measured length.
        inf when neither predicts an end."""
        end = lent_until if lent_until > 0 else math.inf
        if self.recent:
            end = min(end, began + quantile(self.recent, 0.5))
        return end - now


def level(busy: float, busy_slots: float, got: float, new_slots: float) -> float:
    """The batch a worker that has begun serving (`got` running of `new_slots`) ends at once a busier
    one (`busy` of `busy_slots`) has evened their loads: `rebalanced`'s level, in its sequences."""
    return (busy + got) / max(busy_slots + new_slots, 1.0) * new_slots


@dataclass(frozen=True, slots=True)
class Move:
    """One request a worker that has just begun serving (a lend) might take from a busier one:
    `remaining` tokens to go (LengthHistory.remaining; None: unknown), `context` tokens so far
    (prompt and generated: what is prefilled again where it lands, at `prefill_s` a token). Where it
    is, it decodes at `busy_step_s` a token after `wait_s` for a slot (a request queued in a full
    engine), beside `busy_running` others; moved, at `lent_step_s` (the new worker's step with it
    added), once the new worker has done the `lent_stall_s` of prefill it owes before this one's
    (the requests moved to it before this one). Its re-prefill there delays the `lent_batch`
    sequences the new worker runs meanwhile: its batch once the rebalance has evened the loads
    (`level`). Counting only those it runs at the move left one-gpu at split 60 with 38% of the
    generated tokens re-prefilled against 30% without rebalance, and 1.22x against 1.26x at a dear
    re-prefill (bench/pipeline.py --rebalance)."""

    remaining: float | None
    context: float
    busy_step_s: float
    lent_step_s: float
    prefill_s: float
    wait_s: float = 0.0
    busy_running: int = 0
    lent_batch: float = 0.0
    lent_stall_s: float = 0.0


def move_worth(m: Move, window_s: float) -> float:
    """Seconds that a move saves, net of its re-prefill: worth moving when > 0. `rebalanced` says
    how many requests a worker takes at most; this says which.

    Saved: how much sooner the request finishes (on the lent worker after the prefill owed there and
    its own), counted within `window_s` (the rest of the lend: LendHistory.window; inf where no
    reclaim is predicted), since what still runs on the lent worker at the reclaim moves again.
    Cost: its re-prefill delays the `lent_batch` sequences there; and where it would not finish
    before the reclaim, the reclaim's re-prefill of its context and what it decoded there delays
    it and the `busy_running` others on a busy worker again.

    Short turns on an idle lent worker are worth moving (live, 2 hosts: each decodes several times
    faster there); the long requests a rebalance finds running under a long tail of lengths are not
    (bench/pipeline.py --rebalance, one-gpu: they outlast the lend and pay twice)."""
    if m.remaining is None or window_s <= 0:
        return -math.inf
    prefill = m.context * m.prefill_s
    here = m.wait_s + m.remaining * m.busy_step_s
    starts = m.lent_stall_s + prefill  # when it decodes its first token there
    there = starts + m.remaining * m.lent_step_s
    saved = min(here, window_s) - min(there, window_s)
    cost = prefill * m.lent_batch
    if there > window_s:  # still running at the reclaim: moved again, with what it decoded there
        decoded = max(0.0, window_s - starts) / max(m.lent_step_s, 1e-12)
        cost += (m.context + decoded) * m.prefill_s * (1 + m.busy_running)
    return saved - cost


@dataclass(frozen=True, slots=True)
class Offer:
    """The work lent hosts would be given: `turns` waiting for a slot (beyond what the hosts that
    stay serving take), shared by `hosts` lent hosts of `slots` sequences decoding at `speed`,
    each turn predicted `expected_tokens` long and carrying `context_tokens` (prompt, earlier
    turns). `reprefill_ratio` None: rule "fit"; a number: rule "migrate" (takes_turn).
    `refill`: a slot whose turn ends takes the next of the turns waiting (as a worker does), so
    more turns than slots keep a lent host busy for the whole window; False: each slot serves one
    turn, then nothing (the reading before `refill` existed)."""

    turns: int
    hosts: int
    expected_tokens: float | None
    speed: DecodeSpeed
    slots: int
    context_tokens: float = 0.0
    reprefill_ratio: float | None = None
    refill: bool = False


def lent_offer(o: Offer, now: float, lent_until: float, running: int, free: int) -> int:
    """How many of its `free` slots a lent host running `running` offers now: the first ones whose
    turn `takes_turn` at the batch they make (running + 1, running + 2, ...); a turn that does not
    fit at a batch does not fit at a bigger one."""
    if free <= 0:
        return 0
    if lent_until <= 0 or not o.expected_tokens:
        return free
    if lent_until <= now:
        return 0
    lo, hi = 0, free  # the first `lo` slots fit: bisect on the batch size (step_s grows with it)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if takes_turn(now, lent_until, o.expected_tokens, o.speed.step_s(running + mid), o.context_tokens,
                      o.reprefill_ratio):
            lo = mid
        else:
            hi = mid - 1
    return lo


def offer_worth(o: Offer, window_s: float) -> float:
    """Seconds of rollout one of `o.hosts` lent hosts adds if lent for `window_s` (from the end of
    the lend to the reclaim): the tokens it decodes on its share of the turns that `lent_offer`
    gives it, each worth a token decoded at full batch, less re-prefilling what the reclaim
    moves. 0 when it would be given nothing: a lent host that receives nothing is pure loss."""
    if o.hosts <= 0 or window_s <= 0 or o.turns <= 0:
        return 0.0
    taken = lent_offer(o, 0.0, window_s, 0, min(o.slots, math.ceil(o.turns / o.hosts)))
    if taken <= 0:
        return 0.0
    step = o.speed.step_s(taken)
    length = o.expected_tokens or math.inf
    if o.refill and math.isfinite(length):
        return taken * _slot_tokens_refilled(o, taken, length, window_s / step) * o.speed.step_s(o.slots) / o.slots
    decoded = min(length, window_s / step)  # per turn: until it ends, or until the reclaim moves it
    moved = 0.0 if length * step <= window_s else (o.reprefill_ratio or 0.0) * (o.context_tokens + decoded)
    return taken * (decoded - moved) * o.speed.step_s(o.slots) / o.slots


def _slot_tokens_refilled(o: Offer, taken: int, length: float, capacity: float) -> float:
    """Tokens one of `taken` slots adds before the reclaim, `capacity` tokens of decode time, when a
    slot whose turn ends takes the next waiting turn: its share of the turns (`o.turns / o.hosts /
    taken`), each `length` long, until the window is full. Rule "fit" takes only turns that still
    end before the reclaim (whole turns); "migrate" runs the last one into the reclaim, which moves
    it: the re-prefill of its context is taken off."""
    turns = max(1.0, o.turns / o.hosts / taken)  # this slot's share of the work waiting (one turn at least)
    if not math.isfinite(capacity) or turns * length <= capacity:
        return turns * length  # all of its share ends before the reclaim
    if o.reprefill_ratio is None:
        return min(turns, math.floor(capacity / length)) * length
    cut = capacity % length if capacity >= length else capacity  # the partial turn the reclaim moves
    return capacity - min(cut, o.reprefill_ratio * (o.context_tokens + cut))  # it adds nothing, at worst
