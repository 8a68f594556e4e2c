"""Trajectory manager transport: the only module here that touches NATS.

Subscriptions (queue group "trajectory" where replicas share work):
    sf.chat          -> TurnHandler, replies streamed to the request's inbox
    sf.session.*     -> session create/get/reward/finish
    sf.chat.cancel   -> cancel the named request if this replica runs it (every replica)
    (a message none of these can read is counted, logged once and, if a stream stored it, dead-lettered:
    shared/deadletter.py; a request gets its protocol's 400)
    sf.rollout.status-> the worker table used for routing (every replica)
    sf.weights.published -> the policy version (shared/weightfollow.py: pushed, and polled)
    sf.traj.completed    <- TrajectoryCompleted of finished sessions (finishing.py retries while full)
    TRAJECTORIES stream  every `fill_poll` s: its fill and the trainer consumer's lag (back-pressure on
                         session creation, a warning per high-water crossing), the trim of trained
                         trajectories, and the sweep of pending publications (shared/backpressure.py)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import msgspec
import redis.exceptions
from nats.aio.msg import Msg

from services.trajectory import tokenpath
from services.trajectory.chat import LeaseLost, TurnError, TurnHandler
from services.trajectory.config import TrajectoryConfig
from services.trajectory.finishing import Publisher
from services.trajectory.messagelist import ChatRequestIn
from services.trajectory.rendering import Renderer
from services.trajectory.routing import Running, WorkerTable
from services.trajectory.sessions import SessionOps
from services.trajectory.store import Store
from shared import admission, backpressure, bus, subjects
from shared.admission import Backlog, BacklogUnknown
from shared.backpressure import Fill, HighWater
from shared.codec import decode, encode
from shared.config import Connections
from shared.deadletter import Malformed
from shared.deltas import merge_deltas
from shared.logonce import OncePerCause
from shared.redispool import PoolExhausted
from shared.weightfollow import WeightFollower
from shared.messages import (
    ChatCancel,
    ChatFailed,
    ChatRequest,
    Generate,
    GenerateDone,
    RolloutControl,
    RolloutReply,
    SessionReply,
    SessionRequest,
    TokenDelta,
    TrainerStatus,
    WeightsPublished,
    WorkerStatus,
)

log = logging.getLogger("sf.trajectory")
_warn = OncePerCause(log)
WEIGHTS_POLL = 1.0  # seconds between reads of the newest version besides the push


class TrajectoryService:
    def __init__(self, cfg: TrajectoryConfig, conn: Connections):
        self.cfg, self.conn = cfg, conn
        self.table = WorkerTable(cfg.worker_stale_after)
        self.running: dict[str, asyncio.Task] = {}
        # worker -> the Generate ids this replica runs there, oldest first, with what each has done (rebalance)
        self.on_worker: dict[str, dict[str, Running]] = {}
        self.session_ops: set[asyncio.Task] = set()
        self.policy_version = -1  # newest WeightsPublished; -1 until one is seen
        self.trainer: tuple[TrainerStatus, float] | None = None  # its newest heartbeat, when received (monotonic)
        self.limits = backpressure.limits_from_env()
        self.fill: Fill | None = None  # the newest reading of the TRAJECTORIES stream
        self._upkeep: asyncio.Task | None = None  # trim and sweep (_watch_stream)
        self.high_water = HighWater(self.limits.high_water)
        self.malformed = Malformed("trajectory")

    async def run(self, quit: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        async with AsyncExitStack() as stack:
            renderer = await asyncio.to_thread(Renderer.from_pretrained, self.cfg.model, self.cfg.full_render_check)
            self.nc = await bus.connect(self.conn, name="sf-trajectory")
            stack.push_async_callback(bus.wait_closed, self.nc)
            js = self.nc.jetstream()
            streams = subjects.STREAMS
            await bus.ensure_streams(js, streams)
            metrics = self.malformed.enter(stack, self.nc, streams, self.cfg.metrics_port, self.cfg.metrics_host)
            self.store = Store.connect(self.conn.redis_url, self.cfg.session_ttl,
                                       wait=(self.cfg.redis_wait_replicas, self.cfg.redis_wait_ms), tls=self.conn.redis_tls)
            stack.push_async_callback(self.store.close)
            self.js = js
            self.turns = TurnHandler(self.cfg, self.store, renderer, self.table, self._call)
            self.publisher = Publisher(self.store, self._publish_trajectory, self.turns.owner)
            self.sessions = SessionOps(self.store, self.publisher, self.cfg, lambda: self.policy_version, self._backlog,
                                       pressure=self._pressure)
            watcher = asyncio.create_task(
                WeightFollower(self.nc, self._on_weights, WEIGHTS_POLL, self.malformed).run())
            stack.callback(watcher.cancel)
            await self._watch_stream()  # a first reading before sessions are admitted
            keeper = asyncio.create_task(self._stream_loop(quit))
            stack.callback(keeper.cancel)

            await self.nc.subscribe(subjects.ROLLOUT_STATUS, cb=self._on_status)
            await self.nc.subscribe(subjects.TRAINER_STATUS, cb=self._on_trainer)
            await self.nc.subscribe(subjects.CHAT_CANCEL, cb=self._on_cancel)
            queue_subs = [
                await self.nc.subscribe(subjects.CHAT, queue=subjects.TRAJECTORY_QUEUE, cb=self._on_chat),
                await self.nc.subscribe(subjects.session_op("*"), queue=subjects.TRAJECTORY_QUEUE, cb=self._on_session),
            ]
            # "ready" means the server has the subscriptions: SUBs are buffered, and settle() (gc.collect,
            # ~0.3 s) right after ready would otherwise delay them: a request sent at once would meet
            # "no responders"
            await self.nc.flush(timeout=5)
            log.info("trajectory manager ready (model %s, %s%s)", self.cfg.model, self.conn.redacted(),
                     f", metrics port {metrics.port}" if metrics.port else "")
            if ready:
                ready.set()
            await quit.wait()
            # drain: leave the queue group (new turns go to the other replicas), then let running
            # turns finish, bounded
            for sub in queue_subs:
                await sub.unsubscribe()
            log.info("draining: %d turns and %d session ops running", len(self.running), len(self.session_ops))
            if self.running or self.session_ops:
                await asyncio.wait([*self.running.values(), *self.session_ops], timeout=30)

    # -- policy version and trainer backlog ------------------------------------------------------

    async def _on_weights(self, newest: WeightsPublished) -> None:
        if newest.version != self.policy_version:
            self.policy_version = newest.version
            log.info("policy version %d", newest.version)

    async def _on_trainer(self, msg: Msg) -> None:
        st = self.malformed.decode(msg, TrainerStatus, subjects.TRAINER_STATUS)
        if st is not None:
            self.trainer = (st, time.monotonic())

    def _held_by_trainer(self) -> int:
        """Sessions the trainer holds untrained, by its newest heartbeat; 0 without a fresh one (a
        trainer that died hands its deliveries back to the consumer's backlog after ack_wait)."""
        if self.trainer is None or time.monotonic() - self.trainer[1] > self.cfg.worker_stale_after:
            return 0
        st = self.trainer[0]
        return admission.held_by_trainer(st.ready_groups, st.group_size, st.groups_per_step, st.state)

    async def _backlog(self) -> Backlog:
        """Completed sessions the trainer has not trained yet, and how many it trains per version
        (its consumer's metadata). Raises BacklogUnknown if either cannot be read.

        Not trained yet: not delivered (the consumer's num_pending), or delivered and held in
        complete groups or the batch in hand (its heartbeat: `admission.held_by_trainer`). The
        consumer's delivered-but-unacked count would not do: the trainer holds trained messages
        unacked until a checkpoint covers them, and counting those would close admission for good."""
        consumer = f"consumer {self.cfg.trainer_consumer!r} on {subjects.TRAJECTORIES_STREAM}"
        try:
            info = await self.js.consumer_info(subjects.TRAJECTORIES_STREAM, self.cfg.trainer_consumer, timeout=2)
        except Exception as e:  # no trainer consumer yet, NATS down, a timeout: the backlog is unknown
            why = f"{consumer}: {type(e).__name__}: {e}"
            _warn(f"backlog:{type(e).__name__}", "admission refuses sessions: %s", why)
            raise BacklogUnknown(why) from None
        per_version = subjects.sessions_per_version(info.config)
        if per_version is None:
            why = f"{consumer} does not say how many sessions it trains per version ({subjects.SESSIONS_PER_VERSION})"
            _warn("backlog:no-batch-size", "admission refuses sessions: %s", why)
            raise BacklogUnknown(why)
        return Backlog(int(info.num_pending or 0) + self._held_by_trainer(), per_version)

    # -- the trajectory stream: back-pressure, trim, pending publications ---------------------------

    async def _publish_trajectory(self, event: bytes, msg_id: str) -> None:
        await bus.publish_durable(self.js, subjects.TRAJ_COMPLETED, event, msg_id=msg_id)

    def _pressure(self) -> SessionReply | None:
        """Refuse new sessions while the stream is at its high-water mark (429), or unread lately (503)."""
        fill, limits = self.fill, self.limits
        if fill is None or time.monotonic() - fill.read_at > max(5.0, 5 * self.cfg.fill_poll):
            return SessionReply(503, message="the trajectory stream's fill level is unknown (NATS trouble?)",
                                retry_after=5.0, code="backpressure_unknown")
        if fill.above(limits.high_water):
            trainer = f"the trainer lags {fill.lag} messages" if fill.lag >= 0 else "no trainer consumer exists"
            return SessionReply(
                429, message=f"back-pressure: the trajectory stream is {fill.fraction:.0%} full (high-water mark "
                f"{limits.high_water:.0%}) and {trainer}; retry after it catches up", retry_after=5.0,
                code="backpressure")
        return None

    async def _watch_stream(self) -> None:
        """1. read the fill; 2. log a high-water crossing; then, in a task of its own (one at a time), 3. trim
        trained trajectories; 4. publish pending ones (oldest first). Each step is best effort: the next pass
        retries. 3-4 wait for Redis connections, for seconds under load (bench/load.py, 500 agents on 2
        cores); awaited here, they held up the next reading, the fill went stale and new sessions got 503s."""
        try:
            fill = await backpressure.read_fill(self.js, subjects.TRAJECTORIES_STREAM, self.cfg.trainer_consumer,
                                                time.monotonic())
        except Exception as e:
            _warn(f"fill:{type(e).__name__}", "cannot read the %s stream: %s: %s", subjects.TRAJECTORIES_STREAM,
                  type(e).__name__, e)
            return
        self.fill = fill
        match self.high_water.update(fill.fraction):
            case "crossed":
                log.warning("the %s stream is %.0f%% full (high-water mark %.0f%%): new sessions are refused "
                            "(429) until the trainer catches up; trainer consumer lag %d, %d bytes, %d messages",
                            subjects.TRAJECTORIES_STREAM, 100 * fill.fraction, 100 * self.limits.high_water,
                            fill.lag, fill.bytes, fill.msgs)
            case "cleared":
                log.info("the %s stream is %.0f%% full, below its high-water mark: sessions are admitted again",
                         subjects.TRAJECTORIES_STREAM, 100 * fill.fraction)
        if self._upkeep is None or self._upkeep.done():
            self._upkeep = asyncio.create_task(self._trim_and_sweep(fill))

    async def _trim_and_sweep(self, fill: Fill) -> None:
        try:
            upto = await backpressure.trim(self.js, subjects.TRAJECTORIES_STREAM, fill, self.limits.trim_above)
            if upto:
                log.info("trimmed trained trajectories below stream seq %d (the trainer acked up to %d)", upto,
                         fill.ack_floor)
            if await self.store.count_finishing():
                await self.publisher.sweep()
        except Exception as e:  # NATS or Redis trouble: the next pass retries
            _warn(f"sweep:{type(e).__name__}", "stream upkeep failed: %s: %s", type(e).__name__, e)

    async def _stream_loop(self, quit: asyncio.Event) -> None:
        try:
            while not quit.is_set():
                await asyncio.sleep(self.cfg.fill_poll)
                await self._watch_stream()
        finally:
            if self._upkeep is not None:
                self._upkeep.cancel()

    # -- rollout workers -------------------------------------------------------------------------

    async def _on_status(self, msg: Msg) -> None:
        st = self.malformed.decode(msg, WorkerStatus, subjects.ROLLOUT_STATUS)
        if st is not None:  # None: another version's worker, or not a worker at all
            prev = self.table.get(st.worker_id)
            self.table.update(st)
            if self.cfg.rebalance and st.state == "serving" and (prev is None or prev.state not in ("serving", "updating")):
                await self._rebalance(st.worker_id)

    async def _rebalance(self, worker: str) -> None:
        """`worker` has begun serving (a lend): move it its share of the busier workers' requests
        (routing.WorkerTable.moves); each ends "preempted", scheduled, and re-dispatches to it."""
        running = {rid: r for ids in self.on_worker.values() for rid, r in ids.items()}
        moves = self.table.moves(time.time(), worker, {w: list(ids) for w, ids in self.on_worker.items()},
                                 running if self.cfg.rebalance_worth else None)
        if moves:
            log.info("worker %s serves: moving %d request(s) to it from %s", worker, len(moves),
                     ", ".join(sorted({w for w, _ in moves})))
        for w, rid in moves:
            try:
                await self.nc.publish(subjects.rollout_ctl(w), encode(RolloutControl(op="abort", request_id=rid,
                                                                                     scheduled=True)))
            except Exception as e:
                _warn(f"rebalance:{type(e).__name__}", "moving %s off worker %s failed: %s", rid, w, e)

    async def _call(self, worker: str, cmd: Generate) -> AsyncIterator[RolloutReply]:
        """Stream one Generate to `worker`. A worker that vanishes counts as a preemption, and so does a
        Generate it never received: one that sends receipts (WorkerStatus.receipts) is asked for one, and
        without it within `receipt_timeout` the request is re-dispatched (core NATS dropped it, as while
        the worker's subscription moved between cluster members); after it `first_token_timeout` applies."""
        self.table.inflight[worker] += 1
        run = Running(tokenpath.count(cmd.prompt_ids), 0, cmd.sampling.max_tokens)
        self.on_worker.setdefault(worker, {})[cmd.request_id] = run
        finished = timed_out = False
        instance = self.table.instance(worker)
        receipt = self.cfg.receipt_timeout if self.cfg.receipt_timeout > 0 and self.table.sends_receipts(worker) else None
        if receipt is not None:
            cmd = msgspec.structs.replace(cmd, receipt=True)
        try:
            async with bus.stream_request(
                self.nc, subjects.rollout_gen(worker), encode(cmd),
                self.cfg.first_token_timeout, self.cfg.token_timeout,
                # a dead worker: by heartbeat age, or by a new process under its id (a supervisor restarted it)
                alive=lambda: self.table.same_process(worker, instance, time.time()),
                receipt_timeout=receipt,
            ) as replies:
                async for data in replies:
                    # a turn that fell behind its worker takes what has arrived in one go (a GenerateDone
                    # may carry the held tail of a plain turn's tokens: generation.py takes them off it)
                    got = [decode(d, RolloutReply) for d in (data, *replies.ready())]
                    for reply in merge_deltas(got):
                        if isinstance(reply, GenerateDone):
                            finished = True
                        elif isinstance(reply, TokenDelta):
                            if not reply.token_ids:  # the receipt (Replies counted it): nothing to pass on
                                continue
                            run.generated += len(reply.token_ids)
                        yield reply
                        if finished:
                            return
        except (bus.ReplyTimeout, bus.BusUnavailable) as e:
            log.warning("worker %s lost request %s (%s); re-dispatching", worker, cmd.request_id, e)
            finished, timed_out = True, isinstance(e, bus.ReplyTimeout)
            yield GenerateDone(cmd.request_id, "preempted", tokenpath.count(cmd.prompt_ids), -1, worker)
        finally:
            self.table.inflight[worker] -= 1
            self.on_worker.get(worker, {}).pop(cmd.request_id, None)
            # cancelled (the agent left, a stop string, a lost lease) or timed out (the worker may be alive
            # but stuck, or only its heartbeats were late): free the worker's slot now
            if not finished or timed_out:
                ctl = encode(RolloutControl(op="abort", request_id=cmd.request_id))
                try:
                    await self.nc.publish(subjects.rollout_ctl(worker), ctl)
                except Exception as e:  # the worker keeps generating until max_tokens: worth knowing
                    _warn(f"abort:{type(e).__name__}", "abort of %s on worker %s failed: %s", cmd.request_id,
                          worker, e)

    # -- chat turns ------------------------------------------------------------------------------

    async def _on_chat(self, msg: Msg) -> None:
        # its messages decoded only where read (messagelist.py)
        req = self.malformed.decode(msg, ChatRequestIn, subjects.CHAT,
                                    refuse=lambda why: ChatFailed("", 400, "invalid_request", why))
        if req is None:
            return
        task = asyncio.create_task(self._chat(req, msg.reply))
        self.running[req.request_id] = task
        task.add_done_callback(lambda _: self.running.pop(req.request_id, None))

    async def _chat(self, req: ChatRequest, reply_to: str) -> None:
        async def emit(m) -> None:
            await self.nc.publish(reply_to, encode(m))

        started = time.monotonic()
        try:
            done = await self.turns.handle(req, emit)
            await emit(done)
            # debug, not info: a line a turn is hundreds a second at scale, and writing it cost 7% of this
            # process's CPU per turn (py-spy, BENCHMARKS.md); the metrics and the live view count turns
            log.debug("turn %s session %s: %d+%d tokens in %.2fs", req.request_id, done.session_id,
                      done.usage.prompt_tokens, done.usage.completion_tokens, time.monotonic() - started)
        except TurnError as e:
            await emit(ChatFailed(req.request_id, e.status, e.code, e.message))
        except LeaseLost as e:  # the gateway re-sent it; the replica that holds the lease answers
            log.warning("turn %s stopped: %s", req.request_id, e)
        except PoolExhausted as e:  # Redis is fine; this replica is behind (it waited in line, bounded)
            log.warning("turn %s refused: %s", req.request_id, e)
            await emit(ChatFailed(req.request_id, 503, "overloaded", f"the trajectory manager is overloaded ({e}); "
                                  "retry"))
        except redis.exceptions.RedisError as e:
            log.warning("redis error on %s: %s", req.request_id, e)
            await emit(ChatFailed(req.request_id, 503, "redis_unavailable", f"Redis is unreachable: {e}"))
        except asyncio.CancelledError:
            log.info("turn %s cancelled by the agent", req.request_id)
        except Exception as e:
            log.exception("turn %s failed", req.request_id)
            await emit(ChatFailed(req.request_id, 500, "internal_error", f"{type(e).__name__}: {e}"))

    async def _on_cancel(self, msg: Msg) -> None:
        cancel = self.malformed.decode(msg, ChatCancel, subjects.CHAT_CANCEL)
        if cancel is None:
            return
        task = self.running.get(cancel.request_id)
        if task:
            task.cancel()

    # -- sessions --------------------------------------------------------------------------------

    async def _on_session(self, msg: Msg) -> None:
        # a task each: a finish may wait `publish_wait` s for room in the stream, and must not hold up
        # the session ops queued behind it (subscription callbacks run one at a time)
        task = asyncio.create_task(self._session(msg))
        self.session_ops.add(task)
        task.add_done_callback(self.session_ops.discard)

    async def _session(self, msg: Msg) -> None:
        req = self.malformed.decode(msg, SessionRequest, subjects.session_op("*"),
                                    refuse=lambda why: SessionReply(400, message=f"bad SessionRequest: {why}"))
        if req is None:
            return
        try:
            reply = await self.sessions.handle(req)
        except msgspec.ValidationError as e:
            reply = SessionReply(400, message=str(e))
        except PoolExhausted as e:
            reply = SessionReply(503, message=f"the trajectory manager is overloaded ({e}); retry", retry_after=1.0,
                                 code="overloaded")
        except redis.exceptions.RedisError as e:
            reply = SessionReply(503, message=f"Redis is unreachable: {e}", retry_after=1.0, code="redis_unavailable")
        except bus.BusUnavailable as e:
            reply = SessionReply(503, message=str(e), retry_after=1.0, code="nats_unavailable")
        except Exception as e:
            log.exception("session op failed")
            reply = SessionReply(500, message=f"{type(e).__name__}: {e}")
        if msg.reply:
            await msg.respond(encode(reply))
