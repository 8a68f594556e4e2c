"""Agents for the fault suite: `n` openai-SDK agents in flight, each running sessions of a few
turns one after another, on a thread of their own while the test injects a fault.

Unlike seamlessflow/demo/workload.py (load that looks like RL), these record every call they make,
with its outcome, for the invariant checker: when it started and ended, the HTTP status and
the error body of a failure, and the request id, text and token count of a success. Like a
real agent, they retry a failure that says it is retryable (429, 502-504, or no connection)
a few times with a growing pause; a session with a turn that still fails is abandoned (never
finished), and a finish is retried until it answers 200.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai

MODEL = "seamlessflow-tiny"
RETRYABLE = {429, 502, 503, 504}
# what an error event inside a stream (the stream itself answered 200) may say to mean "retry"
RETRYABLE_CODES = {"upstream_timeout", "upstream_error", "trajectory_unavailable", "nats_unavailable",
                   "redis_unavailable", "overloaded"}


@dataclass
class Call:
    op: str  # create | chat | finish
    session: str
    t0: float  # wall clock
    t1: float = 0.0
    ok: bool = False
    status: int = 0  # HTTP status; 0 = no response (a refused or dropped connection, a client timeout)
    body: object = None  # the error response's JSON body (OpenAI shape: {"error": {...}})
    exc: str = ""  # the exception's type and message
    unreachable: bool = False  # no response: the connection was refused or dropped (not a client timeout)
    request_id: str = ""  # chat: the gateway's request id (the turn's request_id)
    content: str = ""  # chat: the reply text the agent got
    tokens: int = 0  # chat: usage.completion_tokens
    stream: bool = False

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0

    @property
    def error(self) -> dict | None:
        """The OpenAI-shaped error object of a failure, if it had one."""
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err if isinstance(err, dict) else None

    def retryable(self) -> bool:
        if self.status:
            return self.status in RETRYABLE
        if self.error is not None:  # an error event mid-stream
            return self.error.get("code") in RETRYABLE_CODES
        return self.unreachable  # nothing listens (the gateway is down)


@dataclass
class Session:
    id: str
    key: str
    turns: list[Call] = field(default_factory=list)  # successful chats, in order
    finished: bool = False


class FaultAgents:
    def __init__(self, base_url: str, user_key: str, agents: int = 16, turns: int = 2,
                 tokens: tuple[int, int] = (8, 24), seed: int = 0, timeout: float = 60.0, retries: int = 6,
                 think: float = 0.2):
        self.base_url, self.user_key, self.n, self.turns, self.tokens = base_url, user_key, agents, turns, tokens
        self.rng = random.Random(seed)
        self.seed = seed
        self.timeout, self.retries = timeout, retries
        self.think = think  # seconds an agent "thinks" between its calls: load like agents', not a flood
        self.calls: list[Call] = []
        self.sessions: list[Session] = []
        self.crash: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="fault-agents")

    # -- control from the test's thread ------------------------------------------------------------

    def start(self) -> "FaultAgents":
        self._thread.start()
        return self

    def stop(self, timeout: float = 90.0) -> "FaultAgents":
        """No new sessions; wait for the ones in flight to end."""
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"agents still running {timeout:.0f}s after stop: a call hangs"
        assert self.crash is None, f"an agent crashed: {self.crash!r}"
        return self

    def succeeded(self, op: str = "chat") -> int:
        return sum(c.ok for c in list(self.calls) if c.op == op)

    @property
    def finished(self) -> list[Session]:
        return [s for s in self.sessions if s.finished]

    # -- the agents --------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:
            self.crash = e

    async def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.user_key}"}
        limits = httpx.Limits(max_connections=2 * self.n)
        async with httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=self.timeout,
                                     limits=limits) as http:
            await asyncio.gather(*(self._lane(http, i) for i in range(self.n)))

    async def _lane(self, http: httpx.AsyncClient, lane: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            if not await self._session(http, lane, n):
                await asyncio.sleep(0.5)  # abandoned: as an agent would, wait a little before the next

    async def _session(self, http: httpx.AsyncClient, lane: int, n: int) -> bool:
        """One session; whether it finished."""
        r = await self._http("create", "", lambda: http.post("/sessions", json={"group_id": f"f{self.seed}-{lane}-{n}"}))
        if r is None:
            return False
        s = Session(r["id"], r["api_key"])
        self.sessions.append(s)
        stream = lane % 2 == 1  # half the agents stream
        async with openai.AsyncOpenAI(base_url=self.base_url, api_key=s.key, timeout=self.timeout,
                                      max_retries=0) as client:
            messages = [{"role": "user", "content": f"count {self.rng.randint(0, 999)}"}]
            for _ in range(self.turns):
                call = await self._chat(client, s, messages, self.rng.randint(*self.tokens), stream)
                if call is None:
                    return False  # abandoned: never finished
                s.turns.append(call)
                await asyncio.sleep(self.think)
                messages += [{"role": "assistant", "content": call.content}, {"role": "user", "content": "again"}]
        reward = self.rng.random()
        if await self._http("finish", s.id, lambda: http.post(f"/sessions/{s.id}/finish", json={"reward": reward}),
                            attempts=30) is not None:
            s.finished = True
        return s.finished

    async def _chat(self, client: openai.AsyncOpenAI, s: Session, messages: list[dict], max_tokens: int,
                    stream: bool) -> Call | None:
        for attempt in range(self.retries + 1):
            call = Call("chat", s.id, time.time(), stream=stream)
            self.calls.append(call)
            try:
                if stream:
                    parts = []
                    async with await client.chat.completions.create(
                            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=1.0, stream=True,
                            stream_options={"include_usage": True}) as chunks:
                        async for chunk in chunks:
                            call.request_id = chunk.id.removeprefix("chatcmpl-")
                            if chunk.choices and chunk.choices[0].delta.content:
                                parts.append(chunk.choices[0].delta.content)
                            if chunk.usage:
                                call.tokens = chunk.usage.completion_tokens
                    call.content = "".join(parts)
                else:
                    c = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                             temperature=1.0)
                    call.request_id = c.id.removeprefix("chatcmpl-")
                    call.content = c.choices[0].message.content or ""
                    call.tokens = c.usage.completion_tokens if c.usage else 0
                call.ok = True
            except openai.APIStatusError as e:
                call.status = e.status_code
                call.body = _json(e.response)
                call.exc = f"{type(e).__name__}: {e}"
            except openai.APIError as e:  # no response, or an error event inside a stream
                call.exc = f"{type(e).__name__}: {e}"
                call.unreachable = isinstance(e, openai.APIConnectionError) and not isinstance(e, openai.APITimeoutError)
                if e.body is not None:  # an SSE error event: {"error": {...}} in the stream
                    call.body = {"error": e.body}
            call.t1 = time.time()
            if call.ok:
                return call
            if not call.retryable():
                return None
            await asyncio.sleep(_backoff(attempt))
        return None

    async def _http(self, op: str, sid: str, send, attempts: int = 0) -> dict | None:
        for attempt in range((attempts or self.retries) + 1):
            call = Call(op, sid, time.time())
            self.calls.append(call)
            try:
                r = await send()
                call.status = r.status_code
                if r.status_code == 200:
                    call.ok = True
                else:
                    call.body = _json(r)
            except httpx.HTTPError as e:
                call.exc = f"{type(e).__name__}: {e}"
                call.unreachable = isinstance(e, (httpx.ConnectError, httpx.ReadError, httpx.WriteError,
                                                  httpx.RemoteProtocolError))
            call.t1 = time.time()
            if call.ok:
                return r.json()
            if not call.retryable():
                return None
            await asyncio.sleep(_backoff(attempt))
        return None


def _backoff(attempt: int) -> float:
    """Seconds before retry `attempt` + 1: 0.25 doubling to 2 (about 8 s over 6 retries)."""
    return min(0.25 * 2 ** attempt, 2.0)


def _json(r: httpx.Response) -> object:
    try:
        return r.json()
    except ValueError:
        return r.text[:300]

