"""The trainer's NATS wiring, on rank 0: the only trainer module that touches NATS.

    sf.traj.completed     durable pull consumer `cfg.durable` ("trainer"), explicit ack: TrajectoryCompleted in
    sf.weights.published  WeightsPublished out (via shared.weightstore.announce), after each `publish_every` steps:
                          a store path (weights_transport=disk) or a transfer round (network, runner `send`)
    sf.weights.fetch      WeightsWanted in (network): a worker that missed a round gets one of its own
    sf.rollout.status     WorkerStatus heartbeats in: versions still served are kept by weight GC
    sf.trainer.status     TrainerStatus out: every STATUS_INTERVAL seconds and at each state change
    sf.sched.gate         TrainGate request out (with `scheduler_gate`): reclaim our hosts before a step
    sf.trainer.ctl        TrainerControl in (offload / reload of the ranks on `host`) -> TrainerStatus
    sf.dead.trainer.*     a delivery that does not decode or fails the checks: copied to the DEAD stream, then
                          terminated (shared/deadletter.py); counted in sf_bus_malformed_total

The loop, one global batch at a time:
1. a fetch task pulls deliveries, decodes and checks them (a bad one is dead-lettered, then terminated),
   and offers them to the intake: new ones buffer towards complete groups, repeats
   are held or acked (intake.py, ledger.py);
2. once `groups_per_step` groups are complete, every rank trains on them
   (runner.py broadcasts the batch); then snapshot the weights into the store,
   announce the version, collect old versions;
3. every `checkpoint_every` steps, save a checkpoint whose client state holds the
   step, the version and the ledger, and only then ack the deliveries it covers.
States reported in TrainerStatus: waiting (for data) -> ready (at the gate, only with
`scheduler_gate`) -> computing -> publishing (announce, GC, checkpoint) -> waiting;
stopped at the end. Runner commands run one at a time (`_device`): an offload or reload
waits for the step in progress, never cuts it.
A gate that is not granted (refused, timed out, no scheduler) is logged; then the step
computes anyway, or, with `gate_fallback` "wait" (the default on CUDA, where a lent host's
vLLM holds the device), the trainer asks again and again, logging each time, and never
computes until granted; a quit while it waits gives the batch back untrained.
Meanwhile a keepalive task sends in_progress() for every held delivery, so none is
redelivered while it waits for its group, its step or its checkpoint.

On quit: finish the step in flight, checkpoint what was trained since the last
checkpoint (so it is acked, not retrained), nak what was not trained, stop the
other ranks, close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from typing import Literal
from pathlib import Path

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from services.trainer.audit import AuditLog
from services.trainer.config import TrainerConfig
from services.trainer.intake import Action, Intake, check_trajectory
from services.trainer.ledger import Ledger
from services.trainer.metrics import Metrics
from services.trainer.runner import Command, Runner, control_scope, encode_groups
from shared import bus, subjects, weightstore
from shared.adapters import parse_roles
from shared.codec import decode, encode
from shared.config import Connections
from shared.deadletter import Malformed
from shared.heartbeats import Heartbeats
from shared.messages.rollout import WorkerStatus
from shared.messages.weights import WeightsPublished, WeightsWanted, WeightTransfer
from shared.messages.scheduler import (
    SchedulerLeader,
    TrainerControl,
    TrainerState,
    TrainerStatus,
    TrainGate,
    TrainGateReply,
)
from shared.messages.trajectory import TrajectoryCompleted

log = logging.getLogger(__name__)

Settle = Literal["ack", "nak", "term", "in_progress"]  # what a delivery can be answered with

TRAJ_STREAM = subjects.TRAJECTORIES_STREAM
RANK_KEEPALIVE = 60.0  # seconds idle before ranks > 0 get a no-op (their broadcast wait must not time out)
ACK_CHUNK = 64  # concurrent ack_sync calls
STATUS_INTERVAL = 1.0  # seconds between TrainerStatus heartbeats
GATE_GRACE = 5.0  # seconds the gate request waits beyond the gate_timeout it gives the scheduler
GATE_RETRY = 1.0  # seconds between gate requests while a "wait" fallback waits for a grant
LEADER_GAP_RETRY = 0.25  # seconds between gate requests while no scheduler answers in a leader change
NO_SCHEDULER = "no scheduler answers on " + subjects.SCHED_GATE
NEW_LEADER = "the scheduler's leader changed"
MAX_LEADER_CHANGES = 3  # gate requests re-sent for leader changes, per step: then the fallback


class GateAbandoned(Exception):
    """The trainer was told to quit while it waited for a gate it must not compute without."""


class TrainerService:
    def __init__(self, cfg: TrainerConfig, conn: Connections, runner: Runner, resume: dict | None,
                 vocab_size: int, metrics: Metrics | None = None):
        self.cfg = cfg
        self.conn = conn
        self.runner = runner
        self.vocab_size = vocab_size
        self.roles = parse_roles(cfg.lora_roles) if cfg.lora_rank else ()  # multi-LoRA: the roles with an adapter
        resume = resume or {}
        self.step = int(resume.get("step", 0))
        self.checkpointed_step = self.step
        self.version = int(resume.get("version", 0))  # the newest version announced (staleness reference)
        self.intake = Intake(cfg.group_size, Ledger.restore(resume.get("ledger")))
        self.metrics = metrics or Metrics(cfg.metrics_port, cfg.tensorboard_dir, cfg.metrics_host)
        self.audit = AuditLog(cfg.audit_log or None)
        self.malformed = Malformed("trainer", self.metrics.registry)  # sf_bus_malformed_total on our /metrics
        self.store = Path(cfg.weights_dir)
        # worker id -> the version it serves, aged by receive time (monotonic): the trainer's clock,
        # not the worker's, decides whether a pin still holds
        self.served: Heartbeats[int] = Heartbeats(cfg.worker_stale_after)
        self.worker_states: Heartbeats[str] = Heartbeats(cfg.worker_stale_after)  # network rounds wait for the awake ones
        self.network = cfg.weights_transport == "network"
        self._weights_are = self.version  # the version the weights equal now (None: trained past it, unannounced)
        self._rounds = 0  # network rounds sent, for unique group names
        self._wake = asyncio.Event()
        self._stop_fetch = asyncio.Event()
        self._resumed = bool(resume)
        self._listening_since = float("inf")
        self.js = None
        self.nc = None
        self.state: TrainerState = "waiting"
        self.last_wait_s = self.last_compute_s = 0.0
        self._scheduler_seen = False  # a scheduler has answered a gate: silence later is a leader change
        self._leader_term = 0  # the newest scheduler term announced on sf.sched.leader
        self._new_leader = asyncio.Event()  # set when a newer term is announced (a gate in flight asks again)
        self._catch_ups: set[asyncio.Task] = set()
        self._wanted: dict[str, list[str]] = {}  # network: worker id -> reply subjects for the next catch-up round
        self._device = asyncio.Lock()  # one runner command at a time: steps, checkpoints, offload/reload
        # every rank's host (TrainerStatus.hosts, TrainGate.hosts); SF_TRAINER_HOST where the ranks report none
        self.hosts: list[str] = list(getattr(runner, "hosts", None) or ([cfg.host] if cfg.host else []))
        self._quit = asyncio.Event()

    async def run(self, quit: asyncio.Event) -> int:
        cfg = self.cfg
        self._quit = quit
        async with AsyncExitStack() as stack:
            # 1. connect, declare streams, learn where versions stand
            nc = await bus.connect(self.conn, name="trainer")
            stack.push_async_callback(bus.wait_closed, nc)
            self.nc = nc
            self.js = js = nc.jetstream()
            streams = subjects.STREAMS
            await bus.ensure_streams(js, streams)
            self.malformed.attach(nc, streams)
            stack.push_async_callback(self.malformed.drain)  # dead letters under way, before the close
            await self._init_version()
            self.audit.resume(self.step)
            await self._subscribe(nc)
            heartbeat = asyncio.create_task(self._status_loop(), name="status")
            self._listening_since = time.monotonic()

            # 2. the durable consumer. Its max_ack_pending holds a whole checkpoint interval (the server
            # default is 1000); add_consumer is create-or-update, so a changed ack_wait or limit applies to
            # an existing consumer too (pull_subscribe alone keeps the old config). Its metadata tells
            # admission control how many sessions one published version trains.
            await js.add_consumer(TRAJ_STREAM, subjects.trainer_consumer(
                cfg.durable, cfg.sessions_per_version(), cfg.ack_wait, cfg.max_deliver, cfg.max_ack_pending))
            sub = await js.pull_subscribe(subjects.TRAJ_COMPLETED, durable=cfg.durable, stream=TRAJ_STREAM)
            fetcher = asyncio.create_task(self._fetch_loop(sub), name="fetch")
            keepalive = asyncio.create_task(self._keepalive_loop(), name="keepalive")
            log.info("trainer ready: consuming %s as durable %r (step %d, version %d, %d rank(s), metrics port %s)",
                     subjects.TRAJ_COMPLETED, cfg.durable, self.step, self.version, self.runner.world,
                     self.metrics.port or "off")

            # 3. steps
            clean = False
            try:
                while not quit.is_set() and not (cfg.max_steps and self.step >= cfg.max_steps):
                    t0 = time.perf_counter()
                    groups = await self._next_batch(quit, fetcher)
                    if groups is None:
                        break
                    await self._step(groups, wait_s=time.perf_counter() - t0)
                clean = True
            finally:
                # 4. drain: stop fetching, keep what was trained, hand back the rest
                await self._drain(fetcher, sub, clean)
                keepalive.cancel()
                await self._hand_back()
                heartbeat.cancel()
                await self._set_state("stopped")
                self.metrics.close()
        return 0

    async def _subscribe(self, nc) -> None:
        """Workers' status, the scheduler's control, and (network weights) catch-up requests."""
        await nc.subscribe(subjects.ROLLOUT_STATUS, cb=self._on_status)
        await nc.subscribe(subjects.TRAINER_CTL, cb=self._on_control)
        await nc.subscribe(subjects.SCHED_LEADER, cb=self._on_leader)
        if self.network:
            await nc.subscribe(subjects.WEIGHTS_FETCH, cb=self._on_fetch)

    async def _drain(self, fetcher: asyncio.Task, sub, clean: bool) -> None:
        """Stop fetching; checkpoint what was trained if the steps ended without a failure (`clean`)."""
        self._stop_fetch.set()
        try:
            await asyncio.wait_for(fetcher, self.cfg.fetch_timeout + 5)
        except Exception:  # timed out, or it had failed: either way it is over
            fetcher.cancel()
        try:  # a drain would wait on deliveries nobody will read; they come back after ack_wait
            await sub.unsubscribe()
        except Exception as e:
            log.debug("unsubscribe: %s", e)
        # After a failure the ranks may be out of step: no more collectives, nothing acked;
        # the uncheckpointed trajectories come back to the next run and train once there.
        if clean and self.step > self.checkpointed_step:
            async with self._device:
                await self._checkpoint()

    async def _hand_back(self) -> None:
        """The deliveries not trained yet go back to the stream, for the next run."""
        untrained = self.intake.untrained()
        await asyncio.gather(*(self._settle(m, "nak") for m in untrained))
        log.info("trainer stopped at step %d, version %d (%d untrained deliveries handed back)",
                 self.step, self.version, len(untrained))

    async def _init_version(self) -> None:
        cur = await weightstore.current(self.js)
        announced = cur.version if cur else 0
        if not self._resumed and announced > 0:
            log.warning("no checkpoint: training starts from %s although version %d (%s) is announced",
                        self.cfg.model_dir, announced, cur.path)
        self.version = max(self.version, announced)

    def next_version(self) -> int:
        return max([self.version, *weightstore.versions_on_disk(self.store)]) + 1

    # -- data in ----------------------------------------------------------------------------------

    async def _fetch_loop(self, sub) -> None:
        n = self.cfg.groups_per_step
        while not self._stop_fetch.is_set():
            if self.intake.ready_groups() >= 2 * n:  # prefetch at most one batch ahead
                await asyncio.sleep(0.05)
                continue
            try:
                msgs = await sub.fetch(self.cfg.fetch_batch, timeout=self.cfg.fetch_timeout)
            except NatsTimeout:
                continue
            except Exception as e:  # reconnecting; the client retries the connection itself
                log.warning("fetch failed: %s", e)
                await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                await self._on_msg(msg)
            self._wake.set()

    async def _on_msg(self, msg: Msg) -> None:
        # one it cannot read is logged once per cause, copied to DEAD, then terminated: in a task, the
        # fetch goes on
        traj = self.malformed.decode(msg, TrajectoryCompleted, subjects.TRAJ_COMPLETED,
                                     check=lambda t: check_trajectory(t, self.vocab_size, self.roles))
        if traj is None:
            self.metrics.count("bad")
            return
        action = self.intake.offer(traj, msg, time.time())
        if action is not Action.TRAIN:
            self.metrics.count("duplicate")
            log.info("trajectory %s delivered again (stream seq %s): %s", traj.session_id, _seq(msg),
                     "covered by a checkpoint, acked" if action is Action.ACK else "held with its first delivery")
        if action is Action.ACK:
            await self._settle(msg, "ack")

    async def _next_batch(self, quit: asyncio.Event, fetcher: asyncio.Task):
        idle = time.monotonic()
        while not quit.is_set():
            self._wake.clear()
            groups = self.intake.take(self.cfg.groups_per_step)
            if groups:
                return groups
            if fetcher.done():
                fetcher.result()  # raises what stopped it
                raise RuntimeError("the fetch task ended")
            try:
                await asyncio.wait_for(self._wake.wait(), 1.0)
            except TimeoutError:
                pass
            if self.runner.world > 1 and time.monotonic() - idle > RANK_KEEPALIVE:
                async with self._device:
                    await self._run(Command("noop"))
                idle = time.monotonic()
        return None

    async def _keepalive_loop(self) -> None:
        interval = max(0.2, self.cfg.ack_wait / 3)
        while True:
            await asyncio.sleep(interval)
            held = self.intake.held()
            await asyncio.gather(*(self._settle(m, "in_progress") for m in held))
            groups, msgs = self.intake.expire(time.time(), self.cfg.group_timeout)
            if groups:
                log.warning("dropped %d group(s) incomplete after %.0fs (%s): %d deliveries terminated",
                            len(groups), self.cfg.group_timeout, ", ".join(groups[:5]), len(msgs))
                self.metrics.count("expired", len(msgs))
                await asyncio.gather(*(self._settle(m, "term") for m in msgs))

    # -- a step ----------------------------------------------------------------------------------

    async def _step(self, groups, wait_s: float) -> None:
        """The gate (outside `_device`: while the trainer waits there, the scheduler's reclaim sends
        it a reload), then the step, which no offload or reload can cut."""
        try:
            gate = await self._gate(self.step + 1) if self.cfg.scheduler_gate else {}
        except GateAbandoned:
            log.warning("step %d not computed: told to quit while waiting for the gate; its %d deliveries "
                        "come back after ack_wait", self.step + 1, sum(len(g) for g in groups))
            return
        async with self._device:
            await self._train(groups, wait_s, gate)

    async def _run(self, cmd: Command) -> dict:
        """One runner command, on every rank; the caller holds `_device`."""
        assert self._device.locked(), "runner commands must hold the device lock"
        return await asyncio.to_thread(self.runner.run, cmd)

    async def _train(self, groups, wait_s: float, gate: dict[str, float] | None = None) -> None:
        cfg = self.cfg
        step = self.step + 1
        publish = step % cfg.publish_every == 0
        version = self.next_version() if publish else self.version
        dest = weightstore.version_dir(self.store, version) if publish and not self.network else None

        # 1. every rank trains (and, if publishing, snapshots the weights into the store)
        cmd = Command("train", step=step, batch=encode_groups(groups), version=self.version,
                      publish_dir=str(dest) if dest else "")
        await self._set_state("computing")
        out = await self._run(cmd)
        ids = out["ids"]
        self.intake.trained(ids, step)
        self.step = step
        self.metrics.count("trained", len(ids))
        self._weights_are = None
        await self._set_state("publishing")
        m = dict(out["metrics"])
        if publish and self.network:
            t0 = time.perf_counter()
            m.update(await self._send_round(version, step, self._awake_workers()))
            out["save_s"] = time.perf_counter() - t0  # reported as publish_s, like the disk snapshot
            self.version = version

        # 2. announce the new version, then drop versions nobody needs
        t0 = time.perf_counter()
        if dest is not None:
            await self._announce_dir(version, dest, step)
        self.audit.step(step, self.version, ids)

        # 3. checkpoint, then ack what it covers
        ckpt_s = 0.0
        if step % cfg.checkpoint_every == 0 or (cfg.max_steps and step >= cfg.max_steps):
            ckpt_s = await self._checkpoint()

        m.update(wait_s=wait_s, publish_s=out.get("save_s", 0.0) + time.perf_counter() - t0 - ckpt_s,
                 checkpoint_s=ckpt_s, **(gate or {}))
        if "reload_s" in out:  # the states were still offloaded: the step reloaded them first
            m["reload_s"] = out["reload_s"]
        m["step_s"] = wait_s + m.get("gate_s", 0.0) + m["compute_s"] + m["publish_s"] + ckpt_s
        self.last_wait_s, self.last_compute_s = wait_s, m["compute_s"]
        m["train_tokens_per_s"] = m.get("tokens", 0.0) / m["compute_s"] if m["compute_s"] else 0.0
        m["tokens_per_s"] = m.get("tokens", 0.0) / m["step_s"] if m["step_s"] else 0.0
        for k, v in self.intake.counts().items():
            m[f"intake_{k}"] = float(v)
        log.info("%s", self.metrics.step(step, self.version, m, out["staleness"]))
        await self._set_state("waiting")

    async def _announce_dir(self, version: int, dest: Path, step: int) -> None:
        """The shared-disk path: check the snapshot, announce its path, collect old versions."""
        cfg = self.cfg
        await asyncio.to_thread(weightstore.check_checkpoint, dest)
        await weightstore.announce(self.js, version, dest, step=step, retry_for=cfg.publish_retry_s)
        self.version = self._weights_are = version
        in_use = self.in_use()
        if in_use is not None:  # else: too soon after start to know; a later publish collects
            removed = await asyncio.to_thread(weightstore.collect_garbage, self.store, in_use, cfg.keep_versions)
            if removed:
                log.info("weight store: removed versions %s", removed)

    # -- weights over the network -------------------------------------------------------------

    def _awake_workers(self) -> int:
        """Workers a round waits for: alive and not asleep (a sleeping engine loads nothing)."""
        return sum(state not in ("sleeping", "paused") for state in self.worker_states.alive(time.monotonic()).values())

    def _transfer(self, version: int) -> WeightTransfer:
        self._rounds += 1
        return WeightTransfer(self.cfg.weights_bind, self.runner.sender.port, f"v{version}-r{self._rounds}")

    async def _send_round(self, version: int, step: int, receivers: int, announce: bool = True,
                          replies: tuple[str, ...] = ()) -> dict[str, float]:
        """One round of the weights as they are, labelled `version`: the runner opens it and sends
        (every rank: ZeRO-3 gathers) while this announces it (or answers `replies`). Holds `_device`."""
        transfer = self._transfer(version)
        sending = asyncio.create_task(self._run(Command("send", step=step, version=version, group=transfer.group,
                                                        receivers=receivers)))
        event = WeightsPublished(version, "", time.time(), step, transfer)
        if announce:
            await weightstore.announce(self.js, version, None, step=step, retry_for=self.cfg.publish_retry_s,
                                       transfer=transfer)
        for reply in replies:  # a catch-up round's askers
            await self.nc.publish(reply, encode(event))
        out = await sending
        self._weights_are = version
        log.info("version %d over the network (%s): %d receiver(s), %.1f MB, join %.2fs, send %.2fs", version,
                 transfer.group, out["receivers"], out["sent_bytes"] / 1e6, out["join_s"], out["send_s"])
        return {k: float(out[k]) for k in ("join_s", "send_s", "receivers")}

    async def _on_fetch(self, msg: Msg) -> None:
        want = self.malformed.decode(msg, WeightsWanted, subjects.WEIGHTS_FETCH)
        if want is None or not msg.reply:
            return
        first = not self._wanted
        self._wanted.setdefault(want.worker_id, []).append(msg.reply)
        if first:  # else the round already waiting for the device takes this one too
            task = asyncio.create_task(self._catch_up())
            self._catch_ups.add(task)
            task.add_done_callback(self._catch_ups.discard)

    async def _catch_up(self) -> None:
        """One round of its own for the workers that missed one, from the weights this rank holds:
        every worker that asked while the device was busy joins the same round (a lend wakes several
        at once). Only while the weights still are the newest announced version; else the replies
        say not now, and the next announcement brings it."""
        async with self._device:
            wanted, self._wanted = self._wanted, {}
            replies = tuple(r for rs in wanted.values() for r in rs)
            if self._weights_are != self.version or self.version == 0:
                not_now = encode(WeightsPublished(self.version, "", time.time(), self.step))
                for reply in replies:
                    await self.nc.publish(reply, not_now)
                return
            log.info("catch-up round of version %d for %s", self.version, ", ".join(sorted(wanted)))
            await self._send_round(self.version, self.step, len(wanted), announce=False, replies=replies)

    async def _checkpoint(self) -> float:
        t0 = time.perf_counter()
        keep = self.cfg.ledger_keep_steps
        if keep:
            self.intake.ledger.prune(self.step - keep)
        client = {"step": self.step, "version": self.version, "ledger": self.intake.snapshot(self.step)}
        out = await self._run(Command("checkpoint", step=self.step, client_state=client))
        self.audit.checkpoint(self.step, out["tag"])
        self.checkpointed_step = self.step
        msgs = self.intake.committed(self.step)
        for i in range(0, len(msgs), ACK_CHUNK):
            await asyncio.gather(*(self._settle(m, "ack") for m in msgs[i:i + ACK_CHUNK]))
        log.info("checkpoint %s saved; acked %d deliveries", out["tag"], len(msgs))
        return time.perf_counter() - t0

    # -- the scheduler: status, gate, offload/reload -------------------------------------------

    def status(self) -> TrainerStatus:
        cfg = self.cfg
        return TrainerStatus(
            state=self.state, step=self.step, version=self.version, ready_groups=self.intake.ready_groups(),
            open_groups=self.intake.open_groups(), buffered_samples=self.intake.buffered_samples(),
            groups_per_step=cfg.groups_per_step, group_size=cfg.group_size, last_wait_s=self.last_wait_s,
            last_compute_s=self.last_compute_s, ts=time.time(), hosts=self.hosts,
            offloaded=sorted(getattr(self.runner, "offloaded_hosts", ())))

    async def _publish_status(self) -> None:
        try:
            await self.nc.publish(subjects.TRAINER_STATUS, encode(self.status()))
        except Exception as e:  # reconnecting: the next beat tells the same
            log.debug("status publish failed: %s", e)

    async def _set_state(self, state: TrainerState) -> None:
        if state != self.state:
            self.state = state
            await self._publish_status()

    async def _status_loop(self) -> None:
        in_use_known = False
        while True:
            await self._publish_status()
            if not in_use_known and (in_use := self.in_use()) is not None:
                in_use_known = True  # from now on a publish collects the versions nobody serves
                log.info("weight versions rollout workers serve: %s", sorted(in_use) or "none")
            await asyncio.sleep(STATUS_INTERVAL)

    def gate_waits(self) -> bool:
        """Whether an ungranted gate means wait (never compute) rather than compute anyway."""
        fallback = self.cfg.gate_fallback
        return fallback == "wait" or (fallback == "auto" and bool(getattr(self.runner, "cuda", False)))

    async def _gate(self, step: int) -> dict[str, float]:
        """Ask the scheduler to reclaim our hosts before step `step`; {gate_s, gate_granted}.

        A refusal, a timeout or no scheduler at all is logged with its reason; then the step runs
        anyway, or, where `gate_waits`, the trainer asks again until granted (GateAbandoned on quit)."""
        await self._set_state("ready")
        t0 = time.perf_counter()
        waits = self.gate_waits()
        changes = 0
        while True:
            why = await self._ask_gate(step)
            waited = time.perf_counter() - t0
            if not why:
                log.info("step %d: gate granted after %.2fs", step, waited)
                return {"gate_s": waited, "gate_granted": 1.0}
            if why == NEW_LEADER and changes < MAX_LEADER_CHANGES:
                # the leader we asked died (its answer will never come) and another leads: ask it now
                changes += 1
                log.info("step %d: a new scheduler leads (term %d); asking it", step, self._leader_term)
                continue
            if why == NO_SCHEDULER and self._scheduler_seen and waited < self.cfg.gate_leader_gap:
                # the leader died and a standby is taking over: computing now could run beside a lent
                # host's engine, so ask the next leader (bounded: gate_leader_gap, then the fallback)
                await asyncio.sleep(LEADER_GAP_RETRY)
                continue
            if not waits:
                log.warning("step %d: gate not granted (%s) after %.2fs; computing anyway", step, why, waited)
                return {"gate_s": waited, "gate_granted": 0.0}
            log.warning("step %d: gate not granted (%s) after %.2fs; waiting, not computing (gate_fallback=%s "
                        "on %s): a lent host's rollout engine may hold the device", step, why, waited,
                        self.cfg.gate_fallback, "cuda" if getattr(self.runner, "cuda", False) else "cpu")
            try:
                await asyncio.wait_for(self._quit.wait(), GATE_RETRY)
            except TimeoutError:
                continue
            raise GateAbandoned(step)

    async def _ask_gate(self, step: int) -> str:
        """One TrainGate request; "" if granted, else why not."""
        cfg = self.cfg
        gate = TrainGate(step=step, timeout=cfg.gate_timeout, hosts=self.hosts)
        self._new_leader.clear()
        try:
            msg = await self._request_unless_new_leader(
                self.nc.request(subjects.SCHED_GATE, encode(gate), timeout=cfg.gate_timeout + GATE_GRACE))
            if msg is None:
                return NEW_LEADER
            reply = decode(msg.data, TrainGateReply)
        except NoRespondersError:
            why = NO_SCHEDULER
        except (NatsTimeout, TimeoutError):
            why = f"no answer within {cfg.gate_timeout + GATE_GRACE:g}s"
        except msgspec.DecodeError as e:
            why = f"bad reply: {e}"
        except Exception as e:  # the connection is down or closing
            why = f"{type(e).__name__}: {e}"
        else:
            self._scheduler_seen = True
            why = "" if reply.granted else f"refused: {reply.reason or 'no reason given'}"
        return why

    async def _request_unless_new_leader(self, request):
        """The request's reply, or None once a newer scheduler term is announced first (the leader it
        went to may have died with it: a standby leads within seconds, the request's timeout is long)."""
        asking = asyncio.ensure_future(request)
        changed = asyncio.ensure_future(self._new_leader.wait())
        done: set = set()
        try:
            done, _ = await asyncio.wait({asking, changed}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # whichever is left, also when this task is cancelled meanwhile
            for f in (asking, changed):
                if f not in done:
                    f.cancel()
        return asking.result() if asking in done else None

    async def _on_leader(self, msg: Msg) -> None:
        ldr = self.malformed.decode(msg, SchedulerLeader, subjects.SCHED_LEADER)
        if ldr is not None and ldr.term > self._leader_term:
            first = self._leader_term == 0
            self._leader_term = ldr.term
            if not first:  # the first term heard is the leader a gate in flight already went to, or will
                self._new_leader.set()

    async def _on_control(self, msg: Msg) -> None:
        """TrainerControl: offload or reload the ranks on `ctl.host`, after the step in progress; the
        reply is a TrainerStatus. Requests run in arrival order (one subscription callback at a time)."""
        ctl = self.malformed.decode(msg, TrainerControl, subjects.TRAINER_CTL)
        if ctl is not None:  # one it cannot read is answered with our status all the same
            scope, note = control_scope(getattr(self.runner, "hosts", []), ctl.host)
            if note:
                log.warning("%s for host %s: %s", ctl.op, ctl.host, note)
            try:
                async with self._device:
                    out = await self._run(Command(ctl.op, host=scope))
                secs = out.get(f"{ctl.op}_s", 0.0)
                self.metrics.gauge(f"{ctl.op}_s", secs)
                log.info("%s for host %s in %.3fs", ctl.op, ctl.host or "-", secs)
            except Exception:
                log.exception("%s failed", ctl.op)
        if msg.reply:
            try:
                await self.nc.publish(msg.reply, encode(self.status()))
            except Exception as e:
                log.warning("control reply failed: %s", e)

    # -- weights in use ------------------------------------------------------------------------

    async def _on_status(self, msg: Msg) -> None:
        st = self.malformed.decode(msg, WorkerStatus, subjects.ROLLOUT_STATUS)
        if st is None:
            return
        self.served.beat(st.worker_id, st.version, at=time.monotonic())
        self.worker_states.beat(st.worker_id, st.state, at=time.monotonic())

    def in_use(self) -> set[int] | None:
        """Versions rollout workers serve now; None until heartbeats had `worker_stale_after` seconds to arrive."""
        now = time.monotonic()
        if now - self._listening_since < self.cfg.worker_stale_after:
            return None
        return set(self.served.alive(now).values())

    # -- acks --------------------------------------------------------------------------------------

    async def _settle(self, msg: Msg, how: Settle) -> None:
        """ack (waiting for the server), nak, term or in_progress; a failure is logged, never raised.

        A lost ack is safe: the message comes back, and the ledger acks it as already trained.
        """
        try:
            match how:
                case "ack":
                    await msg.ack_sync(timeout=5.0)
                case "nak":
                    await msg.nak()
                case "term":
                    await msg.term()
                case "in_progress":
                    await msg.in_progress()
        except Exception as e:
            log.warning("%s of stream seq %s failed: %s", how, _seq(msg), e)


def _seq(msg: Msg) -> str:
    try:
        return str(msg.metadata.sequence.stream)
    except Exception:
        return "?"
