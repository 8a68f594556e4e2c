"""Scheduler transport: the only scheduler module that touches NATS.

    sf.sched.host          HostHeartbeat in (host agents register and stay alive)
    sf.sched.changed       HostModeChanged in (an assignment applied, or failed)
    sf.rollout.status      WorkerStatus in (a serving host's worker must stay alive; its load)
    sf.trainer.status      TrainerStatus in (waiting for data, ready, computing, publishing)
    sf.traj.completed      counted as they pass, with their group (the completion rates that predict the wait)
    sf.weights.published   the version a lent host must load before it serves
    sf.sched.gate          TrainGate in, TrainGateReply out once the train pool is reclaimed
    sf.sched.ctl           SchedulerControl in (status, set_policy, cordon, uncordon, timeline)
    sf.sched.assign.<host> HostAssignment out, on the HOSTS stream (last value per host)

A message it cannot read is counted (sf_bus_malformed_total), logged once and, when a stream stored it,
dead-lettered (shared/deadletter.py); a control request gets a SchedulerReply error, a gate a refusal.

The loop, every `tick` seconds, and at once when the trainer's state changes, a gate arrives or a
host reports a switch (a tick of 0.2 s otherwise left each lend, reclaim and gate answer waiting
0.1 s on average: ~8% of a train host's time at 3-4 s cycles):
1. mark dead hosts (heartbeat age) and failed switches (switch timeout);
2. build a policy.Snapshot from the registry and ask policy.decide();
3. publish each decision as a HostAssignment with the host's next epoch;
4. answer trainer gates whose train pool has applied train mode, or whose wait ran out;
5. close timeline intervals whose activity changed, and persist the registry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import replace
from contextlib import AsyncExitStack
from typing import get_args

import msgspec
from nats.aio.msg import Msg

from services.scheduler import leader, policy
from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.registry import Registry
from services.scheduler.store import Store
from shared import bus, subjects, weightstore
from shared.codec import decode, encode
from shared.config import Connections
from shared.deadletter import Malformed
from shared.messages.rollout import WorkerStatus
from shared.messages.scheduler import (
    HostAssignment,
    HostHeartbeat,
    HostModeChanged,
    PolicyName,
    SchedulerControl,
    SchedulerLeader,
    SchedulerReply,
    TrainerStatus,
    TrainGate,
    TrainGateReply,
)
from shared.messages.weights import WeightsPublished

log = logging.getLogger("sf.scheduler")

PERSIST_EVERY = 1.0  # seconds between registry writes to Redis
ASSIGN_RETRIES = 3  # publishes of one assignment before the host is marked unhealthy


class Finished(msgspec.Struct, tag="TrajectoryCompleted"):
    """What the scheduler reads of a TrajectoryCompleted (shared/messages/trajectory.py): its group,
    for the group completion rate. The samples are skipped, not decoded."""

    group_id: str = ""


class LeadershipLost(RuntimeError):
    """Another instance holds the lease: this one must not decide again (it exits; a restart is a standby)."""


class _Gate:
    def __init__(self, msg: Msg, req: TrainGate, now: float):
        self.msg, self.req, self.t0 = msg, req, now
        self.deadline = now + req.timeout


class SchedulerService:
    def __init__(self, cfg: SchedulerConfig, conn: Connections):
        self.cfg, self.conn = cfg, conn
        self.policy: PolicyName = cfg.policy
        self.reg = Registry(stale_after=cfg.host_stale_after, switch_timeout=cfg.switch_timeout,
                            costs=policy.Costs(cfg.lend_s, cfg.reclaim_s, measured=False))
        self.gates: list[_Gate] = []
        self.weights: WeightsPublished | None = None
        self.malformed = Malformed("scheduler")
        self.epoch_floor = 0  # leader.first_epoch(term) once leading
        self.wake = asyncio.Event()  # set by what calls for a decision before the next tick
        self.metrics = SchedulerMetrics(self.malformed.registry)

    async def run(self, quit: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        async with AsyncExitStack() as stack:
            # 1. connect, declare streams, rebuild the registry from Redis
            self.nc = await bus.connect(self.conn, name="sf-scheduler")
            stack.push_async_callback(bus.wait_closed, self.nc)
            self.js = self.nc.jetstream()
            streams = subjects.STREAMS
            await bus.ensure_streams(self.js, streams)
            metrics = self.malformed.enter(stack, self.nc, streams, self.cfg.metrics_port, self.cfg.metrics_host)
            self.store = Store.connect(self.conn.redis_url, tls=self.conn.redis_tls)
            stack.push_async_callback(self.store.close)
            # one leader among the instances (leader.py): a standby waits here, then rebuilds as a restart does
            self.lease = leader.Lease(self.store.r, self.cfg.instance or f"{socket.gethostname()}-{os.getpid()}",
                                      self.cfg.lease_s)
            if not await self._lead(quit):
                return
            stack.push_async_callback(self._step_down)
            await self._restore()
            self._fence()
            try:
                self.weights = await weightstore.current(self.js)
            except Exception as e:
                log.warning("could not read the current weight version: %s", e)

            # 2. listen
            subs = [
                (subjects.SCHED_HOST, self._on_heartbeat), (subjects.SCHED_CHANGED, self._on_changed),
                (subjects.ROLLOUT_STATUS, self._on_worker), (subjects.TRAINER_STATUS, self._on_trainer),
                (subjects.TRAJ_COMPLETED, self._on_finished), (subjects.WEIGHTS_PUBLISHED, self._on_weights),
                (subjects.SCHED_GATE, self._on_gate), (subjects.SCHED_CTL, self._on_control),
            ]
            for subject, cb in subs:
                await self.nc.subscribe(subject, cb=cb)
            await self.nc.flush(timeout=5)  # "ready" means the server has the subscriptions
            log.info("scheduler ready: policy %s, %d host(s) known (%s%s)", self.policy, len(self.reg.hosts),
                     self.conn.redacted(), f", metrics port {metrics.port}" if metrics.port else "")
            if ready:
                ready.set()

            # 3. decide every tick, while leading
            await self._decide_loop(quit)
            for g in self.gates:  # do not leave the trainer waiting on a scheduler that left
                await self._answer(g, False, "scheduler stopping", time.time())

    async def _decide_loop(self, quit: asyncio.Event) -> None:
        last_persist = last_announce = 0.0
        while not quit.is_set():
            now = time.time()
            try:
                if await self._still_leading():
                    if now - last_announce >= 1.0:
                        await self._announce(now)
                        last_announce = now
                    await self._tick(now)
                    if now - last_persist >= PERSIST_EVERY:
                        for rec in self.reg.hosts.values():
                            await self.store.save_host(rec)
                        last_persist = now
            except LeadershipLost:
                raise
            except Exception:  # Redis or NATS hiccup: the next tick tries again
                log.exception("scheduler tick failed")
            await self._sleep(quit, self.cfg.tick)

    async def _sleep(self, quit: asyncio.Event, seconds: float) -> None:
        """Until the next tick, `quit`, or an event that calls for a decision now (`self.wake`)."""
        waits = [asyncio.ensure_future(quit.wait()), asyncio.ensure_future(self.wake.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self.wake.clear()

    async def _lead(self, quit: asyncio.Event) -> bool:
        """Wait until this instance holds the lease (True), or is told to stop (False)."""
        waited = False
        while not quit.is_set():
            try:
                if await self.lease.try_acquire():
                    log.info("leading as %s, term %d%s", self.lease.instance, self.lease.term,
                             " (took over)" if waited else "")
                    return True
            except Exception as e:  # Redis away: a standby keeps trying
                log.warning("leader lease: %s", e)
            if not waited:
                log.info("standby: %s leads; taking over when its lease runs out", await self._holder())
                waited = True
            try:
                await asyncio.wait_for(quit.wait(), leader.POLL_S)
            except TimeoutError:
                pass
        return False

    async def _holder(self) -> str:
        try:
            return await self.lease.holder() or "nobody"
        except Exception:
            return "an unknown instance"

    def _fence(self) -> None:
        """This term's epochs start above every earlier term's (leader.first_epoch)."""
        base = leader.first_epoch(self.lease.term)
        for rec in self.reg.hosts.values():
            rec.epoch = max(rec.epoch, base)
        self.epoch_floor = base

    async def _still_leading(self) -> bool:
        """Renew when due. Stops deciding once the lease ran out by our clock; quits once another leads."""
        if self.lease.due():
            try:
                if not await self.lease.renew():
                    raise LeadershipLost(f"another scheduler leads now ({await self._holder()}); this one stops")
            except LeadershipLost:
                raise
            except Exception as e:
                log.warning("renewing the leader lease: %s", e)
        return self.lease.leading

    async def _announce(self, now: float) -> None:
        await self.nc.publish(subjects.SCHED_LEADER, encode(SchedulerLeader(self.lease.term, self.lease.instance, now)))

    async def _step_down(self) -> None:
        try:
            await self.lease.release()  # a standby leads at its next try, not after the lease runs out
        except Exception as e:
            log.warning("releasing the leader lease: %s", e)

    async def _restore(self) -> None:
        saved = await self.store.policy()
        if saved in get_args(PolicyName):
            self.policy = saved  # type: ignore[assignment]
        now = time.time()
        for rec in await self.store.load_hosts():
            rec.last_seen = now  # give every host a heartbeat period to show it is alive
            rec.activity_since = now
            self.reg.hosts[rec.host] = rec

    # -- the loop ----------------------------------------------------------------------------------

    async def _tick(self, now: float) -> None:
        # 1. health
        for note in self.reg.check_health(now):
            log.warning("%s", note)
        # 2. decide
        self.reg.gate_pending = bool(self.gates)
        snap = self._snapshot(now)
        decisions = policy.decide(snap)
        # 3. assign
        for d in decisions:
            await self._assign(d, now)
        # 4. gates
        if self.gates:
            snap = self._snapshot(now)
            is_open = policy.gate_open(snap)
            for g in list(self.gates):
                if is_open:
                    await self._answer(g, True, "train pool reclaimed", now)
                elif now >= g.deadline:
                    self.reg.counts["gates_timed_out"] += 1
                    await self._answer(g, False, f"train pool not reclaimed within {g.req.timeout:.0f}s", now)
        # 5. timelines and gauges
        closed = self.reg.record_activity(now)
        await self.store.append_intervals(closed)
        self.metrics.update(self.reg.rates(now), self.reg.counts, {h: r.activity for h, r in self.reg.hosts.items()})

    def _snapshot(self, now: float) -> policy.Snapshot:
        c = self.cfg
        snap = self.reg.snapshot(self.policy, now, c.lend_margin, c.train_hosts, c.drain_margin_s, c.reclaim_grace_s,
                                 c.lend_settle_s)
        return replace(snap, renew_s=c.renew_s, offer=snap.offer if c.live_offer else None)

    async def _assign(self, d: policy.Decision, now: float) -> None:
        w = self.weights
        msg = HostAssignment(d.host, d.mode, d.epoch, d.reason, w.version if w else -1, w.path if w else "",
                             d.hold, now, d.lent_until)
        # recorded before publishing: a fast host answers HostModeChanged before the publish's ack
        # arrives, and a report for an epoch not yet recorded would be dropped as an old one
        self.reg.issued(d.host, d.mode, d.epoch, now, d.lent_until)
        for attempt in range(1, ASSIGN_RETRIES + 1):
            try:
                await bus.publish_durable(self.js, subjects.sched_assign(d.host), msg, f"assign-{d.host}-{d.epoch}")
                break
            except Exception as e:
                log.warning("publishing %s's assignment (attempt %d): %s", d.host, attempt, e)
                await asyncio.sleep(0.2 * attempt)
        else:
            self.reg.hosts[d.host].healthy = False
            log.error("host %s: assignment %d could not be published; marked unhealthy", d.host, d.epoch)
            return
        log.info("assign %s -> %s (epoch %d%s): %s", d.host, d.mode, d.epoch, ", hold" if d.hold else "", d.reason)

    async def _answer(self, g: _Gate, granted: bool, reason: str, now: float) -> None:
        self.gates.remove(g)
        if granted:
            self.reg.counts["gates_granted"] += 1
            self.reg.granted(g.req.step)
        reply = TrainGateReply(granted, now - g.t0, reason)
        log.info("gate for step %d: %s after %.2fs (%s)", g.req.step, "granted" if granted else "refused",
                 now - g.t0, reason)
        try:
            await g.msg.respond(encode(reply))
        except Exception as e:
            log.warning("answering the trainer's gate: %s", e)

    # -- what arrives ------------------------------------------------------------------------------

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = self.malformed.decode(msg, HostHeartbeat, subjects.SCHED_HOST)
        if hb is not None:
            for note in self.reg.on_heartbeat(hb, time.time()):
                log.info("%s", note)
            rec = self.reg.hosts.get(hb.host)
            if rec is not None and rec.epoch < self.epoch_floor:  # a host new to this term: its epochs too
                rec.epoch = self.epoch_floor

    async def _on_changed(self, msg: Msg) -> None:
        ev = self.malformed.decode(msg, HostModeChanged, subjects.SCHED_CHANGED)
        if ev is not None and (note := self.reg.on_changed(ev, time.time())):
            (log.info if ev.ok else log.warning)("%s", note)
            self.wake.set()  # a gate may open, a lent host may take turns

    async def _on_worker(self, msg: Msg) -> None:
        st = self.malformed.decode(msg, WorkerStatus, subjects.ROLLOUT_STATUS)
        if st is not None:
            self.reg.on_worker(st.worker_id, st.running, time.time(), st.generated_tokens, st.capacity,
                               st.state == "serving", st.lent_until)

    async def _on_trainer(self, msg: Msg) -> None:
        st = self.malformed.decode(msg, TrainerStatus, subjects.TRAINER_STATUS)
        if st is not None and self.reg.on_trainer(st, time.time()):
            self.wake.set()

    async def _on_finished(self, msg: Msg) -> None:
        # counted, and its group read: the trainer reads the rest (and dead-letters what it cannot read)
        try:
            group = decode(msg.data, Finished).group_id
        except msgspec.DecodeError:
            group = ""
        self.reg.on_finished(time.time(), group)

    async def _on_weights(self, msg: Msg) -> None:
        ev = self.malformed.decode(msg, WeightsPublished, subjects.WEIGHTS_PUBLISHED)
        if ev is not None and (self.weights is None or ev.version > self.weights.version):
            self.weights = ev

    async def _on_gate(self, msg: Msg) -> None:
        # one it cannot read is refused at once: the trainer would otherwise wait out its gate timeout
        req = self.malformed.decode(msg, TrainGate, subjects.SCHED_GATE, refuse=lambda _: TrainGateReply(
            False, 0.0, "bad TrainGate: the scheduler cannot read it"))
        if req is not None and msg.reply:
            self.gates.append(_Gate(msg, req, time.time()))
            self.wake.set()

    async def _on_control(self, msg: Msg) -> None:
        ctl = self.malformed.decode(msg, SchedulerControl, subjects.SCHED_CTL,
                                    refuse=lambda why: SchedulerReply(False, error=f"bad SchedulerControl: {why}"))
        if ctl is None:
            return
        try:
            reply = await self._control(ctl)
        except Exception as e:
            log.exception("control failed")
            reply = SchedulerReply(False, error=f"{type(e).__name__}: {e}")
        if msg.reply:
            try:
                await msg.respond(encode(reply))
            except Exception as e:  # the connection is closing: the operator's request times out
                log.warning("answering a control request: %s", e)

    async def _control(self, ctl: SchedulerControl) -> SchedulerReply:
        now = time.time()
        match ctl.op:
            case "set_policy":
                if ctl.policy not in get_args(PolicyName):
                    return SchedulerReply(False, self.policy, error=f"unknown policy {ctl.policy!r}; choose one of "
                                                                    f"{', '.join(get_args(PolicyName))}")
                self.policy = ctl.policy  # type: ignore[assignment]
                await self.store.set_policy(ctl.policy)
                log.info("policy set to %s", ctl.policy)
            case "cordon" | "uncordon":
                rec = self.reg.hosts.get(ctl.host)
                if rec is None:
                    return SchedulerReply(False, self.policy, error=f"unknown host {ctl.host!r}")
                rec.cordoned = ctl.op == "cordon"
                await self.store.save_host(rec)
                log.info("host %s %sed", ctl.host, ctl.op)
            case "timeline":
                infos = []
                for rec in self.reg.hosts.values():
                    info = rec.info()
                    info.timeline = self.reg.timeline(rec.host, now)
                    infos.append(info)
                return SchedulerReply(True, self.policy, infos, counts=dict(self.reg.counts),
                                      rates=self.reg.rates(now))
        return SchedulerReply(True, self.policy, [r.info() for r in self.reg.hosts.values()],
                              counts=dict(self.reg.counts), rates=self.reg.rates(now))
