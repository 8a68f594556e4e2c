"""NATS helpers: connect, declare streams, de-duplicated durable publish, streamed request/reply.

Every wait here has a timeout. Callers own the connection (an AsyncExitStack in
each service's `service.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from dataclasses import replace
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import NoStreamResponseError, NotFoundError, ServiceUnavailableError

from shared.backpressure import backoff, is_stream_full
from shared.codec import encode
from shared.config import Connections
from shared.logonce import OncePerCause
from shared.tls import client_context

log = logging.getLogger(__name__)
_warn = OncePerCause(log)


class BusUnavailable(ConnectionError):
    """NATS could not be reached, or nobody serves the subject (NoResponders)."""


class NoResponders(BusUnavailable):
    """NATS is up, but nothing subscribes to the subject: the service behind it is not running."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"nobody serves {subject}")
        self.subject = subject


class ReplyTimeout(TimeoutError):
    pass


async def connect(conn: Connections, name: str, connect_timeout: float = 5.0) -> NATS:
    """Connect with unbounded reconnects (a broker restart must not need a service restart); over TLS
    when SF_NATS_TLS_CA is set (and a server that does not ask for TLS is then refused)."""
    opts: dict[str, Any] = dict(
        servers=conn.nats_servers,
        name=name,
        connect_timeout=connect_timeout,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        ping_interval=5,
        max_outstanding_pings=3,
    )
    if conn.nats_user:
        opts.update(user=conn.nats_user, password=conn.nats_password)
    if conn.nats_token:
        opts["token"] = conn.nats_token
    if conn.nats_creds:
        opts["user_credentials"] = conn.nats_creds
    if conn.nats_tls is not None:
        opts["tls"] = client_context(conn.nats_tls)

    async def _error(e: Exception) -> None:
        log.warning("nats: %s", e)

    opts["error_cb"] = _error
    try:
        nc = await nats.connect(**opts)
    except Exception as e:  # nats raises several unrelated types here
        raise BusUnavailable(f"cannot reach NATS at {conn.redacted()['nats_url']}: {e}") from e
    # nats-py upgrades to TLS only when the server's INFO asks for it, and would otherwise go on in
    # plain text; with TLS configured that is a misconfigured (or impersonated) server, not a fallback
    if "tls" in opts and not nc._server_info.get("tls_required"):
        await nc.close()
        raise BusUnavailable(f"NATS at {conn.redacted()['nats_url']} does not use TLS, but SF_NATS_TLS_CA is set")
    return nc


# the limits of a stream, and the `nats stream edit` flag that sets each; for all but max_age, -1 is
# "no limit" (max_age: 0); a larger value is the more generous one
STREAM_LIMITS = {"max_bytes": "--max-bytes", "max_msgs": "--max-msgs", "max_age": "--max-age",
                 "max_msgs_per_subject": "--max-msgs-per-subject", "max_msg_size": "--max-msg-size",
                 "max_consumers": "--max-consumers"}


def _unlimited(field: str, value: Any) -> bool:
    return value is None or value == (0 if field == "max_age" else -1) or (field != "max_age" and value < 0)


def _generous(field: str, a: Any, b: Any) -> Any:
    """The more generous of two settings of one limit (no limit beats any)."""
    if _unlimited(field, a):
        return a
    if _unlimited(field, b):
        return b
    return max(a, b)


def reconcile(existing: StreamConfig, wanted: StreamConfig) -> tuple[StreamConfig | None, list[str]]:
    """What start-up may do to a stream that exists: (the config to update it to, or None for no
    update; the differences it leaves for an operator). It raises a limit the configuration raises,
    but never lowers a limit nor changes the replica count: an operator may have set them (`nats
    stream edit`), and a service started with an older or smaller configuration must not undo that."""
    kept: dict[str, Any] = {"num_replicas": existing.num_replicas}
    left: list[str] = []
    if (wanted.num_replicas or 1) != (existing.num_replicas or 1):
        left.append(f"--replicas {wanted.num_replicas or 1}")
    for field, flag in STREAM_LIMITS.items():
        have, want = getattr(existing, field), getattr(wanted, field)
        kept[field] = _generous(field, have, want)
        if kept[field] != want and not (_unlimited(field, kept[field]) and _unlimited(field, want)):
            left.append(f"{flag} {int(want) if field != 'max_age' else f'{int(want or 0)}s'}")
    merged = replace(wanted, **kept)
    same = all(getattr(merged, f) == getattr(existing, f) for f in ("subjects", "retention", "storage", "discard",
                                                                    "duplicate_window", *STREAM_LIMITS))
    return (None if same else merged), left


ENSURE_RETRY_S = 60.0  # how long a service's start waits for JetStream to answer (ensure_streams)


async def ensure_streams(js: JetStreamContext, streams: Iterable[StreamConfig],
                         retry_for: float = ENSURE_RETRY_S) -> None:
    """Create each stream as configured; a stream that exists keeps its replicas and is never made
    smaller (see reconcile): a difference is logged with the command that applies it. Idempotent.

    A JetStream that does not answer yet (TRANSIENT: a cluster still electing its meta leader takes
    ~1.5 s after its servers listen, and the first request meanwhile gets no reply at all) is asked
    again with back-off until `retry_for` seconds have passed, then the last error is raised. Without
    this, a service that declared the streams within that time of the cluster's start (as one that
    waited for the servers to listen does, under compose or Kubernetes) failed its start on the 5 s
    timeout (found while building bench/ha_stack.py)."""
    streams = list(streams)  # read again on a retry (each stream's declaration is idempotent)
    deadline = time.monotonic() + retry_for
    for attempt in itertools.count(1):
        try:
            for cfg in streams:
                await _ensure_stream(js, cfg)
            return
        except TRANSIENT as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            wait = min(backoff(attempt - 1, RETRY_FIRST_S, RETRY_MAX_S, jitter=0.0), left)
            log.warning("declaring the streams, try %d: JetStream does not answer yet (%s: %s); again in %.1fs "
                        "(giving up in %.0fs)", attempt, type(e).__name__, e, wait, left)
            await asyncio.sleep(wait)


async def _ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    try:
        info = await js.stream_info(cfg.name)
    except NotFoundError:
        await js.add_stream(cfg)
        return
    update, left = reconcile(info.config, cfg)
    if left:
        _warn(f"stream:{cfg.name}:{' '.join(left)}",
              "stream %s differs from this configuration and is left as it is (start-up never lowers "
              "a stream's replicas or limits); to apply it: nats stream edit %s %s",
              cfg.name, cfg.name, " ".join(left))
    if update is not None:
        await js.update_stream(update)


class StreamFull(RuntimeError):
    """The stream is at its limits and refuses new messages (DiscardPolicy.NEW): retry later."""


# what a publish meets while NATS restarts or JetStream recovers its streams: worth another try
# (NoStreamResponseError: the stream has no leader for a moment, as while a cluster elects a new one)
TRANSIENT = (NatsTimeout, nats.errors.NoRespondersError, nats.errors.ConnectionReconnectingError,
             nats.errors.OutboundBufferLimitError, ServiceUnavailableError, NoStreamResponseError)
RETRY_FIRST_S, RETRY_MAX_S = 0.2, 2.0  # back-off between tries: doubles from the first to the cap


async def publish_durable(
    js: JetStreamContext, subject: str, msg: Any, msg_id: str, timeout: float = 5.0, retry_for: float = 0.0
) -> None:
    """Publish to JetStream (a Struct, or bytes already encoded), de-duplicated by `msg_id` within the
    stream's window. Raises StreamFull when the stream refuses it for its limits.

    With `retry_for`, a try that met NATS down or timed out (TRANSIENT) is made again, with back-off,
    until `retry_for` seconds have passed; then the last error is raised. A try that did land before
    its acknowledgement was lost is a no-op the next time, by `msg_id`, while `retry_for` stays within
    the stream's duplicate window (120 s for ours)."""
    data = msg if isinstance(msg, bytes) else encode(msg)
    deadline = time.monotonic() + retry_for
    for attempt in itertools.count(1):
        try:
            await js.publish(subject, data, timeout=timeout, headers={"Nats-Msg-Id": msg_id})
            if attempt > 1:
                log.info("published %s (%s) on try %d", subject, msg_id, attempt)
            return
        except Exception as e:
            if is_stream_full(e):  # whatever its status code: the caller decides when to come back
                raise StreamFull(f"{subject}: {getattr(e, 'description', e)}") from None
            left = deadline - time.monotonic()
            if not isinstance(e, TRANSIENT) or left <= 0:
                raise
            wait = min(backoff(attempt - 1, RETRY_FIRST_S, RETRY_MAX_S, jitter=0.0), left)
            log.warning("publishing %s (%s), try %d: %s: %s; again in %.1fs (giving up in %.0fs)", subject,
                        msg_id, attempt, type(e).__name__, e, wait, left)
            await asyncio.sleep(wait)


async def last_value(js: JetStreamContext, stream: str, subject: str) -> bytes | None:
    """The newest message on `subject` (a last-value stream), or None if there is none."""
    try:
        raw = await js.get_last_msg(stream, subject)
    except NotFoundError:
        return None
    return raw.data


def _is_no_responders(msg: Msg) -> bool:
    return bool(msg.headers) and msg.headers.get("Status") == "503" and not msg.data


class Replies:
    """The replies to one streamed request, in order: `async for data in replies`.

    The first reply must come within `first_timeout`, each later one within
    `idle_timeout`; otherwise ReplyTimeout. With `receipt_timeout`, the responder sends a
    receipt first (shared/messages/rollout.py: Generate.receipt): it must come within
    `receipt_timeout`, and `first_timeout` counts from it. With `alive`, the wait is also cut short,
    within `ALIVE_POLL` seconds, once `alive()` says the responder is gone (say its
    heartbeat went stale): a dead worker is noticed by heartbeat age, not by the long
    token timeout. `ready()` returns the replies that have already arrived, without
    waiting, so a consumer that fell behind can take them in one go."""

    ALIVE_POLL = 0.5

    def __init__(self, subject: str, first_timeout: float, idle_timeout: float,
                 alive: Callable[[], bool] | None = None, receipt_timeout: float | None = None):
        self.subject = subject
        self.queue: asyncio.Queue[Msg] = asyncio.Queue()
        # (what is awaited, its timeout) for each reply in turn; the last one stands for every later reply
        self._waits = [("reply", idle_timeout), ("first reply", first_timeout)]
        if receipt_timeout is not None:
            self._waits.append(("receipt", receipt_timeout))
        self._alive = alive

    @property
    def _timeout(self) -> float:
        return self._waits[-1][1]

    def _data(self, msg: Msg) -> bytes:
        if _is_no_responders(msg):
            raise NoResponders(self.subject)
        if len(self._waits) > 1:
            self._waits.pop()
        return msg.data

    def __aiter__(self) -> Replies:
        return self

    async def __anext__(self) -> bytes:
        deadline = asyncio.get_running_loop().time() + self._timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                what, timeout = self._waits[-1]
                raise ReplyTimeout(f"no {what} on {self.subject} within {timeout:.1f}s")
            try:
                async with asyncio.timeout(min(left, self.ALIVE_POLL) if self._alive else left):
                    msg = await self.queue.get()
                return self._data(msg)
            except TimeoutError:
                if self._alive is not None and not self._alive():
                    raise ReplyTimeout(f"the responder on {self.subject} is gone (heartbeat stale, or "
                                       "NATS reconnected: replies may be lost)") from None

    def ready(self) -> list[bytes]:
        out = []
        while not self.queue.empty():
            out.append(self._data(self.queue.get_nowait()))
        return out


class _ReplyMux:
    """One wildcard inbox subscription per connection for every streamed request's replies
    (as nats.py's own `request` does): no SUB/UNSUB round of protocol messages per request."""

    def __init__(self, prefix: str):  # holds no reference to the connection: _MUXES is keyed weakly by it
        self.prefix = prefix
        self.routes: dict[str, Replies] = {}
        self.subscribed = False  # the Subscription itself is not kept: it references the connection
        self.lock = asyncio.Lock()
        self.next = 0

    async def ensure(self, nc: NATS) -> None:
        if not self.subscribed:
            async with self.lock:
                if not self.subscribed:
                    await nc.subscribe(self.prefix + ".*", cb=self._on_msg)
                    self.subscribed = True

    async def _on_msg(self, msg: Msg) -> None:
        replies = self.routes.get(msg.subject[len(self.prefix) + 1:])
        if replies is not None:  # else: a late reply to a request that already ended
            replies.queue.put_nowait(msg)

    def open(self, replies: Replies) -> str:
        self.next += 1
        token = str(self.next)
        self.routes[token] = replies
        return token


_MUXES: weakref.WeakKeyDictionary[NATS, _ReplyMux] = weakref.WeakKeyDictionary()


@asynccontextmanager
async def stream_request(
    nc: NATS, subject: str, payload: bytes, first_timeout: float, idle_timeout: float,
    alive: Callable[[], bool] | None = None, receipt_timeout: float | None = None,
) -> AsyncIterator[Replies]:
    """Send one request and iterate over its streamed replies (see Replies). The
    responder decides when the stream ends: the caller stops on its terminal message.
    `receipt_timeout`: the payload asks for a receipt, the first reply (see Replies).

    A reconnect to NATS while the stream runs ends it like a responder that is gone (within
    ALIVE_POLL): core NATS is at most once, and a broker restart drops what is in flight, so a
    reply may be missing (found by tests/faults: a lost GenerateDone held the turn for the
    60 s token timeout; a lost ChatDelta left a hole in the agent's stream)."""
    if not nc.is_connected:
        raise BusUnavailable("not connected to NATS")
    mux = _MUXES.get(nc)
    if mux is None:
        mux = _MUXES[nc] = _ReplyMux(nc.new_inbox())
    await mux.ensure(nc)
    stats = nc.stats  # the counters alone: a finished Replies must not keep the connection alive
    reconnects = stats["reconnects"]

    def whole() -> bool:
        return stats["reconnects"] == reconnects and (alive is None or alive())

    replies = Replies(subject, first_timeout, idle_timeout, whole, receipt_timeout)
    token = mux.open(replies)
    try:
        await nc.publish(subject, payload, reply=f"{mux.prefix}.{token}")
        yield replies
    finally:
        mux.routes.pop(token, None)


async def request(nc: NATS, subject: str, payload: bytes, timeout: float) -> bytes:
    """One request, one reply."""
    if not nc.is_connected:
        raise BusUnavailable("not connected to NATS")
    try:
        msg = await nc.request(subject, payload, timeout=timeout)
    except nats.errors.NoRespondersError:
        raise NoResponders(subject) from None
    except NatsTimeout:
        raise ReplyTimeout(f"no reply on {subject} within {timeout:.1f}s") from None
    return msg.data


async def wait_closed(nc: NATS, timeout: float = 5.0) -> None:
    """Drain then close, bounded. A drain that fails or times out may have dropped messages in
    flight: say so, then close anyway."""
    try:
        await asyncio.wait_for(nc.drain(), timeout)
    except Exception as e:
        _warn(f"drain:{type(e).__name__}", "NATS drain failed (%s: %s); closing without it",
              type(e).__name__, e)
        await nc.close()
