"""Where each host goes: the three placement policies as one pure function.

    decisions = decide(snapshot)      # Snapshot in, list[Decision] out; no I/O, no clock

The live scheduler (service.py) builds a `Snapshot` from heartbeats and its Redis
registry every tick; the simulator (sim/simulator.py) builds one in virtual time. Both call this
same code, so a policy measured in simulation is the policy that runs.

Tags decide what a host *may* do (`train`, `rollout`); the policy decides what it does:

- **disaggregated**: a static split. The *train pool* (the first `train_hosts` hosts
  tagged `train`, by id; 0 = all of them) trains; every other `rollout` host rolls out.
- **colocated**: every host alternates with the trainer. While the trainer wants its
  hosts (a batch is ready, computing or publishing), train-pool hosts train and the others
  idle, all with `hold` (rollout paused in keep mode: in-flight requests wait, they do not
  migrate, since there is nowhere to go). Otherwise every `rollout` host rolls out.
- **seamless**: disaggregated, plus lending. A train-pool host also tagged `rollout` is
  lent to rollout while the trainer waits for data, and reclaimed (vacated: its requests
  migrate with their partial tokens) as soon as a batch is ready. Lending is *predicted*:
  a host is lent only when the trainer's predicted wait, from the completion rate and the
  trajectories still missing, exceeds the switch cost (lend + reclaim) by `lend_margin`, or
  when no host outside the train pool can roll out (every rollout host dead or cordoned):
  the missing trajectories can then only come from the pool, whatever the rate of the last
  30 s says. The prediction alone would not lend there: when a rollout host's worker dies
  right after a reclaim, the trainer's buffer counts the members of groups the death left
  incomplete, so few trajectories look missing at the rate of the last 30 s, and the pool
  host would sit idle while the requests the death cut wait for that worker to restart.
  Where the caller knows the work a lent host would be given (`Snapshot.offer`: the turns
  waiting for a slot, the predicted length, the hosts' speed; shared/lending.py), a lend must
  also add more rollout than its switch takes: a host lent that receives no turn costs its
  switch and buys nothing. Without an offer (None) the wait alone decides.

  Two knobs trade the trainer's time for re-prefill (a reclaim vacates a lent host's running
  sequences, which carry their whole context to prefill again where they land):
  - `drain_margin_s`: a lent host's `lent_until` (what routers read: a lent host takes only
    turns predicted to end by then) is set this much before the predicted reclaim, so it
    stops admitting early and drains;
  - `reclaim_grace_s`: once the batch is ready, a lent host that still runs sequences is
    *drained* first: reassigned to rollout with `lent_until` = now (routers send it nothing
    new) and reclaimed when it reports no running sequence or the grace has run out since
    the trainer became ready (`Trainer.wants_since`). The trainer's gate waits meanwhile.
  Both default to 0 (reclaim at once); `seamlessflow plan` sweeps them.

  `renew_s` (0 = off; the live scheduler's default is 2 s): the predicted reclaim is a
  prediction. While the trainer still waits, a lent host whose `lent_until` comes within
  `renew_s / 2` of now (or has passed) is given `lent_until` = max(predicted reclaim,
  now + `renew_s`): a host that stays lent also stays open to turns. Without it, a wait
  longer than predicted leaves the lent host closed and idle until the batch is ready
  (live, 2 hosts on one core each: 3 s of an 8.5 s lend).

  With a grace, a lend the prediction got wrong costs the trainer up to the grace, so the
  lend verdict is stricter (docs/capacity-planning.md, "Lending with a grace", has the runs):
  - the grace counts as part of the switch: lend only if the predicted wait >
    `lend_margin` x (lend + reclaim + grace);
  - `lend_settle_s`: lend only once the trainer has waited this long for data
    (`Trainer.waiting_since`). Right after a publish the completion rate still measures the
    previous batch's tail, and the predicted wait is several times too long (SIMULATED, 16
    hosts, 5 train: 360-425 s predicted at the publish, 58-82 s actual; within ~20% 20 s on).
  Without a grace (the default) neither applies: lend if the predicted wait >
  `lend_margin` x (lend + reclaim).

  The switch costs start as configured priors (`Costs.measured` False) and are measured from
  then on. Until a lend of a train host is measured the margin is at most 1: with a higher
  margin on a prior that is too high nothing would ever lend, and the measurement that would
  correct the prior would never come. One lend settles it.

A host that is switching (its last assignment not yet applied) gets no new decision, so a
host has one mode at a time. An unhealthy host gets none either: when it comes back it
rejoins idle and is assigned afresh. Cordoned hosts go idle. Every decision carries the
host's next epoch; host agents ignore an assignment that is not newer than the last one
they applied.

This module knows nothing about NATS, Redis, vLLM or DeepSpeed; `plan.py`-style callers
turn a Decision into a HostAssignment, and `transition_steps` says what a host agent does
to apply one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from typing import Literal

from shared.lending import Offer, offer_worth
from shared.messages.scheduler import Activity, HostMode, PolicyName, TrainerState

POLICIES: tuple[PolicyName, ...] = ("colocated", "disaggregated", "seamless")
TRAINER_WANTS_HOSTS: frozenset[str] = frozenset({"ready", "computing", "publishing"})


@dataclass(frozen=True, slots=True)
class Host:
    id: str
    tags: frozenset[str]
    capacity: float = 1.0
    mode: HostMode = "idle"  # the mode it last applied
    target: HostMode = "idle"  # the mode it was last assigned; != mode while it switches
    epoch: int = 0  # of the last assignment issued to it
    healthy: bool = True
    cordoned: bool = False
    running: int = 0  # sequences its rollout worker runs, as last reported (the grace's drain)
    lent_until: float = 0.0  # of its last rollout assignment (0 = not lent, or no prediction)

    @property
    def can_train(self) -> bool:
        return "train" in self.tags

    @property
    def can_rollout(self) -> bool:
        return "rollout" in self.tags

    @property
    def switching(self) -> bool:
        return self.mode != self.target


@dataclass(frozen=True, slots=True)
class Trainer:
    state: TrainerState | Literal["absent"] = "absent"
    samples_needed: int = 0  # trajectories still missing for the next batch (0 when it is ready)
    wants_since: float = 0.0  # when it began to want its hosts (ready); the reclaim grace counts from it
    waiting_since: float = 0.0  # when it last began to wait for data; the lend settle counts from it

    @property
    def wants_hosts(self) -> bool:
        return self.state in TRAINER_WANTS_HOSTS


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds a switch takes, as measured (the live scheduler keeps running means)."""

    lend_s: float = 1.0  # train -> rollout: offload, wake, load the current version, resume
    reclaim_s: float = 1.0  # rollout -> train: vacate (requests migrate), sleep, reload
    # False while lend_s is the configured prior (no lend of a train host measured yet): the lend
    # verdict then asks for a margin of at most 1, so one lend measures the switch (see lend_verdict)
    measured: bool = True


@dataclass(frozen=True, slots=True)
class Snapshot:
    policy: PolicyName
    now: float
    hosts: tuple[Host, ...]
    trainer: Trainer = Trainer()
    completion_rate: float = 0.0  # finished trajectories per second, recently
    costs: Costs = Costs()
    lend_margin: float = 1.5  # lend only if predicted wait > lend_margin * (lend_s + reclaim_s + reclaim_grace_s)
    train_hosts: int = 0  # size of the train pool (first N train-tagged hosts by id); 0 = all
    drain_margin_s: float = 0.0  # a lent host's lent_until is this much before the predicted reclaim
    reclaim_grace_s: float = 0.0  # batch ready: a lent host still running sequences drains this long at most
    # with a grace: lend only once the trainer has waited this long for data (30 s: the live completion
    # rate's window, registry.RATE_WINDOW, so that the rate then counts only this wait's completions)
    lend_settle_s: float = 30.0
    # the work a lent host would be given (shared/lending.py), where the caller knows it: a lend must buy
    # more rollout than margin x the switch costs. None: not known (lend on the predicted wait alone)
    offer: Offer | None = None
    # while the trainer waits, a lent host's lent_until is kept at least renew_s/2 ahead (0: never renewed)
    renew_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    host: str
    mode: HostMode
    epoch: int
    reason: str
    hold: bool = False  # to train/idle: pause in keep mode instead of vacating (colocated)
    lent_until: float = 0.0  # to rollout on a train-pool host: take no turn predicted to end after this


def train_pool(s: Snapshot) -> frozenset[str]:
    """The hosts the trainer's ranks run on: train-tagged, first `train_hosts` by id."""
    ids = sorted([h.id for h in s.hosts if "train" in h.tags])  # can_train, inlined: 4,096-host snapshots
    return frozenset(ids[: s.train_hosts] if s.train_hosts > 0 else ids)


def predicted_wait(trainer: Trainer, rate: float) -> float:
    """Seconds until the trainer has its next batch, at the recent completion rate."""
    if trainer.samples_needed <= 0:
        return 0.0
    return math.inf if rate <= 0 else trainer.samples_needed / rate


def _can_roll_out_outside(s: Snapshot, pool: frozenset[str]) -> bool:
    """Is there a healthy, uncordoned rollout host outside the train pool (serving or on its way)?"""
    return any(h.healthy and not h.cordoned and h.can_rollout and h.id not in pool for h in s.hosts)


def lend_verdict(s: Snapshot, others_roll_out: bool | None = None) -> tuple[bool, str]:
    """Is lending the train pool worth it now? (seamless only) `others_roll_out`: _can_roll_out_outside,
    when the caller has it already (decide: one pass over the hosts, not two)."""
    if s.trainer.state == "absent" or s.trainer.state == "stopped":
        return True, "no trainer running"
    if s.trainer.wants_hosts:
        return False, f"trainer {s.trainer.state}"
    if s.reclaim_grace_s > 0 and s.now < s.trainer.waiting_since + s.lend_settle_s:
        return False, (f"settling: waited {s.now - s.trainer.waiting_since:.1f}s < {s.lend_settle_s:g}s "
                       f"(grace {s.reclaim_grace_s:g}s)")
    if not (_can_roll_out_outside(s, train_pool(s)) if others_roll_out is None else others_roll_out):
        return True, "no host outside the train pool can roll out"
    # the drain margin is cut from the window: a lent host takes no turn in its last drain_margin_s
    wait = predicted_wait(s.trainer, s.completion_rate) - s.drain_margin_s
    cost = s.costs.lend_s + s.costs.reclaim_s + s.reclaim_grace_s  # a lend may hold the trainer the grace
    # its inputs in the reason, so that a scheduler log shows what a prediction rested on
    what = (f"predicted wait ({s.trainer.samples_needed} samples at {s.completion_rate:.1f}/s)"
            + (f" - drain {s.drain_margin_s:g}s" if s.drain_margin_s else ""))
    # the priors are a guess: a margin above 1 on a guess never lends where the guess is too high, so the
    # measurement that would correct it never comes (live: margin 4, a 1 s prior, a 0.3 s lend: 0 lends)
    margin = s.lend_margin if s.costs.measured else min(s.lend_margin, 1.0)
    how = f"{margin:g} x switch {cost:.2f}s" + ("" if s.costs.measured else " (prior: margin <= 1 until a lend is measured)")
    if wait <= margin * cost:
        return False, f"{what} {wait:.1f}s <= {how}"
    if s.offer is not None:
        return _offer_verdict(s, wait, cost)
    return True, f"{what} {wait:.1f}s > {how}"


def _offer_verdict(s: Snapshot, wait: float, cost: float) -> tuple[bool, str]:
    """Lend only if the work a lent host would be given (Snapshot.offer) adds more rollout, in
    seconds of a host decoding at full batch, than its switch takes: a host lent that receives
    nothing costs its switch and buys nothing. (The margin is the predicted wait's: the offer
    counts only the turns waiting now, fewer than a lent host takes as turns end elsewhere.)"""
    o = s.offer
    worth = offer_worth(o, wait - s.costs.lend_s - s.costs.reclaim_s)  # served from the lend to the reclaim
    what = f"a lent host adds {worth:.1f}s of rollout ({o.turns} turns waiting for {o.hosts} hosts)"
    if worth > cost:
        return True, f"{what} > switch {cost:.2f}s"
    return False, f"{what} <= switch {cost:.2f}s"


def draining(s: Snapshot, h: Host) -> bool:
    """Seamless, batch ready: does this lent host finish its running sequences before the
    reclaim? Yes while it runs any and the grace since the trainer became ready lasts."""
    return _drains(_grace_lasts(s), h)


def _grace_lasts(s: Snapshot) -> bool:
    """draining's part that reads only the snapshot (decide asks it once, not once per host)."""
    return s.reclaim_grace_s > 0 and s.now < s.trainer.wants_since + s.reclaim_grace_s


def _drains(grace_lasts: bool, h: Host) -> bool:
    return grace_lasts and h.mode == "rollout" and h.target == "rollout" and h.running > 0


def _closed(h: Host, now: float) -> bool:
    """Does the host's lent_until already keep routers from sending it a new turn?"""
    return 0.0 < h.lent_until <= now


def _earlier(s: Snapshot, h: Host, reclaim_at: float) -> bool:
    """With a drain margin: has the predicted reclaim moved well before the host's lent_until?
    (A tenth of the margin, at least 1 s, so that lent_until is not re-sent every tick.)"""
    if s.drain_margin_s <= 0 or not math.isfinite(reclaim_at) or _closed(h, s.now):
        return False
    return h.lent_until <= 0 or reclaim_at < h.lent_until - max(1.0, s.drain_margin_s / 10)


def _renew(s: Snapshot, h: Host) -> bool:
    """With renew_s: is a lent host's lent_until (a prediction the wait outlasted) about to close it
    while the trainer still waits?"""
    return s.renew_s > 0 and h.lent_until > 0 and h.lent_until - s.now < s.renew_s / 2


def _wanted(s: Snapshot, h: Host, pool: frozenset[str], lend: tuple[bool, str]) -> tuple[HostMode, str, bool]:
    """(mode, reason, hold) the policy wants for one healthy host."""
    if h.cordoned:
        return "idle", "cordoned", False
    in_pool = h.id in pool
    match s.policy:
        case "disaggregated":
            if in_pool:
                return "train", "train pool", False
            return ("rollout", "rollout host", False) if h.can_rollout else ("idle", "not in the train pool", False)
        case "colocated":
            if s.trainer.wants_hosts:
                return ("train", "train phase", True) if in_pool else ("idle", "train phase", True)
            if h.can_rollout:
                return "rollout", "rollout phase", False
            return ("train", "train pool (no rollout tag)", False) if in_pool else ("idle", "no role", False)
        case "seamless":
            if not in_pool:
                return ("rollout", "rollout host", False) if h.can_rollout else ("idle", "not in the train pool", False)
            if not h.can_rollout:
                return "train", "train pool (no rollout tag)", False
            if s.trainer.wants_hosts:
                if draining(s, h):
                    return "rollout", f"drain: trainer {s.trainer.state}, {h.running} running", False
                return "train", f"reclaim: trainer {s.trainer.state}", False
            ok, why = lend
            if h.mode == "rollout" and h.target == "rollout":
                return "rollout", "lent until the batch is ready", False  # never reclaim early
            return ("rollout", f"lend: {why}", False) if ok else ("train", f"keep: {why}", False)
    raise ValueError(f"unknown policy {s.policy!r}")


def decide(s: Snapshot) -> list[Decision]:
    """The assignments to issue now: one per settled, healthy host whose target must change."""
    pool = train_pool(s)
    others_roll_out = s.policy != "seamless" or _can_roll_out_outside(s, pool)
    lend = lend_verdict(s, others_roll_out) if s.policy == "seamless" else (False, "")
    wait = predicted_wait(s.trainer, s.completion_rate)
    reclaim_at = s.now + max(0.0, wait - s.costs.reclaim_s - s.drain_margin_s)
    if not others_roll_out or s.trainer.state in ("absent", "stopped"):
        # the pool is the only rollout there is, or no trainer will reclaim it: a lent host takes every turn
        reclaim_at = math.inf
    out: list[Decision] = []
    # _wanted reads a host only through this key, so hosts that share it share the answer
    # (the simulator decides for thousands of hosts; this keeps it to a few distinct calls)
    wanted: dict[tuple, tuple[HostMode, str, bool]] = {}
    seamless, wants = s.policy == "seamless", s.trainer.wants_hosts
    grace = _grace_lasts(s)  # draining(s, h), its snapshot part asked once
    for h in sorted(s.hosts, key=_BY_ID):
        if not h.healthy or h.mode != h.target:  # h.switching, inlined
            continue
        in_pool = h.id in pool
        key = (h.cordoned, in_pool, "train" in h.tags, "rollout" in h.tags, h.mode,
               _drains(grace, h))
        got = wanted.get(key)
        if got is None:
            got = wanted[key] = _wanted(s, h, pool, lend)
        mode, reason, hold = got
        lent = mode == "rollout" and seamless and in_pool
        drain = lent and wants
        if mode == h.target:
            # unchanged, but for a lent host's lent_until: a drain closes it to new turns (once);
            # with a drain margin, a reclaim predicted earlier than its lent_until moves it earlier
            if drain and not _closed(h, s.now):
                reason = f"drain: trainer {s.trainer.state}, {h.running} running"
            elif lent and not drain and _earlier(s, h, reclaim_at):
                reason = f"drain margin {s.drain_margin_s:g}s: reclaim now predicted at {reclaim_at:.1f}"
            elif lent and not drain and math.isfinite(reclaim_at) and _renew(s, h):
                reason = f"renew: the trainer still waits, lent until {max(reclaim_at, s.now + s.renew_s):.1f}"
            else:
                continue
        lent_until = 0.0
        if drain:
            lent_until = max(s.now, 1e-9)  # > 0: a lent_until of 0 means "not lent", open to every turn
        elif mode == "rollout" and in_pool:
            lent_until = reclaim_at if math.isfinite(reclaim_at) else 0.0
            if lent_until and s.renew_s > 0:
                lent_until = max(lent_until, s.now + s.renew_s)  # kept open at least renew_s (_renew)
        out.append(Decision(h.id, mode, h.epoch + 1, reason, hold, lent_until))
    return out


def gate_open(s: Snapshot) -> bool:
    """May the trainer compute? Every healthy train-pool host has applied train mode."""
    pool = train_pool(s)
    return all(h.mode == "train" and h.target == "train" for h in s.hosts if h.id in pool and h.healthy)


def apply(s: Snapshot, decisions: list[Decision]) -> Snapshot:
    """The snapshot after `decisions` are issued (targets and epochs move; modes do not)."""
    by_host = {d.host: d for d in decisions}
    hosts = tuple(_retarget(h, by_host[h.id]) if h.id in by_host else h for h in s.hosts)
    return replace(s, hosts=hosts)


_BY_ID = attrgetter("id")
_HOST_FIELDS = tuple(f.name for f in fields(Host))


def _retarget(h: Host, d: Decision) -> Host:
    """replace(h, target=d.mode, epoch=d.epoch, lent_until=...), several times faster (no field
    introspection)."""
    lent_until = d.lent_until if d.mode == "rollout" else 0.0
    if _HOST_FIELDS != ("id", "tags", "capacity", "mode", "target", "epoch", "healthy", "cordoned", "running",
                        "lent_until"):
        return replace(h, target=d.mode, epoch=d.epoch, lent_until=lent_until)  # Host grew a field: stay correct
    return Host(h.id, h.tags, h.capacity, h.mode, d.mode, d.epoch, h.healthy, h.cordoned, h.running, lent_until)


def activity(mode: HostMode, target: HostMode, trainer_state: str, running: int) -> Activity:
    """What a host's time is spent on right now, for its timeline."""
    if mode != target:
        return "switch"
    if mode == "train" and trainer_state in ("computing", "publishing"):
        return "train"
    if mode == "rollout" and running > 0:
        return "rollout"
    return "idle"


# -- what a host agent does to apply an assignment ---------------------------------------------

Step = Literal[
    "offload_trainer",  # free the trainer rank's device memory (GPU: DeepSpeed offload_states)
    "wake",  # wake the rollout engine (GPU: vLLM wake_up)
    "load",  # load the assignment's weight version if the worker serves an older one
    "resume",  # take requests again
    "vacate",  # abort in-flight requests; they come back "preempted" and migrate
    "hold",  # pause in keep mode: in-flight requests freeze in place until a resume
    "sleep",  # put the rollout engine to sleep (GPU: vLLM sleep level 1)
    "reload_trainer",  # restore the trainer rank's device memory
]


def transition_steps(mode: HostMode, hold: bool, has_worker: bool, has_trainer: bool,
                     current: HostMode | None = None) -> list[Step]:
    """The ordered steps that bring a host from `current` (None: unknown) into `mode`.

    A lent host never serves an old version: `load` comes before `resume`. A reclaimed host
    never trains beside a serving worker: `vacate` (or `hold`) and `sleep` come before
    `reload_trainer`. Rollout to rollout (a drain: only `lent_until` changes) leaves the
    trainer rank alone; wake and load are no-ops on a serving worker."""
    steps: list[Step] = []
    if mode == "rollout":
        if has_trainer and current != "rollout":
            steps.append("offload_trainer")
        if has_worker:
            steps += ["wake", "load", "resume"]
        return steps
    if has_worker:
        steps += ["hold"] if hold else ["vacate", "sleep"]
    if mode == "train" and has_trainer:
        steps.append("reload_trainer")
    return steps
