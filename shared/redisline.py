"""One pipelined Redis connection for a service's hot scripts: a command is a write and a future.

    line = RedisLine.from_url("redis://:secret@redis:6379/0", timeout=5.0)   # None: use redis-py
    script = line.script("return redis.call('GET', KEYS[1])")
    value = await script(keys=["k"], args=[])

redis-py's asyncio client spends ~80 µs of CPU on a script call (pool, retry wrapper, per-read
timeout, response callbacks) where the write and the read themselves cost ~40 µs (BENCHMARKS.md).
Every turn makes two script calls (the trajectory manager's lookup and save), so they go
here: commands are written at once on one connection, in the order they are called, and Redis
answers in that order, so a reply is the oldest waiting future's (hiredis parses it in C). Many
turns in flight share the connection, pipelined, with no pool to wait in.

The contract is redis-py's, so callers catch what they caught before: a Redis error reply is a
`ResponseError`, a connection that cannot be made or is lost is a `ConnectionError`, and a reply
that takes longer than `timeout` is a `TimeoutError` (the command may have run, as with redis-py;
the connection is then closed, since the replies behind it could no longer be told apart). A
command is tried again once, on a new connection, only if it was never written (the connection was
found closed first): one that was written may have run. A script Redis does not know (a restarted
Redis) is loaded and run again. The connection is made on first use and again after a loss, one
attempt at a time, each bounded by `connect_timeout`.

`from_url` returns None for what this does not speak (a `rediss://` URL without SF_REDIS_TLS_* files,
or hiredis missing): callers then use redis-py, which does. Given `tls` (Connections.redis_tls), the
line is TLS, verified as redis-py's connections are (shared/tls.py).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio.connection import parse_url
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import redissentinel
from shared.config import TlsFiles
from shared.tls import client_context

try:
    import hiredis
except ImportError:
    hiredis = None

WATCH_INTERVAL = 0.25  # seconds between checks of the oldest unanswered command's age


class _Wire(asyncio.Protocol):
    """The socket: writes commands, hands each reply to the oldest waiting future."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiting: collections.deque[tuple[asyncio.Future, float]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # a peer gone without a word (a dropped route, a dead host) is found while idle too: after
            # ~25 s, instead of at the next command's timeout (redis-py pings before using a connection
            # idle for 10 s; this costs no round trip)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
                if hasattr(socket, option):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            if not self.waiting:  # a reply nobody asked for: the stream is out of step
                self.fail(RedisConnectionError("Redis sent a reply nobody was waiting for"))
                return
            future, _ = self.waiting.popleft()
            if not future.done():  # a cancelled caller's reply is read and dropped: the order holds
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"Redis closed the connection{f': {exc}' if exc else ''}"))

    def send(self, command: bytes) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((future, time.monotonic()))
        self.transport.write(command)  # type: ignore[union-attr]
        return future

    @property
    def open(self) -> bool:
        return self.lost is None and self.transport is not None and not self.transport.is_closing()

    def fail(self, error: Exception) -> None:
        """Close the connection, and fail every command still waiting on it."""
        if self.lost is None:
            self.lost = error
        if self.transport is not None:
            self.transport.close()
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(type(error)(*error.args))  # one each: tracebacks are per raise


class LineScript:
    """A Lua script run by its digest (EVALSHA), loaded again if Redis forgot it."""

    def __init__(self, line: "RedisLine", body: str) -> None:
        self.line, self.body = line, body
        self.sha = hashlib.sha1(body.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        try:
            return await self.line.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.line.execute("SCRIPT", "LOAD", self.body)
            return await self.line.execute("EVALSHA", self.sha, len(keys), *keys, *args)


class RedisLine:
    def __init__(self, url: str, timeout: float = 5.0, connect_timeout: float = 3.0,
                 tls: TlsFiles | None = None) -> None:
        """A line to the Redis `url` names (redis:// or unix://; `from_url` says which it speaks)."""
        if hiredis is None:
            raise RuntimeError("RedisLine needs hiredis")
        self._ssl: ssl.SSLContext | None = client_context(tls) if tls is not None else None
        self._resolve = None  # with Sentinel: asks the sentinels for the primary at each connect
        if redissentinel.is_sentinel(url):
            target = redissentinel.parse(url)
            self._resolve = redissentinel.master_resolver(url, connect_timeout, tls)
            self.host, self.port, self.path, self.db = "", 0, "", target.db
            self.username, self.password = target.username, target.password
        else:
            opts = parse_url(url)
            self.host, self.port = opts.get("host", "localhost"), int(opts.get("port", 6379))
            self.path, self.db = opts.get("path", ""), int(opts.get("db", 0))
            self.username, self.password = opts.get("username"), opts.get("password")
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._wire: _Wire | None = None
        self._connecting: asyncio.Lock | None = None
        self._watch: asyncio.Task | None = None
        self._closed = False

    @classmethod
    def from_url(cls, url: str, timeout: float = 5.0, connect_timeout: float = 3.0,
                 tls: TlsFiles | None = None) -> "RedisLine | None":
        """A line to the Redis `url` names (redis://, unix:// or redis+sentinel://; rediss:// with `tls`),
        or None where redis-py must serve it."""
        schemes = ("redis://", "unix://", redissentinel.SCHEME) + (("rediss://",) if tls is not None else ())
        if hiredis is None or not url.startswith(schemes):
            return None
        return cls(url, timeout, connect_timeout, tls)

    def script(self, body: str) -> LineScript:
        return LineScript(self, body)

    async def execute(self, *args: Any) -> Any:
        """One command's reply; raises redis-py's exceptions (module docstring)."""
        for attempt in (1, 2):
            wire = self._wire if self._wire is not None and self._wire.open else await self._connect()
            if not wire.open:  # lost between its connect and this write: nothing was sent
                if attempt == 2:
                    raise wire.lost or RedisConnectionError("Redis connection closed")
                continue
            future = wire.send(hiredis.pack_command(args))
            if self._watch is None or self._watch.done():
                self._watch = asyncio.create_task(self._watch_replies())
            reply = await future
            if isinstance(reply, hiredis.ReplyError):
                if str(reply).startswith("READONLY"):  # a former primary, now a replica: find the new one
                    wire.fail(RedisConnectionError("the Redis primary became a replica (failover)"))
                    raise RedisConnectionError(f"the Redis primary at {self._where()} became a replica: {reply}")
                raise _error(str(reply))
            return reply
        raise AssertionError("unreachable")

    async def close(self) -> None:
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        if self._wire is not None:
            self._wire.fail(RedisConnectionError("the Redis line was closed"))

    async def _connect(self) -> _Wire:
        if self._closed:
            raise RedisConnectionError("the Redis line was closed")
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # one attempt at a time; the callers behind it share its result
            if self._wire is not None and self._wire.open:
                return self._wire
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(self.connect_timeout):
                    if self._resolve is not None:
                        self.host, self.port = await self._resolve()
                    if self.path:
                        _, wire = await loop.create_unix_connection(_Wire, self.path)
                    else:
                        _, wire = await loop.create_connection(_Wire, self.host, self.port, ssl=self._ssl)
                    await self._hello(wire)
            except TimeoutError:
                raise RedisConnectionError(f"Timeout connecting to Redis at {self._where()} "
                                           f"({self.connect_timeout:g} s)") from None
            except OSError as e:
                raise RedisConnectionError(f"Error connecting to Redis at {self._where()}: {e}") from None
            self._wire = wire
            return wire

    async def _hello(self, wire: _Wire) -> None:
        """Authenticate and select the database, as redis-py does on a new connection."""
        setup = []
        if self.password:
            setup.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.db:
            setup.append(("SELECT", self.db))
        for command in setup:
            reply = await wire.send(hiredis.pack_command(command))
            if isinstance(reply, hiredis.ReplyError):
                wire.fail(RedisConnectionError(f"{command[0]} failed: {reply}"))
                raise AuthenticationError(str(reply)) if command[0] == "AUTH" else _error(str(reply))

    async def _watch_replies(self) -> None:
        """While commands are sent: fail the connection whose oldest command has waited past `timeout`
        (Redis answers in order, so the oldest is the only one to watch). One timer for every command,
        not one each; it ends after a check that finds nothing waiting, and the next command starts it."""
        while not self._closed:
            await asyncio.sleep(WATCH_INTERVAL)
            wire = self._wire
            if wire is None or not wire.waiting:
                return
            if time.monotonic() - wire.waiting[0][1] > self.timeout:
                wire.fail(RedisTimeoutError(f"Timeout reading from Redis at {self._where()} "
                                            f"(no reply in {self.timeout:g} s)"))

    def _where(self) -> str:
        return self.path or f"{self.host}:{self.port}"


def _error(message: str) -> ResponseError:
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    return ResponseError(message)
