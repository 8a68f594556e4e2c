"""A Redis connection pool whose waiters are served first come, first served.

    pool = FairPool.from_url(url, max_connections=64, timeout=5.0, socket_timeout=5)
    client = redis.asyncio.Redis.from_pool(pool)

redis-py's BlockingConnectionPool makes a command wait (up to `timeout`) while all `max_connections`
are in use, but not in order: a released connection goes to whichever task takes the pool's lock
first, often a newcomer, and a waiter that lost the race waits again at the back of the line. Under
load its waits have a long tail: 1,000 tasks on 64 connections waited 0.12 s at the median and up
to 2.3 s, against 0.15 s and 0.24 s here (the same load, FIFO). With 500 agents on a CPU-starved
trajectory replica that tail passed the 5 s wait, and the commands failed ("No connection
available", a 503) though the line was short (bench/load.py, BENCHMARKS.md).

Here a command first takes a place in a FIFO line (an asyncio.Semaphore of `max_connections`: it
hands a freed place to the oldest waiter, never to a newcomer), then a connection, which is then
always free, so it is taken directly (redis-py's condition, lock and second timer cost ~30 µs of
CPU a command, about half of a script call's client-side cost: BENCHMARKS.md), and a
free place needs no timer either. The wait keeps its bound: past `timeout` it fails with
PoolExhausted, a ConnectionError as redis-py's ("No connection available"), which the services answer with a retryable 503
`overloaded` (not `redis_unavailable`: Redis is fine, the process is behind). The gateway's and the
trajectory manager's stores both use it; it knows nothing of what they store.
"""

from __future__ import annotations

import asyncio

from redis.asyncio import BlockingConnectionPool
from redis.driver_info import DriverInfo
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError

try:
    import hiredis
except ImportError:  # pure-Python packing, as redis-py does without it
    hiredis = None


class PoolExhausted(RedisConnectionError):
    """A command waited its whole bound in line for a connection: this process is overloaded (retry)."""


class _HiredisPacking:
    """Commands packed by hiredis in C, as redis-py's synchronous client already does when hiredis is
    installed (redis.connection.HiredisRespSerializer: the same bytes); its asyncio connection packs
    every argument in Python: ~30% of the trajectory manager's Redis client time (a turn's save is one
    script call of 24 arguments; BENCHMARKS.md)."""

    _hiredis_encodes: bool | None = None  # does this connection's encoder encode as hiredis does? (set once)

    def pack_command(self, *args):
        if self._hiredis_encodes is None:  # the encoder is the connection's for life: checked once, not per command
            e = self.encoder
            self._hiredis_encodes = e.encoding.lower().replace("-", "") == "utf8" and e.encoding_errors == "strict"
        if not self._hiredis_encodes:
            return super().pack_command(*args)  # hiredis encodes str as strict UTF-8 only
        first = args[0]
        if isinstance(first, str):
            if " " in first:
                args = (*first.split(), *args[1:])  # "SCRIPT LOAD" is two arguments
        elif b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # a bytearray (hiredis takes bytes and memoryview), or a bool or None
            pass
        try:
            return [hiredis.pack_command(tuple(bytes(a) if isinstance(a, bytearray) else a for a in args))]
        except TypeError as e:  # a bool or None: redis-py's own error for it
            raise DataError(str(e)) from None


_packing: dict[type, type] = {}


def _with_hiredis_packing(cls: type) -> type:
    if hiredis is None or issubclass(cls, _HiredisPacking):
        return cls
    if cls not in _packing:
        _packing[cls] = type(cls.__name__, (_HiredisPacking, cls), {})
    return _packing[cls]


# What each new connection tells Redis (CLIENT SETINFO), made once: redis-py otherwise looks its own
# version up in the package metadata (importlib.metadata, an email-header parse) for every connection
# it opens, ~2.7 ms of CPU each: 12% of the trajectory manager's CPU while its pool grew to 64 under
# bench/gateway_overhead.py (BENCHMARKS.md).
DRIVER_INFO = DriverInfo()


class FairPool(BlockingConnectionPool):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("driver_info", DRIVER_INFO)
        super().__init__(*args, **kwargs)
        self.connection_class = _with_hiredis_packing(self.connection_class)
        self._line = asyncio.Semaphore(self.max_connections)  # bound to a loop at its first wait

    async def get_connection(self, *args, **kwargs):
        # A free place is taken at once, with no timer (Semaphore.locked() is also true while others
        # wait, so a newcomer still queues behind them); only a wait needs its bound.
        if self._line.locked():
            try:
                async with asyncio.timeout(self.timeout):
                    await self._line.acquire()
            except TimeoutError:
                raise PoolExhausted(f"No connection available: {self.timeout:g} s in line for one of "
                                    f"{self.max_connections} Redis connections") from None
        else:
            await self._line.acquire()  # returns without suspending
        # A place in line means a free connection: taken directly, without the blocking pool's condition,
        # lock and second timer, which cost ~30 µs of CPU a command (BENCHMARKS.md); the
        # pool's bookkeeping is plain Python with no await in between, so the event loop keeps it whole.
        try:
            connection = self.get_available_connection()
        except BaseException:
            self._line.release()
            raise
        try:
            await self.ensure_connection(connection)  # connected, and no stale reply waiting on it
        except BaseException:
            await self.release(connection)
            raise
        return connection

    async def release(self, connection) -> None:
        if connection not in self._in_use_connections:
            return  # a second release of one connection frees no place
        self._in_use_connections.remove(connection)
        try:
            if connection.should_reconnect():
                await connection.disconnect()
        finally:
            self._available_connections.append(connection)
            self._line.release()
