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
always free. The wait keeps its bound: past `timeout` it fails with PoolExhausted, a ConnectionError
as redis-py's ("No connection available"), which the services answer with a retryable 503
`overloaded` (not `redis_unavailable`: Redis is fine, the process is behind). The gateway's and the
trajectory manager's stores both use it; it knows nothing of what they store.
"""

from __future__ import annotations

import asyncio

from redis.asyncio import BlockingConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError


class PoolExhausted(RedisConnectionError):
    """A command waited its whole bound in line for a connection: this process is overloaded (retry)."""


class FairPool(BlockingConnectionPool):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._line = asyncio.Semaphore(self.max_connections)  # bound to a loop at its first wait

    async def get_connection(self, *args, **kwargs):
        try:
            async with asyncio.timeout(self.timeout):
                await self._line.acquire()
        except TimeoutError:
            raise PoolExhausted(f"No connection available: {self.timeout:g} s in line for one of "
                                f"{self.max_connections} Redis connections") from None
        try:
            return await super().get_connection()  # a place in line means a free connection: no wait here
        except BaseException:
            self._line.release()
            raise

    async def release(self, connection) -> None:
        owned = connection in self._in_use_connections  # a second release of one connection frees no place
        try:
            await super().release(connection)
        finally:
            if owned:
                self._line.release()
