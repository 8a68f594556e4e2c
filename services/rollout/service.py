"""The rollout worker's NATS wiring: the only module here that touches NATS.

    sf.rollout.gen.<worker_id>   Generate -> TokenDelta* then exactly one GenerateDone, to msg.reply; the first
                                 TokenDelta an empty receipt, sent at once, when the Generate asks for one
    sf.rollout.ctl.<worker_id>   RolloutControl -> WorkerStatus (after the op is done)
    sf.rollout.status            WorkerStatus heartbeat every `status_interval` seconds, and at once after a
                                 control and when the worker turns busy (first request) or idle (last one ends)
    sf.weights.published         polled (last value): newer versions are loaded in place, from the
                                 announced transfer round (network) or store path (disk)
    sf.weights.fetch             WeightsWanted request to the trainer when a round was missed, or a
                                 level-2 wake discarded network-received weights (refill.py): the
                                 reply names a round of its own

A message the worker cannot read is counted, logged once and (a stored weights event) dead-lettered
(shared/deadletter.py); a Generate gets a GenerateDone error with code bad_request.

No queue group on the gen subject: the trajectory manager picks the worker. The
worker holds no session state; everything it needs is in each Generate.

Under the tag scheduler (services/scheduler/host.py) a worker starts vacated
(`start_vacated`) and its host agent moves it with vacate (scheduled), sleep (keep for a
colocated train phase), wake, load and resume. The weight follower never loads into a
sleeping engine: the scheduler's lend sequence loads explicitly (wake, load, resume). A wake
(or resume) that finds the weights discarded with no path to reload them (network transport)
receives them again before it serves; if it cannot, the worker reports `paused` and serves nothing.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import AsyncExitStack, aclosing

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.checkpoint import CheckpointError
from services.rollout.config import RolloutConfig, served_name
from services.rollout import refill
from services.rollout.engine import Engine, EngineAsleep, EngineDead, EngineError, TransferMissed, WeightsGone
from shared import bus, subjects
from shared.codec import decode, encode
from shared.config import Connections
from shared.deadletter import Malformed
from shared.deltas import Held, with_tail
from shared.weightfollow import WeightFollower
from shared.messages.rollout import (
    ErrorCode,
    FinishReason,
    Generate,
    GenerateDone,
    RolloutControl,
    TokenDelta,
    WorkerState,
    WorkerStatus,
)
from shared.messages.weights import WeightsPublished, WeightsWanted

log = logging.getLogger(__name__)

CONTROL_WAIT = 10.0  # seconds a control reply waits for the requests it ended to send their GenerateDone
SHUTDOWN_WAIT = 15.0  # seconds shutdown waits for in-flight requests to end "preempted"
CATCH_UP_WAIT = 120.0  # seconds a catch-up request waits: the trainer answers between steps
EXIT_ENGINE_DEAD = 3  # process exit code when the engine died (a supervisor restarts the worker)


class _Run:
    """One request's progress on this worker: how it ends, and with how many tokens of which version."""

    __slots__ = ("finish", "error", "code", "version", "tokens")

    def __init__(self, version: int) -> None:
        self.finish: FinishReason = "preempted"
        self.error = ""
        self.code: ErrorCode = ""
        self.version = version
        self.tokens = 0


class RolloutService:
    def __init__(self, cfg: RolloutConfig, conn: Connections, engine: Engine | None = None):
        self.cfg = cfg
        self.conn = conn
        self.engine = engine or Engine(cfg)
        self.model = served_name(cfg)
        self.instance = secrets.token_hex(6)  # WorkerStatus.instance: this process, not its worker id
        self.nc: NATS | None = None
        self.tasks: dict[str, asyncio.Task] = {}  # request_id -> its generate task
        self.generated_tokens = 0
        self.closing = False
        self._ctl_tasks: set[asyncio.Task] = set()
        self._aborted: set[str] = set()  # aborted before their task started
        self._moved: set[str] = set()  # aborted with `scheduled` (a router's rebalance): their preemption says so
        self._quit = asyncio.Event()
        self._admit = asyncio.Event()  # cleared while a drain-policy update holds new requests
        self._admit.set()
        self._rejected: set[int] = set()  # published versions whose checkpoint failed the checks
        self.lent_until = 0.0  # wall clock: when the scheduler expects to reclaim this worker (0 = not lent)
        self._scheduled_vacate = False  # the vacate in force is the scheduler's: its preemptions say so
        self.malformed = Malformed("rollout")
        self._refilling = asyncio.Lock()  # one refill at a time (a wake's and a resume's would ask twice)
        self._catching_up: asyncio.Task | None = None  # the catch-up in flight, which a second caller shares

    async def run(self, quit: asyncio.Event) -> int:
        """Serve until `quit` is set or the engine dies; returns the process exit code."""
        self._quit = quit
        wid = self.cfg.worker_id
        t0 = time.monotonic()
        await self.engine.start()
        log.info("engine up in %.1fs (%s, max_model_len=%d)",
                 time.monotonic() - t0, self.cfg.model, self.cfg.max_model_len)
        try:
            async with AsyncExitStack() as stack:
                # 1. connect and subscribe
                self.nc = await bus.connect(self.conn, name=f"rollout-{wid}")
                stack.push_async_callback(bus.wait_closed, self.nc)
                metrics = self.malformed.enter(stack, self.nc, subjects.STREAMS, self.cfg.metrics_port, self.cfg.metrics_host)
                gen_sub = await self.nc.subscribe(subjects.rollout_gen(wid), cb=self._on_generate)
                await self.nc.subscribe(subjects.rollout_ctl(wid), cb=self._on_control)
                await self.nc.flush(timeout=5)
                if self.cfg.follow_weights:
                    follower = asyncio.create_task(
                        WeightFollower(self.nc, self._on_newest_weights, self.cfg.weights_poll, self.malformed).run())
                    stack.callback(follower.cancel)
                await self._publish_status()
                log.info("rollout worker %s ready%s", wid, f" (metrics port {metrics.port})" if metrics.port else "")
                # 2. heartbeat until told to quit, or the engine is dead
                while not quit.is_set():
                    try:
                        await asyncio.wait_for(quit.wait(), self.cfg.status_interval)
                    except TimeoutError:
                        pass
                    if self.engine.dead:
                        quit.set()
                    await self._publish_status()
                # 3. stop taking work, end what is in flight ("preempted"), say so, then drain
                log.info("shutting down: %d requests in flight", len(self.tasks))
                self.closing = True
                await gen_sub.unsubscribe()
                await self._end_inflight()
                await self._publish_status()
        finally:
            self.engine.shutdown()
        log.info("rollout worker %s stopped", wid)
        return EXIT_ENGINE_DEAD if self.engine.dead else 0

    # -- status ---------------------------------------------------------------------------------

    def state(self) -> WorkerState:
        e = self.engine
        if e.dead or self.closing:
            return "paused"
        if e.updating:
            return "updating"
        if e.needs_refill and not e.sleeping:  # awake without weights: takes no work until they are back
            return "paused"
        if e.sleeping:
            return "sleeping"
        return "vacated" if e.vacated else "serving"

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            worker_id=self.cfg.worker_id,
            state=self.state(),
            version=self.engine.version,
            running=len(self.tasks),
            capacity=self.cfg.max_num_seqs,
            model=self.model,
            max_model_len=self.cfg.max_model_len,
            ts=time.time(),
            host=self.cfg.host,
            generated_tokens=self.generated_tokens,
            lent_until=self.lent_until,
            instance=self.instance,
            receipts=True,
        )

    async def _publish_status(self) -> None:
        await self._send(subjects.ROLLOUT_STATUS, self.status())

    async def _send(self, subject: str, msg: msgspec.Struct) -> None:
        try:
            await self.nc.publish(subject, encode(msg))
        except Exception as e:  # connection closed or buffer full: the caller times out and re-dispatches
            log.warning("publish to %s failed: %s", subject, e)

    # -- generate -------------------------------------------------------------------------------

    async def _on_generate(self, msg: Msg) -> None:
        req = self.malformed.decode(msg, Generate, subjects.rollout_gen("*"), refuse=lambda why: self._done(
            "", "error", 0, error=f"bad Generate: {why}", code="bad_request"))
        if req is None:
            return
        if not msg.reply:
            log.warning("Generate %s has no reply inbox; ignored", req.request_id)
            return
        if req.request_id in self.tasks:
            await self._send(msg.reply, self._done(req.request_id, "error", len(req.prompt_ids),
                                                   error=f"request {req.request_id!r} is already running",
                                                   code="bad_request"))
            return
        if req.receipt:  # before anything can wait (an engine step, a drain-policy update, vLLM's warm-up)
            await self._send(msg.reply, TokenDelta(req.request_id, [], [], self.engine.version))
        task = asyncio.create_task(self._generate(req, msg.reply))
        self.tasks[req.request_id] = task
        task.add_done_callback(lambda t, rid=req.request_id: self._ended(rid, t))
        if len(self.tasks) == 1:  # idle -> busy: said now, not at the next beat (_ended)
            self._status_now()

    def _ended(self, rid: str, task: asyncio.Task) -> None:
        if self.tasks.get(rid) is task:
            self.tasks.pop(rid)
            if not self.tasks and not self.closing:
                self._status_now()  # busy -> idle

    def _status_now(self) -> None:
        """Publish the status at once: the scheduler's timeline (rollout or idle) follows `running`, and
        a lent worker's work often starts and ends between two beats (1 s apart), so a timeline that
        waited for the beats would call a busy lend idle (live: 35% against 0% by the engine's logs)."""
        task = asyncio.create_task(self._publish_status())
        self._ctl_tasks.add(task)
        task.add_done_callback(self._ctl_tasks.discard)

    async def _generate(self, req: Generate, reply: str) -> None:
        rid, n = req.request_id, len(req.prompt_ids)
        run = _Run(self.engine.version)
        t0 = time.monotonic()
        held = Held(req.hold_s, t0)  # tokens sent at most every hold_s (0: each as it comes); flushed before the end
        if self.engine.dead:
            run.error = f"worker engine dead: {self.engine.dead}"
        elif rid in self._aborted:
            self._aborted.discard(rid)
        elif not (self.closing or self.engine.vacated or self.engine.needs_refill):
            try:
                await self._relay(req, reply, held, run)
            except TimeoutError:
                run.finish, run.error = "error", f"request exceeded max_request_seconds={self.cfg.max_request_seconds:g}"
            except EngineError as e:
                run.finish, run.error, run.code = "error", str(e), e.code
            except EngineDead as e:
                run.finish, run.error = "preempted", f"worker engine dead: {e}"
            except asyncio.CancelledError:  # shutdown, after the engine would not end it
                await self._end(reply, held, self._done(rid, "preempted", n, run.version))
                raise
            except Exception as e:
                log.exception("request %s failed", rid)
                run.finish, run.error = "error", f"{type(e).__name__}: {e}"
        log.debug("request %s: %s after %d tokens in %.2fs (last version %d)", rid, run.finish, run.tokens,
                  time.monotonic() - t0, run.version)
        if run.finish == "error" and not run.code:
            run.code = "internal"  # a timeout, an unexpected exception, a dead engine: not the caller's fault
        # preempted by the scheduler's vacate: the caller re-dispatches without counting a failure
        # (or moved by a router's rebalance: an abort with `scheduled`)
        moved = rid in self._moved
        self._moved.discard(rid)
        scheduled = run.finish == "preempted" and not run.error and (
            moved or (self._scheduled_vacate and self.engine.vacated))
        await self._end(reply, held, self._done(rid, run.finish, n, run.version, run.error, run.code, scheduled))

    async def _relay(self, req: Generate, reply: str, held: Held, run: _Run) -> None:
        """The engine's tokens for `req`, sent to `reply` as `held` lets them go; `run` keeps count."""
        rid = req.request_id
        async with asyncio.timeout(self.cfg.max_request_seconds):
            await self._admit.wait()  # a drain-policy update holds new requests here
            async with aclosing(self.engine.generate(rid, req.prompt_ids, req.sampling, req.adapter)) as deltas:
                async for d in deltas:
                    if d.token_ids:
                        for out in held.add(TokenDelta(rid, d.token_ids, d.logprobs, d.version), time.monotonic()):
                            await self._send(reply, out)
                        self.generated_tokens += len(d.token_ids)
                        run.tokens += len(d.token_ids)
                        run.version = d.version
                    if d.finish is not None:
                        run.finish, run.error = d.finish, d.error

    async def _end(self, reply: str, held: Held, done: GenerateDone) -> None:
        """What `held` still holds, then the request's GenerateDone (the former riding on the latter, one
        message): no token is left behind."""
        first, done = with_tail(done, held.flush())
        if first is not None:
            await self._send(reply, first)
        await self._send(reply, done)

    def _done(self, rid: str, finish: FinishReason, n: int, version: int | None = None,
              error: str = "", code: ErrorCode = "", scheduled: bool = False) -> GenerateDone:
        version = self.engine.version if version is None else version
        return GenerateDone(rid, finish, n, version, self.cfg.worker_id, error, code, scheduled)

    # -- control --------------------------------------------------------------------------------

    async def _on_control(self, msg: Msg) -> None:
        # A load can take a while; an abort must not wait behind it. The engine serialises
        # pause/resume/load itself.
        task = asyncio.create_task(self._control(msg))
        self._ctl_tasks.add(task)
        task.add_done_callback(self._ctl_tasks.discard)

    async def _control(self, msg: Msg) -> None:
        ctl = self.malformed.decode(msg, RolloutControl, subjects.rollout_ctl("*"))
        if ctl is not None:  # one it cannot read is answered with the status: the caller learns where we stand
            log.info("control %s", ctl)
            try:
                await self._apply(ctl)
            except CheckpointError as e:
                log.error("rejected weights version %d: %s (still serving version %d)",
                          ctl.version, e, self.engine.version)
            except EngineDead as e:
                log.error("engine dead after %s: %s; exiting", ctl.op, e)
                self._quit.set()
            except EngineAsleep as e:
                log.warning("control %s refused: %s", ctl.op, e)
            except WeightsGone as e:
                log.error("worker %s cannot serve after %s: %s", self.cfg.worker_id, ctl.op, e)
            except Exception:
                log.exception("control %s failed", ctl.op)
        if msg.reply:
            await self._send(msg.reply, self.status())
        await self._publish_status()  # routers learn of a vacate/resume/load now, not at the next beat

    async def _apply(self, ctl: RolloutControl) -> None:
        match ctl.op:
            case "abort":
                await self._abort(ctl.request_id, ctl.scheduled)
            case "vacate":
                await self._vacate(ctl.scheduled)
            case "resume":
                if self.engine.sleeping:
                    await self.engine.wake()
                await self._refill()
                await self.engine.resume()
                self._scheduled_vacate = False
                self.lent_until = ctl.lent_until
            case "sleep":
                if not ctl.keep and not self.engine.vacated:
                    await self._vacate(ctl.scheduled)
                self.lent_until = 0.0
                await self.engine.sleep(keep=ctl.keep)
            case "wake":
                await self.engine.wake()
                self.lent_until = ctl.lent_until
                await self._refill()
            case "load":
                if ctl.version == self.engine.version and not self.engine.needs_refill:
                    log.info("version %d is already loaded", ctl.version)
                    return
                if not ctl.path:  # the weights travel over the network: a round of our own
                    await (self._refill() if self.engine.needs_refill else self._catch_up(ctl.version))
                    return
                t0 = time.monotonic()
                await self.engine.load_weights(ctl.path, ctl.version)
                log.info("loaded version %d from %s in %.2fs", ctl.version, ctl.path, time.monotonic() - t0)

    async def _abort(self, rid: str, scheduled: bool) -> None:
        """End one request "preempted"; `scheduled` (a router's rebalance moves it) says so in its GenerateDone."""
        task = self.tasks.get(rid)
        if scheduled and task is not None:
            self._moved.add(rid)
        if not await self.engine.abort(rid) and task is not None:
            self._aborted.add(rid)  # its task has not reached the engine yet
        if task is not None:
            await asyncio.wait([task], timeout=CONTROL_WAIT)

    async def _vacate(self, scheduled: bool) -> None:
        # 1. take no new work, and say so before anything waits: routers stop sending at once
        # (pause_abort_all sets the flag as well; setting it here makes the order explicit)
        self._scheduled_vacate = scheduled
        self.lent_until = 0.0
        self.engine.vacated = True
        await self._publish_status()
        # 2. end what is in flight ("preempted", with every token so far); never behind a weight load
        await self.engine.pause_abort_all()
        # 3. the reply goes once their GenerateDone are sent (bounded)
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=CONTROL_WAIT)

    # -- weights --------------------------------------------------------------------------------

    async def _on_newest_weights(self, cur: WeightsPublished) -> None:
        """Load each newly published version (shared/weightfollow.py: pushed, and polled so a
        worker that starts late or misses versions jumps to the newest one)."""
        if (cur.version > self.engine.version and cur.version not in self._rejected
                and not self.engine.dead and not self.closing and not self.engine.sleeping):
            await self._update(cur)

    async def _update(self, ev: WeightsPublished) -> None:
        if self.cfg.update_policy == "drain":
            self._admit.clear()
            if self.tasks:
                await asyncio.wait(list(self.tasks.values()), timeout=self.cfg.drain_timeout)
        try:
            if ev.transfer is not None:
                await self._receive(ev)
            else:
                await self._apply(RolloutControl(op="load", version=ev.version, path=ev.path))
        except CheckpointError as e:
            self._rejected.add(ev.version)
            log.error("rejected published version %d: %s (still serving %d)", ev.version, e, self.engine.version)
        except EngineDead as e:
            log.error("engine dead loading version %d: %s; exiting", ev.version, e)
            self._quit.set()
        except EngineAsleep:  # it went to sleep meanwhile; the scheduler's lend loads the newest version
            log.info("version %d not loaded: the engine sleeps", ev.version)
        finally:
            self._admit.set()
            await self._publish_status()

    async def _receive(self, ev: WeightsPublished) -> None:
        """The announced round; missed (joined late, or the sender is gone): a round of our own."""
        try:
            await self.engine.receive_weights(ev.transfer, ev.version)
        except TransferMissed as e:
            log.info("missed the round of version %d (%s); asking the trainer for one", ev.version, e)
            await self._catch_up(ev.version)

    async def _catch_up(self, version: int) -> None:
        """Ask the trainer (sf.weights.fetch) for a round of the newest version and receive it. The
        trainer holds the weights in checkpoint format; a peer worker holds vLLM's kernel layout
        (fused, repacked), which no load_weights takes back. Not now: the next announcement brings it.

        One request at a time: a missed announced round and a lend's load often ask together (a
        restarted worker), and the trainer always offers its newest version, so the second caller
        shares the first one's round. Two requests would cost the trainer a second round that this
        worker, already there, never joins: its whole join window (weights_join_window)."""
        if self._catching_up is None or self._catching_up.done():
            self._catching_up = asyncio.create_task(self._catch_up_once(version))
        await asyncio.shield(self._catching_up)

    async def _catch_up_once(self, version: int) -> None:
        try:
            offer = await self._ask_trainer(version, CATCH_UP_WAIT)
        except Exception as e:  # no trainer, a timeout, a reply we cannot read: the next poll asks again
            log.warning("catch-up of version %d: %s: %s", version, type(e).__name__, e)
            return
        if why := refill.refusal(offer, self.engine.version, refill=False):
            log.info("catch-up: %s; waiting for the next", why)
            return
        try:
            await self.engine.receive_weights(offer.transfer, offer.version)
        except TransferMissed as e:
            log.warning("catch-up round of version %d missed: %s", offer.version, e)

    async def _ask_trainer(self, version: int, timeout: float) -> WeightsPublished:
        """sf.weights.fetch: the trainer's offer (a round of our own, or "not now": no transfer)."""
        msg = await self.nc.request(subjects.WEIGHTS_FETCH, encode(WeightsWanted(self.cfg.worker_id, version)),
                                    timeout=timeout)
        return decode(msg.data, WeightsPublished)

    async def _refill(self) -> None:
        """After a level-2 wake of network-received weights: receive them again (refill.py, bounded).
        Raises WeightsGone when they could not be had; the status then says `paused`."""
        if not self.engine.needs_refill or self.engine.sleeping:
            return
        async with self._refilling:
            try:
                await refill.refill(self.engine, self._ask_trainer)
            finally:
                await self._publish_status()

    async def _end_inflight(self) -> None:
        # Let a running load finish: cancelled halfway it would leave the engine dead.
        if self._ctl_tasks:
            _, left = await asyncio.wait(list(self._ctl_tasks), timeout=CONTROL_WAIT)
            for task in left:
                task.cancel()
        if not self.tasks:
            return
        if not self.engine.dead:
            try:
                await asyncio.wait_for(self.engine.pause_abort_all(), SHUTDOWN_WAIT)
            except Exception as e:
                log.warning("vacate on shutdown failed: %s", e)
        pending = list(self.tasks.values())
        if pending:
            _, left = await asyncio.wait(pending, timeout=SHUTDOWN_WAIT)
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=2.0)
