"""Per-request helpers at the HTTP edge: body limits, bearer auth, JSON responses, disconnects."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from services.gateway.errors import ApiError
from services.gateway.limits import Limiter
from services.gateway.store import KeyRecord, KeyStore

T = TypeVar("T")

_json = msgspec.json.Encoder()


class JSON(Response):
    """A JSON response encoded by msgspec (fast, and it knows Structs)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json.encode(content)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `limit` (by header or by bytes read)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ApiError(400, "invalid Content-Length header", "invalid_request")
        if int(length) > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body", "client_disconnected") from None
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", "request_too_large")


def bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise ApiError(401, "You didn't provide an API key: send it as 'Authorization: Bearer <key>'.",
                       "invalid_api_key")
    return key


async def authenticate(request: Request, keys: KeyStore, limiter: Limiter) -> KeyRecord:
    """The caller's key record (user or session key), or 401; then one request of its tenant's
    rate, its own or the gateway's (429 past it). Redis down -> StoreUnavailable (503)."""
    record = await keys.lookup(bearer(request))
    if record is None:
        raise ApiError(401, "Incorrect API key provided.", "invalid_api_key")
    limiter.check_rate(record.owner, time.monotonic(), record.limits)
    return record


def same_secret(given: str, expected: str) -> bool:
    """Constant time, length included: the SHA-256 digests are compared, with hmac.compare_digest.
    (API keys are never compared at all: they are found by their hash, store.py.)"""
    return bool(expected) and hmac.compare_digest(hashlib.sha256(given.encode()).digest(),
                                                  hashlib.sha256(expected.encode()).digest())


class ClientGone(Exception):
    """The HTTP client disconnected while the gateway waited on its behalf."""


async def _disconnected(request: Request) -> None:
    # After the body is read, the next ASGI receive() returns only when the client goes away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T],
                              on_gone: Callable[[], Awaitable[None]]) -> T:
    """Await `work`; if the client disconnects first, cancel it, await `on_gone()` and raise ClientGone.

    `work` runs in this task; a watcher task cancels this one if the client goes first. (Every turn
    comes here: one task instead of two and an asyncio.wait.)"""
    me = asyncio.current_task()
    assert me is not None
    state = {"active": True, "gone": False}

    def on_watch_done(watch: asyncio.Task) -> None:
        if watch.cancelled():  # ours, at the end
            return
        watch.exception()  # retrieved: a receive() that failed counts as the client gone, as a disconnect does
        if state["active"]:
            state["gone"] = True
            me.cancel()

    watch = asyncio.ensure_future(_disconnected(request))
    watch.add_done_callback(on_watch_done)
    try:
        result = await work
    except asyncio.CancelledError:
        # cancelled by the watcher alone: the client left; by anyone else too (shutdown): cancelled
        if not state["gone"] or me.uncancel() > 0:
            raise
    else:
        if state["gone"]:  # the watcher's cancel came too late to stop `work`: it is spent here
            me.uncancel()
        return result
    finally:
        state["active"] = False
        watch.cancel()
    await on_gone()
    raise ClientGone
