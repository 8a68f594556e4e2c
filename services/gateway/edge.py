"""Per-request helpers at the HTTP edge: body limits, bearer auth, JSON responses, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
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
    rate (429 past it). Redis down -> StoreUnavailable (503)."""
    record = await keys.lookup(bearer(request))
    if record is None:
        raise ApiError(401, "Incorrect API key provided.", "invalid_api_key")
    limiter.check_rate(record.owner, time.monotonic())
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
    """Await `work`; if the client disconnects first, cancel it, await `on_gone()` and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watch
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    await on_gone()
    raise ClientGone
