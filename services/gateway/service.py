"""The gateway's runtime: owns the NATS and Redis clients; the only gateway module touching NATS.

Both apps (agent and admin) share one `Gateway`; each app's lifespan enters
`gateway.running()`, which is reference-counted: the first entry connects, the
last exit drains and closes. NATS is connected in the background and retried
until it answers, so a gateway started before NATS serves 503 (naming NATS)
instead of failing to start; nats-py then reconnects by itself after outages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from nats.aio.client import Client as NATS

from services.gateway.board import Board
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.limits import Limiter, TurnLimits
from services.gateway.metrics import Metrics
from services.gateway.store import KeyStore
from shared import backpressure, subjects
from shared.bus import BusUnavailable, ReplyTimeout, connect, request, stream_request, wait_closed
from shared.codec import decode, encode
from shared.config import Connections
from shared.deadletter import Malformed
from shared.heartbeats import WorkerHeartbeats
from shared.logonce import OncePerCause
from shared.messages.chat import ChatCancel, ChatDelta, ChatReply, ChatRequest
from shared.messages.rollout import RolloutControl, WorkerStatus
from shared.messages.scheduler import SchedulerControl, SchedulerReply, TrainerStatus
from shared.messages.session import SessionReply, SessionRequest

log = logging.getLogger(__name__)
_warn = OncePerCause(log)


def wire(msg: ChatRequest | SessionRequest) -> bytes:
    """The request as sent on NATS. Free-form JSON the agent sent (tool parameters, session metadata)
    rides in it, and msgpack has 64-bit integers only: a larger one is the agent's 400, not a 500."""
    try:
        return encode(msg)
    except OverflowError:
        raise ApiError(400, "the request holds an integer outside the 64-bit range (in tool parameters or "
                            "metadata); send it as a string", "invalid_value") from None


class NoProgress(ReplyTimeout):
    """The replica is alive (keepalives come) but generates no text within the deadline."""


def decode_reply(data: bytes) -> ChatReply:
    return decode(data, ChatReply)


class Gateway:
    def __init__(self, cfg: GatewayConfig, conn: Connections) -> None:
        self.cfg = cfg
        self.conn = conn
        self.metrics = Metrics()
        # heartbeats it cannot read: counted on /metrics (sf_bus_malformed_total) and logged once; none is stored
        self.malformed = Malformed("gateway", self.metrics.registry)
        self.limiter = Limiter(cfg.rate_limit, cfg.rate_burst, cfg.max_concurrent)
        self.turn_limits = TurnLimits(cfg.max_messages, cfg.max_tools, cfg.max_tokens_limit)
        self.store: KeyStore | None = None
        self._nc: NATS | None = None
        self._connecting: asyncio.Task | None = None
        self._users = 0
        self._lock = asyncio.Lock()
        self.started = int(time.time())
        self.workers = WorkerHeartbeats(cfg.worker_stale_after)  # latest heartbeat per rollout worker
        self.board = Board()  # the status page's history (/ui)

    # 1. lifecycle ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator["Gateway"]:
        async with self._lock:
            self._users += 1
            if self._users == 1:
                self._start()
        try:
            yield self
        finally:
            async with self._lock:
                self._users -= 1
                if self._users == 0:
                    await self._stop()

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """A Starlette lifespan (which must yield None or a state dict)."""
        async with self.running():
            yield

    def _start(self) -> None:
        self.store = KeyStore(self.conn.redis_url, self.cfg.static_keys(), self.cfg.redis_timeout,
                              self.cfg.session_key_ttl, self.cfg.key_cache_seconds, self.cfg.redis_pool_wait,
                              tls=self.conn.redis_tls)
        self._connecting = asyncio.get_running_loop().create_task(self._connect(), name="gateway-nats-connect")

    async def _connect(self) -> None:
        # shared.bus.connect retries by itself while NATS refuses connections; other failures
        # (bad credentials, a bad URL) are retried here, slowly. Cancelled on shutdown.
        while True:
            try:
                self._nc = await connect(self.conn, name="sf-gateway")
                await self._nc.subscribe(subjects.ROLLOUT_STATUS, cb=self._on_worker_status)
                await self._nc.subscribe(subjects.TRAINER_STATUS, cb=self._on_trainer_status)
                log.info("connected to NATS at %s", self.conn.redacted()["nats_url"])
                return
            except BusUnavailable as e:
                log.error("%s; retrying in 5s", e)
                await asyncio.sleep(5)

    async def _stop(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._connecting
        if self._nc is not None:
            await wait_closed(self._nc)
            self._nc = None
        if self.store is not None:
            await self.store.close()

    @property
    def keys(self) -> KeyStore:
        assert self.store is not None, "Gateway used outside gateway.running()"
        return self.store

    @property
    def nc(self) -> NATS:
        if self._nc is None or not self._nc.is_connected:
            raise BusUnavailable("not connected to NATS" + (" yet" if self._nc is None else ""))
        return self._nc

    async def health(self) -> dict[str, str]:
        nats_ok = self._nc is not None and self._nc.is_connected
        redis_ok = self.store is not None and await self.store.ping()
        return {"nats": "ok" if nats_ok else "down", "redis": "ok" if redis_ok else "down"}

    # 2. the trajectory manager, over NATS -----------------------------------------------------

    async def chat(self, req: ChatRequest) -> AsyncIterator[ChatReply]:
        """Send one turn; yield its replies (ChatDelta* then ChatDone | ChatFailed).

        Liveness has two levels. Any reply, keepalives included, must come within
        `silence_timeout`, or the replica is presumed dead and the same request is re-sent
        (bounded), for another replica to resume; its deltas restart at offset 0, which the
        caller de-duplicates by offset. Generated text must come within `first_token_timeout`,
        then within `idle_timeout` of the previous text: otherwise ReplyTimeout (504).
        """
        cfg = self.cfg
        payload = wire(req)
        progress = time.monotonic()
        limit, what = cfg.first_token_timeout, "first token"
        for attempt in range(cfg.resend_attempts + 1):
            if attempt:
                log.warning("request %s: no reply for %.1fs, re-sending (%d/%d)", req.request_id,
                            cfg.silence_timeout, attempt, cfg.resend_attempts)
            try:
                async with stream_request(self.nc, subjects.CHAT, payload, cfg.silence_timeout,
                                          cfg.silence_timeout) as raw:
                    async for data in raw:
                        reply = decode_reply(data)
                        now = time.monotonic()
                        if isinstance(reply, ChatDelta) and not reply.text:
                            if now - progress > limit:
                                raise NoProgress(f"no {what} within {limit:.0f}s")
                            continue  # a keepalive
                        progress, limit, what = now, cfg.idle_timeout, "new tokens"
                        yield reply
                        if not isinstance(reply, ChatDelta):
                            return
            except NoProgress:
                raise
            except ReplyTimeout:
                if attempt == cfg.resend_attempts:
                    raise ReplyTimeout(f"the trajectory manager went silent ({cfg.silence_timeout:.1f}s without "
                                       f"a reply, {cfg.resend_attempts} re-sends)") from None
            except BusUnavailable:
                if not attempt or attempt == cfg.resend_attempts:
                    raise  # nobody serves sf.chat at all: answer 503 now
                await asyncio.sleep(min(cfg.silence_timeout, 1.0))  # a replica restarting: try again

    async def cancel(self, request_id: str, reason: str) -> None:
        """Tell whoever serves `request_id` to stop it. Best effort: never raises."""
        self.metrics.cancels.labels(reason).inc()
        try:
            await self.nc.publish(subjects.CHAT_CANCEL, encode(ChatCancel(request_id=request_id)))
        except Exception as e:  # NATS down: the trajectory manager's own timeouts end the turn
            log.warning("could not publish ChatCancel for %s: %s", request_id, e)

    async def session(self, req: SessionRequest) -> SessionReply:
        """One session op. A replica that dies holding it never answers, so a timed-out op is sent
        again, at most `resend_attempts` times: get, reward and finish are idempotent; a repeated
        create may leave one unused session open, which admission stops counting after its
        timeout."""
        payload = wire(req)
        for attempt in range(self.cfg.resend_attempts + 1):
            try:
                data = await request(self.nc, subjects.session_op(req.op), payload, self.cfg.session_timeout)
                return decode(data, SessionReply)
            except ReplyTimeout:
                if attempt == self.cfg.resend_attempts:
                    raise
                log.warning("session %s %s: no reply for %.1fs, re-sending (%d/%d)", req.op, req.session_id or "(new)",
                            self.cfg.session_timeout, attempt + 1, self.cfg.resend_attempts)
        raise AssertionError("unreachable")

    # 3. rollout workers (admin) ----------------------------------------------------------------

    async def _on_worker_status(self, msg) -> None:
        status = self.malformed.decode(msg, WorkerStatus, subjects.ROLLOUT_STATUS)
        if status is None:  # a worker of another version, or not a worker at all
            return
        self.workers.update(status)
        now = time.time()
        self.board.worker(status, now)
        self.sample_counters(now)

    async def _on_trainer_status(self, msg) -> None:
        status = self.malformed.decode(msg, TrainerStatus, subjects.TRAINER_STATUS)
        if status is None:
            return
        self.board.trainer_status(status, time.time())

    def sample_counters(self, now: float) -> None:
        """Feed the status page's turns/s and tokens/s (called on heartbeats and page polls, at most
        once a second: reading a sample collects the whole registry)."""
        if self.board.turns.samples and now - self.board.turns.samples[-1][0] < 1.0:
            return
        self.board.counters(now, self.metrics.value("sf_gateway_turns_total"),
                            self.metrics.value("sf_gateway_tokens_total", {"type": "completion"}))

    def session_event(self, event: str, reward: float | None = None) -> None:
        """sessions.py reports created/finished sessions and rewards (metrics and the status page)."""
        if event:
            self.metrics.sessions.labels(event).inc()
        if reward is not None:
            self.metrics.rewards.observe(reward)
            self.board.reward(reward, time.time())

    async def read_stream_fill(self, timeout: float = 2.0) -> None:
        """Set the stream gauges from one reading of TRAJECTORIES and the trainer consumer (best effort:
        a failed reading leaves the last values and says so once per cause)."""
        try:
            fill = await asyncio.wait_for(backpressure.read_fill(
                self.nc.jetstream(), subjects.TRAJECTORIES_STREAM, subjects.TRAINER_DURABLE, time.monotonic()),
                timeout)
        except Exception as e:
            _warn(f"fill:{type(e).__name__}", "cannot read the %s stream for /metrics: %s",
                  subjects.TRAJECTORIES_STREAM, e)
            return
        self.metrics.stream_fill(fill)

    def worker_table(self) -> list[WorkerStatus]:
        """Workers heard from within `worker_stale_after`, by id."""
        return self.workers.fresh(time.time())

    async def scheduler_status(self, timeout: float = 5.0) -> SchedulerReply:
        """The tag scheduler's hosts; raises NoResponders if no scheduler runs."""
        data = await request(self.nc, subjects.SCHED_CTL, encode(SchedulerControl(op="status")), timeout)
        return decode(data, SchedulerReply)

    async def scheduler_timeline(self, timeout: float = 2.0) -> SchedulerReply | None:
        """The hosts with their activity intervals, or None when no scheduler answers (plain workers)."""
        try:
            data = await request(self.nc, subjects.SCHED_CTL, encode(SchedulerControl(op="timeline")), timeout)
            return decode(data, SchedulerReply)
        except (BusUnavailable, ReplyTimeout, msgspec.DecodeError):
            return None

    async def control_worker(self, worker_id: str, op: str, timeout: float = 30.0) -> WorkerStatus:
        """vacate / resume one worker; raises NoResponders if no such worker listens."""
        data = await request(self.nc, subjects.rollout_ctl(worker_id), encode(RolloutControl(op=op)), timeout)
        status = decode(data, WorkerStatus)
        self.workers.update(status)
        return status
