"""Malformed bus messages: counted, logged once per cause, and kept in the DEAD stream.

A message a service cannot read (bytes that do not decode, or a valid message of another type)
must not crash the service nor hold up its consumer. Every subscription decodes through its
service's `Malformed` (the subscription's pattern labels the metric):

    malformed = Malformed("trajectory", registry)     # once per service; `attach(nc)` after connect
    req = malformed.decode(msg, SessionRequest, subjects.session_op("*"))
    if req is None:                                   # it could not be read, and was handled as below
        return

1. `sf_bus_malformed_total{service, subject}` counts it, `subject` being the subscription's
   pattern (`sf.rollout.gen.*`), never a worker's own subject: the label set stays bounded;
2. the first one of each (subject, error type) is a warning, repeats are debug lines (OncePerCause);
3. a message that JetStream stored (one delivered by a consumer, or a core delivery of a stream's
   subject, say `sf.weights.published`) is copied to the DEAD stream as
   `sf.dead.<service>.<original subject>`, its headers naming the original subject, the service,
   the error (truncated) and the time. A consumer's delivery is then terminated, so it is never
   redelivered, but only once the copy is stored (PubAck); a copy that fails after
   `PUBLISH_TRIES` bounded tries naks the delivery with a delay instead (it comes back, within
   the consumer's max_deliver).

The copy runs in a task of its own (at most `MAX_IN_FLIGHT` at once; beyond that a message is
counted and logged but not copied), so a subscription callback or a fetch loop never waits on it.
A request's error reply is the caller's protocol: `decode(..., refuse=)` takes the function that
builds it from the error, and sends what it returns to the request's inbox (in a task too).

It knows nothing of the messages' types, nor of which service consumes what. `recent` and
`purge` serve `seamlessflow dead list | purge`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry, Counter

from shared.codec import decode, encode
from shared.logonce import OncePerCause
from shared.metrics import Endpoint
from shared.metrics import serve as serve_metrics

log = logging.getLogger(__name__)

T = TypeVar("T")

DEAD_STREAM = "DEAD"
DEAD_PREFIX = "sf.dead"  # + ".<service>.<original subject>"
METRIC = "sf_bus_malformed"  # prometheus-client adds _total

# headers of a dead letter
H_SUBJECT, H_SERVICE, H_ERROR, H_TIME, H_SEQ = "Sf-Dead-Subject", "Sf-Dead-Service", "Sf-Dead-Error", "Sf-Dead-Time", \
    "Sf-Dead-Stream-Seq"
MAX_ERROR = 300  # characters of the error kept: a decoder's message, never the payload's content
PUBLISH_TRIES = 3
PUBLISH_TIMEOUT = 2.0  # seconds each try waits for the PubAck
NAK_DELAY = 10.0  # seconds before a delivery whose copy failed comes back
MAX_IN_FLIGHT = 64  # copies under way at once (a flood of garbage while NATS is down stays bounded)


def dead_stream(max_bytes: int = 64 * 2**20, max_msgs: int = 10_000, max_age: float = 7 * 24 * 3600.0) -> StreamConfig:
    """The dead-letter stream: for an operator to read, so the oldest go first when it is full."""
    return StreamConfig(
        name=DEAD_STREAM, subjects=[f"{DEAD_PREFIX}.>"], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, max_bytes=max_bytes, max_msgs=max_msgs, max_age=max_age,
        discard=DiscardPolicy.OLD, duplicate_window=120.0)


def dead_subject(service: str, subject: str) -> str:
    return f"{DEAD_PREFIX}.{service}.{subject}"


def error_text(error: BaseException) -> str:
    """`Type: message`, on one line and truncated (a header's value cannot hold a newline)."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= MAX_ERROR else text[:MAX_ERROR - 3] + "..."


def is_delivery(msg: Msg) -> bool:
    """A JetStream consumer's delivery (it has an ack subject), as opposed to a core message."""
    return bool(msg.reply) and msg.reply.startswith("$JS.ACK.")


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` one or more at the end."""
    pt, st = pattern.split("."), subject.split(".")
    for i, p in enumerate(pt):
        if p == ">":
            return len(st) > i
        if i >= len(st) or (p != "*" and p != st[i]):
            return False
    return len(pt) == len(st)


def stored(subject: str, streams: Iterable[StreamConfig]) -> bool:
    """Whether one of `streams` keeps messages published on `subject` (DEAD itself excluded)."""
    return any(matches(p, subject) for s in streams if s.name != DEAD_STREAM for p in s.subjects or ())


def headers(service: str, msg: Msg, error: BaseException, now: float) -> dict[str, str]:
    out = {H_SUBJECT: msg.subject, H_SERVICE: service, H_ERROR: error_text(error), H_TIME: f"{now:.3f}"}
    seq = _stream_seq(msg)
    if seq is not None:
        out[H_SEQ] = str(seq)
    # de-duplicated within the stream's window: a redelivery, or a stream subject's core message
    # seen by every replica of a service, is stored once
    key = f"seq {seq}" if seq is not None else hashlib.sha256(msg.data or b"").hexdigest()[:32]
    out["Nats-Msg-Id"] = f"dead:{service}:{msg.subject}:{key}"
    return out


def _stream_seq(msg: Msg) -> int | None:
    if not is_delivery(msg):
        return None
    try:
        return msg.metadata.sequence.stream
    except Exception:  # an ack subject of a form this client does not know
        return None


def bus_counter(registry: CollectorRegistry) -> Counter:
    return Counter(METRIC, "Bus messages a service could not read (undecodable, or of another type)",
                   ["service", "subject"], registry=registry)


class Malformed:
    """One service's handling of the messages it cannot read (see the module docstring)."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None,
                 streams: Iterable[StreamConfig] = ()):
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry()
        self.counter = bus_counter(self.registry)
        self.streams = tuple(streams)
        self.js: JetStreamContext | None = None
        self.tasks: set[asyncio.Task] = set()
        self._warn = OncePerCause(log)

    def attach(self, nc: NATS, streams: Iterable[StreamConfig]) -> None:
        """Where dead letters go, and which subjects the streams keep (`subjects.STREAMS`)."""
        self.js = nc.jetstream()
        self.streams = tuple(streams)

    def decode(self, msg: Msg, tp: type[T], subject: str, *, check: Callable[[T], object] | None = None,
               refuse: Callable[[str], Any] | None = None) -> T | None:
        """`msg`'s data as a `tp`, or None once it is handled as malformed (`__call__`, with the
        subscription pattern `subject`): bytes that do not decode, a message of another type
        (ValidationError), or one `check` refuses by raising ValueError. For a request, `refuse`
        builds the protocol's error reply from the error's text; it goes to `msg.reply` in a task
        (a message without a reply inbox gets none). Never raises, never waits."""
        try:
            value = decode(msg.data, tp)
            if check is not None:
                check(value)
            return value
        except (msgspec.DecodeError, ValueError) as e:  # ValidationError is a DecodeError
            self(msg, subject, e)
            if refuse is not None and msg.reply:
                self._spawn(self._refuse(msg, refuse(str(e))))
            return None

    async def _refuse(self, msg: Msg, reply: Any) -> None:
        try:
            await msg.respond(encode(reply))
        except Exception as e:  # the connection is closing: the caller times out
            self._warn(f"refuse:{type(e).__name__}", "%s: answering a malformed request on %s failed: %s",
                       self.service, msg.subject, e)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def count(self, subject: str) -> float:
        return self.registry.get_sample_value(f"{METRIC}_total", {"service": self.service, "subject": subject}) or 0.0

    def __call__(self, msg: Msg, subject: str, error: BaseException) -> None:
        """Count and log `msg` (received on the subscription `subject`), and copy it to DEAD if a
        stream stored it. Never raises, never waits."""
        self.counter.labels(self.service, subject).inc()
        try:
            keep = is_delivery(msg) or stored(msg.subject, self.streams)
        except Exception:  # not a NATS message (a test's stand-in): count and log it all the same
            keep = False
        where = "dead-lettered" if keep and self.js is not None else "dropped"
        self._warn(f"{subject}:{type(error).__name__}", "%s: malformed message on %s (%d bytes) %s: %s",
                   self.service, getattr(msg, "subject", subject), len(getattr(msg, "data", b"") or b""), where,
                   error_text(error))
        if where == "dropped":
            return
        if len(self.tasks) >= MAX_IN_FLIGHT:
            self._warn("dead:busy", "%s: %d dead letters already under way; one on %s is not copied",
                       self.service, len(self.tasks), msg.subject)
            return
        self._spawn(self._dead_letter(msg, error, time.time()))

    async def _dead_letter(self, msg: Msg, error: BaseException, now: float) -> None:
        ok = await publish_dead(self.js, self.service, msg, error, now)
        if not is_delivery(msg):
            return
        try:  # a stored copy ends the delivery for good; else it comes back, to be copied again
            await (msg.term() if ok else msg.nak(delay=NAK_DELAY))
        except Exception as e:
            self._warn(f"settle:{type(e).__name__}", "%s: settling a malformed delivery on %s failed: %s",
                       self.service, msg.subject, e)

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the copies and refusals under way: on shutdown, before the connection closes."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)

    def enter(self, stack: AsyncExitStack, nc: NATS, streams: Iterable[StreamConfig], metrics_port: int,
              metrics_host: str) -> Endpoint:
        """A service's whole wiring, once connected: `attach`, `drain` on `stack`'s exit (before the
        connection closes, if the connection was entered first), and the counter served on
        `metrics_port` (0 = off) until then. Returns the endpoint (its `port` for the ready line)."""
        self.attach(nc, streams)
        stack.push_async_callback(self.drain)
        endpoint = serve_metrics(self.registry, metrics_port, metrics_host)
        stack.callback(endpoint.close)
        return endpoint


async def publish_dead(js: JetStreamContext, service: str, msg: Msg, error: BaseException, now: float,
                       tries: int = PUBLISH_TRIES, timeout: float = PUBLISH_TIMEOUT) -> bool:
    """Store a copy of `msg` in DEAD; True once the stream acknowledged it (bounded tries)."""
    hdrs = headers(service, msg, error, now)
    for attempt in range(1, tries + 1):
        try:
            await js.publish(dead_subject(service, msg.subject), msg.data or b"", timeout=timeout, headers=hdrs)
            return True
        except Exception as e:  # NATS reconnecting, no DEAD stream yet, a timeout
            log.warning("%s: dead letter for %s not stored (try %d of %d): %s: %s", service, msg.subject, attempt,
                        tries, type(e).__name__, e)
            if attempt < tries:
                await asyncio.sleep(0.2 * attempt)
    return False


# -- reading them back: `seamlessflow dead list | purge` -------------------------------------------

class DeadLetter(msgspec.Struct, frozen=True):
    seq: int
    time: float
    service: str
    subject: str
    error: str
    size: int


def _letter(raw) -> DeadLetter:
    h = raw.headers or {}
    try:
        at = float(h.get(H_TIME, ""))
    except ValueError:
        at = 0.0
    return DeadLetter(seq=raw.seq, time=at, service=h.get(H_SERVICE, "?"), subject=h.get(H_SUBJECT, raw.subject),
                      error=h.get(H_ERROR, ""), size=len(raw.data or b""))


async def recent(js: JetStreamContext, limit: int = 20, timeout: float = 5.0) -> list[DeadLetter]:
    """The newest `limit` dead letters, newest first; what `timeout` seconds allow. [] without a DEAD stream."""
    async with asyncio.timeout(timeout):
        try:
            info = await js.stream_info(DEAD_STREAM)
        except NotFoundError:
            return []
        out: list[DeadLetter] = []
        seq = info.state.last_seq
        while len(out) < limit and seq >= max(info.state.first_seq, 1):
            try:
                out.append(_letter(await js.get_msg(DEAD_STREAM, seq)))
            except NotFoundError:  # deleted one by one, or aged out meanwhile
                pass
            seq -= 1
        return out


async def purge(js: JetStreamContext, timeout: float = 5.0) -> int:
    """Delete every dead letter; returns how many there were."""
    async with asyncio.timeout(timeout):
        try:
            info = await js.stream_info(DEAD_STREAM)
        except NotFoundError:
            return 0
        await js.purge_stream(DEAD_STREAM)
        return int(info.state.messages)
