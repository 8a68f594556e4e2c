"""The scheduler's view of the cluster (pure): hosts, health, switches, timelines, backlog.

The service feeds it what arrives (host heartbeats, worker heartbeats, HostModeChanged,
trainer heartbeats, finished trajectories) with the time passed in, asks it for a
`policy.Snapshot`, and records the assignments it issues.

Predicted wait. The trainer takes whole groups, so what it still needs is counted in whole
groups (`groups_per_step - ready_groups`, times the group size): members of groups still
open do not shorten the wait. The rate they come at is that of whole groups (groups
completed per second, from the finished trajectories' group ids, times the group size);
the session rate is measured too, and stands in until groups complete.

Activity. A host in rollout mode serves while its worker runs a request at a heartbeat or
generated tokens since the previous one (short turns start and end between two beats); a
lent host that does neither is idle, and `lent_idle` names it. It knows nothing about NATS
or Redis: `store.py` persists `HostRecord`s and timelines, `service.py` does the I/O.

Health. A host is healthy while its agent's heartbeat is younger than `stale_after`
seconds and, when it is in rollout mode, its worker's heartbeat is too. A host that
fails to apply an assignment, or does not report within `switch_timeout`, is marked
unhealthy; its role is re-placed by the next decision. A host that comes back (fresh
heartbeats again, or its agent restarted its worker) is adopted in the mode its agent
reports, normally idle (a restarted worker starts vacated), and is assigned afresh.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace

from services.scheduler import policy
from shared import lending
from shared.heartbeats import Heartbeats
from shared.timeouts import HEARTBEAT_STALE_AFTER
from shared.messages.scheduler import (
    Activity,
    HostHeartbeat,
    HostInfo,
    HostMode,
    HostModeChanged,
    Interval,
    PolicyName,
    TrainerStatus,
)

log = logging.getLogger("sf.scheduler")

EWMA = 0.3  # weight of the newest switch duration in the running mean
RATE_WINDOW = 30.0  # seconds of finished trajectories (and groups) the completion rates look at
TIMELINE_KEEP = 10_000  # intervals kept in memory per host
OPEN_GROUPS_KEEP = 4096  # groups counted towards completion at most (the oldest is forgotten)


@dataclass
class HostRecord:
    host: str
    tags: list[str]
    capacity: float = 1.0
    mode: HostMode = "idle"
    target: HostMode = "idle"
    epoch: int = 0
    healthy: bool = True
    cordoned: bool = False
    last_seen: float = 0.0
    worker_id: str = ""
    restarts: int = 0
    issued_at: float = 0.0  # when the current target was assigned
    ready: bool = True  # its worker is up; a host that is not ready is not placed (nor dead)
    since: float = 0.0  # when it entered its current mode
    activity: Activity = "idle"
    activity_since: float = 0.0
    lent_until: float = 0.0  # of its last rollout assignment (not persisted: a restart re-issues)

    def view(self, running: int = 0) -> policy.Host:
        return policy.Host(self.host, frozenset(self.tags), self.capacity, self.mode, self.target, self.epoch,
                           self.healthy and self.ready, self.cordoned, running, self.lent_until)

    def info(self) -> HostInfo:
        return HostInfo(self.host, list(self.tags), self.capacity, self.mode, self.target, self.epoch, self.healthy,
                        self.cordoned, self.last_seen, self.worker_id, self.activity)


@dataclass
class Registry:
    stale_after: float = HEARTBEAT_STALE_AFTER
    switch_timeout: float = 60.0
    hosts: dict[str, HostRecord] = field(default_factory=dict)
    timelines: dict[str, deque[Interval]] = field(default_factory=dict)
    # worker id -> requests running, aged by receive time (the scheduler applies its own staleness)
    workers: Heartbeats[int] = field(default_factory=Heartbeats)
    trainer: TrainerStatus | None = None
    trainer_seen: float = 0.0
    gate_pending: bool = False
    granted_step: int = 0  # the newest step whose gate was granted: the trainer computes until it reports it
    wants_since: float = 0.0  # when the trainer began to want its hosts (0 = it does not): the reclaim grace
    waiting_since: float = 0.0  # when the trainer began to wait for data (0 = it does not): the lend settle
    finished: deque[float] = field(default_factory=deque)  # arrival times of finished trajectories
    groups_done: deque[float] = field(default_factory=deque)  # times groups completed (their last member)
    open_groups: dict[str, int] = field(default_factory=dict)  # group id -> members finished, while incomplete
    # worker id -> did it generate since its previous heartbeat (or run a request at it)? A turn of a
    # fraction of a second starts and ends between two beats: `running` alone would never see it
    served: dict[str, bool] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # worker id -> generated_tokens at its last beat
    # what the routers see of each worker (the live offer, `offer`): its slots, whether it serves, its
    # lent_until, its decode rate over intervals where it generated (shared/lending.busy_rate, as the router)
    capacity: dict[str, int] = field(default_factory=dict)
    serving_workers: dict[str, bool] = field(default_factory=dict)
    worker_lent_until: dict[str, float] = field(default_factory=dict)
    worker_rates: dict[str, float] = field(default_factory=dict)
    beat_at: dict[str, float] = field(default_factory=dict)
    generated: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) generated, RATE_WINDOW
    costs: policy.Costs = policy.Costs()
    lent_idle_s: float = 0.0  # host-seconds train hosts spent lent to rollout and idle (record_activity)
    activity_at: float = 0.0  # when record_activity last ran
    reclaims_measured: int = 0  # switches into train measured (reclaims, and idle -> train)
    counts: dict[str, int] = field(default_factory=lambda: {"lends": 0, "reclaims": 0, "failed_switches": 0,
                                                            "gates_granted": 0, "gates_timed_out": 0})

    # -- what arrives ----------------------------------------------------------------------------

    def on_heartbeat(self, hb: HostHeartbeat, now: float) -> list[str]:
        """Record a host agent's heartbeat; returns log lines for what changed."""
        notes: list[str] = []
        rec = self.hosts.get(hb.host)
        if rec is None:
            rec = self.hosts[hb.host] = HostRecord(hb.host, list(hb.tags), hb.capacity, hb.mode, hb.mode,
                                                   hb.epoch, True, False, now, hb.worker_id, hb.restarts,
                                                   activity_since=now)
            notes.append(f"host {hb.host} registered: tags {','.join(hb.tags)}, mode {hb.mode}, epoch {hb.epoch}")
        rec.tags, rec.capacity, rec.worker_id, rec.last_seen = list(hb.tags), hb.capacity, hb.worker_id, now
        if hb.ready != rec.ready:
            rec.ready = hb.ready
            notes.append(f"host {hb.host}: worker {'up' if hb.ready else 'starting'}")
        if hb.restarts > rec.restarts:  # its worker exited: dead until the restarted one is up
            rec.restarts = hb.restarts
            if rec.healthy:
                rec.healthy = False
                notes.append(f"host {hb.host} dead: its worker exited (restart {hb.restarts}); it rejoins once the "
                             f"worker is up again")
            rec.mode = rec.target = hb.mode
        elif not rec.healthy and hb.ready and self._fresh(rec, now):
            notes.append(f"host {hb.host} is back; rejoins {hb.mode} at epoch {hb.epoch}")
            self._adopt(rec, hb)
        return notes

    def _adopt(self, rec: HostRecord, hb: HostHeartbeat) -> None:
        rec.mode = rec.target = hb.mode
        rec.since = hb.ts
        rec.epoch = max(rec.epoch, hb.epoch)
        rec.healthy = True

    def on_worker(self, worker_id: str, running: int, now: float, generated_tokens: int = 0, capacity: int = 0,
                  serving: bool = True, lent_until: float = 0.0) -> None:
        prev = self.tokens.get(worker_id)
        self.tokens[worker_id] = generated_tokens
        if capacity > 0:
            self.capacity[worker_id] = capacity
        self.serving_workers[worker_id], self.worker_lent_until[worker_id] = serving, lent_until
        if prev is not None:
            rate = lending.busy_rate(self.worker_rates.get(worker_id), self.beat_at.get(worker_id, now), prev, now,
                                     generated_tokens, EWMA)
            if rate is not None:
                self.worker_rates[worker_id] = rate
            if generated_tokens > prev:
                self.generated.append((now, generated_tokens - prev))
        self.beat_at[worker_id] = now
        # a restarted worker counts from 0 again: fewer tokens than before is not generation
        self.served[worker_id] = running > 0 or (prev is not None and generated_tokens > prev)
        self.workers.beat(worker_id, running, now)

    def on_changed(self, ev: HostModeChanged, now: float) -> str | None:
        rec = self.hosts.get(ev.host)
        if rec is None or ev.epoch != rec.epoch:
            return None  # an old assignment's report, or an unknown host: the newest epoch decides
        took = max(0.0, ev.t_end - ev.t_start)
        if not ev.ok:
            rec.healthy = False
            self.counts["failed_switches"] += 1
            return f"host {ev.host} failed to switch to {ev.mode} (epoch {ev.epoch}): {ev.error}; marked unhealthy"
        was = rec.mode
        rec.mode, rec.since = ev.mode, now
        # the configured costs are a prior: the first measured switch replaces it, later ones blend in.
        # A lend is any switch of a train host into rollout, from train or from idle (the lend at
        # start-up, or after a worker restart): its agent runs the same steps (offload, wake, load, resume)
        if ev.mode == "rollout" and was != "rollout" and "train" in rec.tags:
            lend = _ewma(self.costs.lend_s, took) if self.counts["lends"] else took
            self.costs = policy.Costs(lend, self.costs.reclaim_s, measured=True)
            self.counts["lends"] += 1
        elif ev.mode == "train" and was in ("rollout", "idle"):
            # idle -> train runs a reclaim's steps (vacate, sleep, reload the trainer rank; nothing to migrate):
            # a measure of it too. Without it a host that trained from the start (the policy was disaggregated,
            # then seamless) kept the 1 s priors, and a 2 s predicted wait never beat 1.5 x 2 s: no lend, ever
            reclaim = _ewma(self.costs.reclaim_s, took) if self.reclaims_measured else took
            self.costs = policy.Costs(self.costs.lend_s, reclaim, self.costs.measured)
            self.reclaims_measured += 1
            self.counts["reclaims"] += was == "rollout"  # a reclaim proper: the end of a lend/reclaim cycle
        return (f"host {ev.host}: {was} -> {ev.mode} (epoch {ev.epoch}) in {took * 1000:.0f} ms"
                + (f", {ev.migrated} request(s) migrated" if ev.migrated else ""))

    def on_trainer(self, st: TrainerStatus, now: float) -> bool:
        """Record the trainer's status; True when its state changed (a decision is due now, not at the
        next tick: the trainer began to wait, or has a batch and wants its hosts)."""
        changed = self.trainer is None or self.trainer.state != st.state
        self.trainer, self.trainer_seen = st, now
        return changed

    def on_finished(self, now: float, group_id: str = "") -> None:
        """A trajectory finished; its group completes with its trainer-reported `group_size`-th member."""
        self.finished.append(now)
        if not group_id:
            return
        members = self.open_groups.pop(group_id, 0) + 1
        size = self.trainer.group_size if self.trainer else 0
        if size and members >= size:
            self.groups_done.append(now)
            return
        self.open_groups[group_id] = members  # re-inserted last: the oldest open group is forgotten first
        if len(self.open_groups) > OPEN_GROUPS_KEEP:
            self.open_groups.pop(next(iter(self.open_groups)))

    # -- what the service does -------------------------------------------------------------------

    def issued(self, host: str, mode: HostMode, epoch: int, now: float, lent_until: float = 0.0) -> None:
        rec = self.hosts[host]
        rec.target, rec.epoch, rec.issued_at = mode, epoch, now
        rec.lent_until = lent_until if mode == "rollout" else 0.0

    def granted(self, step: int) -> None:
        self.granted_step = max(self.granted_step, step)

    def check_health(self, now: float) -> list[str]:
        notes = []
        for rec in self.hosts.values():
            if not rec.healthy:
                continue
            if not self._fresh(rec, now):
                rec.healthy = False
                age = max(now - rec.last_seen, self._serving_worker_age(rec, now))
                notes.append(f"host {rec.host} dead: no heartbeat from it or its worker for {age:.1f}s")
            elif rec.target != rec.mode and now - rec.issued_at > self.switch_timeout:
                rec.healthy = False
                self.counts["failed_switches"] += 1
                notes.append(f"host {rec.host} did not apply {rec.target} (epoch {rec.epoch}) within "
                             f"{self.switch_timeout:.0f}s; marked unhealthy")
        return notes

    def _fresh(self, rec: HostRecord, now: float) -> bool:
        return max(now - rec.last_seen, self._serving_worker_age(rec, now)) <= self.stale_after

    def _serving_worker_age(self, rec: HostRecord, now: float) -> float:
        """Seconds since a serving host's worker was heard (0 for a host that is not serving)."""
        if not (rec.mode == "rollout" and rec.target == "rollout" and rec.worker_id):
            return 0.0
        age = self.workers.age(rec.worker_id, now)
        return now - rec.since if age is None else age  # a worker not heard yet: counted from the switch

    def trainer_view(self, now: float) -> policy.Trainer:
        st = self.trainer
        if st is None or now - self.trainer_seen > self.stale_after or st.state == "stopped":
            return policy.Trainer("ready" if self.gate_pending else "absent")
        # whole groups only: members of groups still open do not shorten the wait, since the trainer
        # takes complete groups (with several groups filling at once, most buffered samples are such members)
        needed = max(0, st.groups_per_step - st.ready_groups) * st.group_size
        state = st.state
        if st.state in ("waiting", "ready") and st.step < self.granted_step:
            state = "computing"  # a heartbeat from before the grant: the step it was granted is running
        elif self.gate_pending and st.state == "waiting":
            state = "ready"
        return policy.Trainer(state, 0 if state != "waiting" else needed)

    def completion_rate(self, now: float) -> float:
        """Finished trajectories (sessions) per second, over the last RATE_WINDOW seconds."""
        return _rate(self.finished, now)

    def group_rate(self, now: float) -> float:
        """Completed groups per second, over the last RATE_WINDOW seconds."""
        return _rate(self.groups_done, now)

    def whole_group_rate(self, now: float) -> float:
        """Trajectories per second that arrive in whole groups (group rate x group size): the rate the
        trainer's samples_needed is consumed at. The session rate until groups complete (no trainer
        heard yet, or fewer than two groups completed in the window)."""
        size = self.trainer.group_size if self.trainer else 0
        groups = self.group_rate(now)
        return groups * size if groups > 0 and size else self.completion_rate(now)

    def rates(self, now: float) -> dict[str, float]:
        """What the operator sees (SchedulerReply.rates) and the metrics export."""
        trainer = self.trainer_view(now)
        rate = self.whole_group_rate(now)
        return {"sessions_per_s": self.completion_rate(now), "groups_per_s": self.group_rate(now),
                "samples_needed": float(trainer.samples_needed),
                "predicted_wait_s": policy.predicted_wait(trainer, rate), "lend_s": self.costs.lend_s,
                "reclaim_s": self.costs.reclaim_s, "lent_idle_hosts": float(len(self.lent_idle())),
                "lent_idle_host_s": self.lent_idle_s}

    def lent_idle(self) -> list[str]:
        """Train hosts lent to rollout whose worker generated nothing since its previous heartbeat: a
        lend that buys nothing (the router sent it no turn)."""
        return [r.host for r in self.hosts.values() if "train" in r.tags and r.mode == r.target == "rollout"
                and r.healthy and not self.served.get(r.worker_id)]

    def snapshot(self, policy_name: PolicyName, now: float, lend_margin: float, train_hosts: int,
                 drain_margin_s: float = 0.0, reclaim_grace_s: float = 0.0,
                 lend_settle_s: float = 30.0) -> policy.Snapshot:
        trainer = self.trainer_view(now)
        if not trainer.wants_hosts:
            self.wants_since = 0.0
        elif not self.wants_since:
            self.wants_since = now
        if trainer.state != "waiting":
            self.waiting_since = 0.0
        elif not self.waiting_since:
            self.waiting_since = now
        trainer = replace(trainer, wants_since=self.wants_since, waiting_since=self.waiting_since)
        hosts = tuple(r.view(self.workers.get(r.worker_id) or 0) for r in self.hosts.values())
        snap = policy.Snapshot(policy_name, now, hosts, trainer, self.whole_group_rate(now), self.costs, lend_margin,
                               train_hosts, drain_margin_s, reclaim_grace_s, lend_settle_s)
        return replace(snap, offer=self.offer(snap)) if policy_name == "seamless" else snap

    def offer(self, snap: policy.Snapshot) -> lending.Offer | None:
        """The work a lent pool host would be given now (policy.Snapshot.offer), as the simulator builds it
        (sim/simulator.py `_offer`) from what the routers see: the turns the serving workers hold beyond
        their slots (a router sends a turn to the least-loaded serving worker even when all are full, and it
        waits in that worker's queue: `running` counts it), less the free slots of serving workers that are
        not lent, shared by the pool hosts not rolling out yet, each with its worker's slots and measured
        speed (else the serving workers' mean), a turn predicted at the mean tokens a finished session
        generated over the last RATE_WINDOW seconds. None where nothing is measured yet (no serving worker's
        capacity or speed): the predicted wait alone decides, as before."""
        now = snap.now
        live = [w for w in self.serving_workers if self.serving_workers[w] and self.workers.get(w) is not None
                and (self.workers.age(w, now) or 0.0) <= self.stale_after and w in self.capacity]
        if not live:
            return None
        run = {w: self.workers.get(w) or 0 for w in live}
        waiting = sum(max(0, run[w] - self.capacity[w]) for w in live)
        free = sum(max(0, self.capacity[w] - run[w]) for w in live if self.worker_lent_until.get(w, 0.0) <= 0)
        pool = policy.train_pool(snap)
        by_id = {r.host: r for r in self.hosts.values()}
        lendable = [by_id[h.id] for h in snap.hosts if h.id in pool and h.can_rollout and h.healthy
                    and not h.cordoned and not (h.mode == h.target == "rollout")]
        rates = [self.worker_rates[w] for w in live if w in self.worker_rates]
        own = [self.worker_rates[r.worker_id] for r in lendable if r.worker_id in self.worker_rates]
        rate = (sum(own) / len(own)) if own else (sum(rates) / len(rates) if rates else 0.0)
        speed = lending.DecodeSpeed.measured(rate)
        if speed is None:
            return None
        caps = [self.capacity[r.worker_id] for r in lendable if r.worker_id in self.capacity]
        slots = round(sum(caps) / len(caps)) if caps else round(sum(self.capacity[w] for w in live) / len(live))
        while self.generated and now - self.generated[0][0] > RATE_WINDOW:
            self.generated.popleft()
        self.completion_rate(now)  # cuts `finished` to the window
        sessions = len(self.finished)
        expected = sum(t for _, t in self.generated) / sessions if sessions and self.generated else None
        ratio = lending.REPREFILL_RATIO if lending.DEFAULT_RULE == "migrate" else None
        return lending.Offer(max(0, waiting - free), len(lendable), expected, speed, slots, 0.0, ratio, refill=True)

    def record_activity(self, now: float) -> list[tuple[str, Interval]]:
        """Close the interval of every host whose activity changed; returns the closed ones. Adds the time
        since the previous call to `lent_idle_s` for each train host that was lent and idle."""
        closed = []
        trainer_state = self.trainer_view(now).state
        since, self.activity_at = self.activity_at, now
        for rec in self.hosts.values():
            if since and rec.activity == "idle" and rec.healthy and "train" in rec.tags and \
                    rec.mode == rec.target == "rollout":
                self.lent_idle_s += max(0.0, now - since)
            running = self.workers.get(rec.worker_id) or 0
            if self.served.get(rec.worker_id) and rec.mode == rec.target == "rollout":
                running = max(running, 1)  # it generated since its previous heartbeat: it serves
            act = policy.activity(rec.mode, rec.target, trainer_state, running)
            if not rec.healthy:
                act = "idle"
            if act != rec.activity:
                iv = Interval(rec.activity, rec.activity_since, now)
                self.timelines.setdefault(rec.host, deque(maxlen=TIMELINE_KEEP)).append(iv)
                closed.append((rec.host, iv))
                rec.activity, rec.activity_since = act, now
        return closed

    def timeline(self, host: str, now: float) -> list[Interval]:
        rec = self.hosts[host]
        return [*self.timelines.get(host, ()), Interval(rec.activity, rec.activity_since, now)]


def _rate(times: deque[float], now: float) -> float:
    """Events per second in `times` (arrival times, oldest first), over the last RATE_WINDOW seconds;
    drops the older ones. 0 with fewer than two."""
    while times and now - times[0] > RATE_WINDOW:
        times.popleft()
    if len(times) < 2:
        return 0.0
    return len(times) / max(now - times[0], 1.0)


def _ewma(old: float, new: float) -> float:
    return (1 - EWMA) * old + EWMA * new
