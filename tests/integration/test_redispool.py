"""shared/redispool.py (real Redis): a freed connection goes to the oldest waiter, never to a newcomer;
the wait keeps its bound and fails as redis-py's does; both services' stores use the pool."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from services.gateway.store import KeyStore
from services.trajectory.store import Store
from shared.redispool import FairPool

pytestmark = pytest.mark.integration


async def _newcomer_overtakes(pool) -> bool:
    """One connection, held; a waiter queues; the holder releases it and, before the waiter has run,
    asks again (a newcomer). True if the newcomer got the connection ahead of the waiter."""
    held = await pool.get_connection()
    waiter = asyncio.create_task(pool.get_connection())
    await asyncio.sleep(0.05)  # the waiter is in line
    await pool.release(held)
    try:
        async with asyncio.timeout(0.5):
            newcomer = await pool.get_connection()  # in this same step: the waiter has not run yet
    except TimeoutError:  # it waited behind the waiter, which holds the connection
        await pool.release(await asyncio.wait_for(waiter, 2))
        return False
    await pool.release(newcomer)
    await pool.release(await asyncio.wait_for(waiter, 2))
    return True


async def test_a_freed_connection_goes_to_the_oldest_waiter(redis_url):
    fair = FairPool.from_url(redis_url, max_connections=1, timeout=5)
    plain = BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=5)
    try:
        assert not await _newcomer_overtakes(fair)
        # what it fixes: redis-py's own blocking pool lets the newcomer overtake
        assert await _newcomer_overtakes(plain)
    finally:
        await fair.disconnect()
        await plain.disconnect()


async def test_waiters_are_served_in_order_and_the_wait_stays_bounded(redis_url):
    pool = FairPool.from_url(redis_url, max_connections=2, timeout=0.3)
    try:
        held = [await pool.get_connection() for _ in range(2)]
        order: list[int] = []

        async def wait(i: int) -> None:
            c = await pool.get_connection()
            order.append(i)
            await asyncio.sleep(0.01)
            await pool.release(c)

        waiters = [asyncio.create_task(wait(i)) for i in range(6)]
        await asyncio.sleep(0.05)
        for c in held:
            await pool.release(c)
        await asyncio.wait_for(asyncio.gather(*waiters), 2)
        assert order == list(range(6))

        held = [await pool.get_connection() for _ in range(2)]
        with pytest.raises(RedisConnectionError, match="No connection available"):
            await pool.get_connection()  # 0.3 s in line, then the same error as redis-py's pool
        for c in held:
            await pool.release(c)
        with contextlib.suppress(KeyError, ValueError):  # redis-py refuses a second release of one connection
            await pool.release(held[0])  # ... and it frees no extra place in line
        held = [await pool.get_connection() for _ in range(2)]
        with pytest.raises(RedisConnectionError):
            await pool.get_connection()
        for c in held:
            await pool.release(c)
    finally:
        await pool.disconnect()


async def test_a_thousand_commands_on_a_few_connections_all_get_through(redis_url):
    client = Redis.from_pool(FairPool.from_url(redis_url, max_connections=4, timeout=10))
    store = Store.connect(redis_url, 60)
    keys = KeyStore(redis_url, [], timeout=2.0, session_ttl=60)
    try:
        assert isinstance(store.r.connection_pool, FairPool) and isinstance(keys.redis.connection_pool, FairPool)
        await asyncio.wait_for(asyncio.gather(*(client.incr("sf:test:fairpool") for _ in range(1000))), 30)
        assert int(await client.get("sf:test:fairpool")) == 1000
        await client.delete("sf:test:fairpool")
    finally:
        await client.aclose()
        await store.close()
        await keys.close()


async def test_a_wait_that_runs_out_is_a_503_overloaded_not_redis_unavailable(redis_url, monkeypatch):
    from services.gateway import store as gw_store
    from services.gateway.errors import StoreBusy, from_exception
    from services.trajectory import store as traj_store
    from shared.redispool import PoolExhausted

    monkeypatch.setattr(traj_store, "POOL_WAIT", 0.2)
    monkeypatch.setattr(gw_store, "POOL_SIZE", 1)
    store = Store.connect(redis_url, 60, max_connections=1)
    keys = KeyStore(redis_url, [], timeout=0.2, session_ttl=60)
    try:
        held = [await store.r.connection_pool.get_connection(), await keys.redis.connection_pool.get_connection()]
        with pytest.raises(PoolExhausted):  # (a turn's lookup and save go on the pipelined line: no pool)
            await store.done("r1")
        with pytest.raises(StoreBusy) as e:
            await keys.lookup("sk-sf-anything")
        err = from_exception(e.value)
        assert (err.status, err.code, err.headers.get("retry-after")) == (503, "overloaded", "1")
        await store.r.connection_pool.release(held[0])
        await keys.redis.connection_pool.release(held[1])
        assert await store.done("r1") is None  # and it serves again once the line moves
    finally:
        await store.close()
        await keys.close()


async def test_the_gateways_line_has_its_own_bound_not_the_socket_timeout(redis_url, monkeypatch):
    # 1,000 agents on a starved box: key lookups failed after 2 s in line, the socket timeout's value
    from services.gateway import store as gw_store
    from services.gateway.errors import StoreBusy

    monkeypatch.setattr(gw_store, "POOL_SIZE", 1)
    keys = KeyStore(redis_url, [], timeout=0.2, session_ttl=60, pool_wait=1.0)
    try:
        held = await keys.redis.connection_pool.get_connection()
        lookup = asyncio.create_task(keys.lookup("sk-sf-anything"))
        await asyncio.sleep(0.5)  # past the socket timeout, within the line's bound
        assert not lookup.done()
        await keys.redis.connection_pool.release(held)
        assert await asyncio.wait_for(lookup, 2) is None  # served, not refused
        held = await keys.redis.connection_pool.get_connection()
        with pytest.raises(StoreBusy):
            await keys.lookup("sk-sf-anything")
        await keys.redis.connection_pool.release(held)
    finally:
        await keys.close()


async def test_cancelled_commands_leave_no_stale_reply_and_no_lost_place(redis_url):
    # the pool hands connections out and takes them back without redis-py's condition and lock: commands
    # cancelled mid-flight must neither leak a place in line nor leave a reply for the next command to read
    pool = FairPool.from_url(redis_url, max_connections=3, timeout=2)
    client = Redis.from_pool(pool)
    try:
        await client.set("sf:test:stale", "v")

        async def slow(i: int) -> None:
            await client.eval("local t = redis.call('TIME'); while redis.call('TIME')[2] - t[2] < 2000 "
                              "and redis.call('TIME')[1] == t[1] do end return 1", 0)

        for _ in range(5):
            tasks = [asyncio.create_task(slow(i)) for i in range(6)]  # 3 running, 3 in line
            await asyncio.sleep(0.001)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert not pool._in_use_connections and len(pool._available_connections) <= 3
        assert pool._line._value == 3  # every place came back
        got = await asyncio.wait_for(asyncio.gather(*(client.incr(f"sf:test:stale:{i}") for i in range(30))), 5)
        assert got == [1] * 30  # each command read its own reply
        assert await client.get("sf:test:stale") == b"v"
    finally:
        await client.delete("sf:test:stale", *(f"sf:test:stale:{i}" for i in range(30)))
        await client.aclose()
