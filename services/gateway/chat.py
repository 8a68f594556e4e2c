"""/v1/chat/completions and /v1/completions: one turn, forwarded to the trajectory manager.

    1. authenticate (a session key attributes the turn to its session); the tenant's rate limit
    2. read the body within the size limit, decode, validate -> ChatRequest; the turn's size limits,
       then a place among the tenant's turns in flight (limits.py), held until the turn ends
    3. send it on sf.chat and wait for the first reply, watching for the client to go away
    4. non-streaming: collect up to ChatDone -> one JSON response
       streaming: the first reply decides the HTTP status (an early ChatFailed is a plain
       HTTP error); after that, SSE chunks until ChatDone, or an error event on failure
    5. whenever the agent disconnects before the end: publish ChatCancel(request_id)

The gateway keeps no turn state beyond the open connection: partial rollout, retries
across workers and weight-version changes all happen behind sf.chat. `Turn`, `collect` and
`stream` serve /v1/responses too (responses.py), with its own event format.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from services.gateway import limits
from services.gateway import openai_format as fmt
from services.gateway import translate
from services.gateway.edge import JSON, ClientGone, authenticate, read_body, unless_disconnected
from services.gateway.errors import RETRY_SOON, ApiError, StoreUnavailable, from_exception
from services.gateway.limits import Permit
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, decode
from services.gateway.service import Gateway
from services.gateway.store import KeyRecord
from shared.bus import BusUnavailable, ReplyTimeout
from shared.logonce import OncePerCause
from shared.messages.chat import ChatDelta, ChatDone, ChatFailed, ChatReply, ChatRequest

log = logging.getLogger(__name__)
_warn = OncePerCause(log)

Reason = Literal["disconnect", "timeout", "shutdown", "error"]  # why a turn was cancelled upstream
Kind = Literal["chat", "completion", "response"]  # the API a turn came in by (a metrics label)
_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-", "response": "resp_"}
OnDone = Callable[[ChatDone], Awaitable[None]]


class EventFormat(Protocol):
    """What a stream needs of its wire format: fmt.ChunkStream (chat, completions) and
    responses_format.EventStream (responses)."""

    def start(self) -> bytes: ...
    def delta(self, text: str, offset: int | None = None) -> bytes: ...
    def done(self, done: ChatDone) -> list[bytes]: ...
    def error(self, body: dict) -> bytes: ...


def failed(reply: ChatFailed) -> ApiError:
    status = reply.status if 400 <= reply.status <= 599 else 502  # never answer a failure with 2xx
    # every 503 (redis_unavailable, overloaded, no worker serving) is retryable: say when
    return ApiError(status, reply.message, reply.code or None, headers=RETRY_SOON if status == 503 else None)


class Turn:
    """One request's bookkeeping: ids, timing, the first-token metric and its place among its
    tenant's turns in flight (`release`d once it ends, however it ends)."""

    def __init__(self, gw: Gateway, kind: Kind, chat: ChatRequest, permit: Permit | None = None) -> None:
        self.gw = gw
        self.kind = kind
        self.chat = chat
        self.start = time.perf_counter()
        self.created = int(time.time())
        self.id = _ID_PREFIX[kind] + chat.request_id
        self._first = False
        self.permit = permit

    @classmethod
    def admit(cls, gw: Gateway, kind: Kind, chat: ChatRequest, key: KeyRecord) -> "Turn":
        """A turn within the limits (limits.py): its size (400), then a place among the tenant's
        turns in flight (429). The prompt-token limit rides on the request, to the tokenizer."""
        limits.check_turn(chat, gw.turn_limits, kind)
        chat.max_prompt_tokens = gw.cfg.max_prompt_tokens
        return cls(gw, kind, chat, gw.limiter.acquire(key.owner, time.monotonic(), key.limits))

    def release(self) -> None:
        if self.permit is not None:
            self.permit.release()

    def saw(self, reply: ChatReply) -> None:
        if not self._first and (isinstance(reply, ChatDone) or (isinstance(reply, ChatDelta) and reply.text)):
            self._first = True
            m = self.gw.metrics
            m.child(m.ttft, self.kind).observe(time.perf_counter() - self.start)
        if isinstance(reply, ChatDone):
            m = self.gw.metrics
            m.child(m.tokens, "prompt").inc(reply.usage.prompt_tokens)
            m.child(m.tokens, "completion").inc(reply.usage.completion_tokens)

    async def cancel(self, reason: Reason = "disconnect") -> None:
        log.info("cancelling %s (%s)", self.chat.request_id, reason)
        await self.gw.cancel(self.chat.request_id, reason)


async def chat_completions(request: Request) -> Response:
    return await _serve(request, "chat")


async def completions(request: Request) -> Response:
    return await _serve(request, "completion")


async def _serve(request: Request, kind: Literal["chat", "completion"]) -> Response:
    gw: Gateway = request.app.state.gateway
    cfg = gw.cfg
    # 1.-2.
    key = await authenticate(request, gw.keys, gw.limiter)
    body = await read_body(request, cfg.max_body_bytes)
    request_id = uuid.uuid4().hex
    if kind == "chat":
        req = decode(body, ChatCompletionRequest)
        chat = translate.chat_request(req, request_id, key.session_id, cfg)
    else:
        req = decode(body, CompletionRequest)
        chat = translate.completion_request(req, request_id, key.session_id, cfg)
    turn = Turn.admit(gw, kind, chat, key)
    headers = {"x-request-id": request_id}
    claim = claimer(gw, key)
    try:
        if req.stream:
            chunks = fmt.ChunkStream(kind, turn.id, turn.created, chat.model, translate.wants_usage(req),
                                     chat.session_id)
            return await stream(request, turn, chunks, headers, on_done=claim)
        done = await collect(request, turn)
        if claim is not None:
            await claim(done)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; uvicorn drops it
    except BaseException:
        turn.release()  # collect and stream release it themselves; this covers what runs before them
        raise
    build = fmt.chat_completion if kind == "chat" else fmt.text_completion
    return JSON(build(turn.id, turn.created, chat.model, done, chat.session_id), headers=headers)


def claimer(gw: Gateway, key: KeyRecord) -> OnDone | None:
    """A user key's turn runs in a one-off session the trajectory manager creates: record it as the
    tenant's, so that this user key (and no other) may read it. A session key's session has its owner."""
    if key.kind != "user":
        return None

    async def claim(done: ChatDone) -> None:
        if not done.session_id:
            return
        try:
            await gw.keys.claim_session(done.session_id, key.owner)
        except StoreUnavailable as e:  # static keys work without Redis: the turn stands, unclaimed
            _warn("claim", "one-off session %s left unclaimed (only operators can read it): %s", done.session_id, e)
    return claim


async def collect(request: Request, turn: Turn) -> ChatDone:
    """A non-streamed turn: its ChatDone, or the ApiError its ChatFailed maps to."""
    async def wait() -> ChatDone:
        async with contextlib.aclosing(turn.gw.chat(turn.chat)) as replies:
            async for reply in replies:
                turn.saw(reply)
                match reply:
                    case ChatDone():
                        return reply
                    case ChatFailed():
                        raise failed(reply)
        raise ApiError(502, "the trajectory manager ended the turn without an answer", "upstream_error")

    # 3.-5. A timeout cancels too: the turn may still be running behind a stalled reply.
    try:
        return await unless_disconnected(request, wait(), turn.cancel)
    except ReplyTimeout:
        await turn.cancel("timeout")
        raise
    finally:
        turn.release()


async def stream(request: Request, turn: Turn, chunks: EventFormat, headers: dict[str, str],
                 on_done: OnDone | None = None) -> Response:
    """A streamed turn as SSE in `chunks`' format; `on_done` runs before the last events go out."""
    live = _Live(turn)
    try:
        replies = await live.stack.enter_async_context(contextlib.aclosing(turn.gw.chat(turn.chat)))
        first = await unless_disconnected(request, anext(replies), turn.cancel)
    except BaseException as e:
        live.finished = isinstance(e, (ClientGone, ApiError, BusUnavailable, StopAsyncIteration))
        await live.close("timeout" if isinstance(e, ReplyTimeout) else
                         "shutdown" if isinstance(e, asyncio.CancelledError) else "error")
        if isinstance(e, StopAsyncIteration):
            raise ApiError(502, "the trajectory manager ended the turn without an answer", "upstream_error")
        raise
    turn.saw(first)
    if isinstance(first, ChatFailed):
        live.finished = True
        await live.close()
        raise failed(first)
    return _SSE(_events(live, chunks, first, replies, on_done), live, headers)


class _Live:
    """An open streamed turn: closed exactly once, cancelling it upstream unless it finished."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.stack = contextlib.AsyncExitStack()
        self.finished = False
        self._closed = False

    async def close(self, reason: Reason = "disconnect") -> None:
        if self._closed:
            return
        self._closed = True
        # Also runs inside a cancelled scope (the client went away): shield the clean-up.
        with anyio.CancelScope(shield=True):
            try:
                if not self.finished:
                    await self.turn.cancel(reason)
                await self.stack.aclose()
            finally:
                self.turn.release()


async def _events(live: _Live, chunks: EventFormat, first: ChatReply, replies: AsyncIterator[ChatReply],
                  on_done: OnDone | None) -> AsyncIterator[bytes]:
    reason: Reason = "disconnect"
    try:
        if start := chunks.start():
            yield start
        reply = first
        while True:
            match reply:
                case ChatDelta():
                    if event := chunks.delta(reply.text, reply.offset):
                        yield event
                case ChatDone():
                    live.finished = True
                    if on_done is not None:
                        await on_done(reply)
                    for event in chunks.done(reply):
                        yield event
                    return
                case ChatFailed():
                    live.finished = True
                    yield chunks.error(failed(reply).body())
                    return
            reply = await anext(replies)
            live.turn.saw(reply)
    except Exception as e:  # a timeout or a lost bus mid-stream: tell the agent, then stop
        reason = "timeout"
        yield chunks.error(from_exception(e).body())
    finally:
        await live.close(reason)


class _SSE(StreamingResponse):
    """Server-sent events whose turn is closed however the response ends, even if the
    client left before the first event was pulled from the generator."""

    def __init__(self, events: AsyncIterator[bytes], live: _Live, headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        self.live = live

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.live.close()
