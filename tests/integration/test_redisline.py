"""shared/redisline.py against a real redis-server: order, scripts, errors, losses, timeouts, auth."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis
import redis.asyncio as aioredis

from seamlessflow.stack import servers
from shared.redisline import RedisLine

pytestmark = pytest.mark.integration


@pytest.fixture
async def line(redis_url):
    line = RedisLine.from_url(redis_url, timeout=1.0, connect_timeout=2.0)
    assert line is not None
    yield line
    await line.close()


async def test_many_commands_in_flight_each_get_their_own_reply(line):
    await line.execute("DEL", "sf:test:line:n")
    replies = await asyncio.wait_for(asyncio.gather(
        *(line.execute("SET", f"sf:test:line:{i}", i) for i in range(300)),
        *(line.execute("INCR", "sf:test:line:n") for _ in range(300))), 10)
    assert replies[:300] == [b"OK"] * 300
    assert sorted(replies[300:]) == list(range(1, 301))
    values = await asyncio.gather(*(line.execute("GET", f"sf:test:line:{i}") for i in range(300)))
    assert values == [str(i).encode() for i in range(300)]
    assert await line.execute("GET", "sf:test:line:absent") is None
    sock = line._wire.transport.get_extra_info("socket")  # a silent peer is found while idle, too
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1


async def test_a_script_runs_by_digest_and_is_loaded_again_after_redis_forgets_it(line, redis_url):
    script = line.script("return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1}")
    assert await script(keys=["k"], args=[b"v", 41]) == [b"k", b"v", 42]
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.script_flush()
        assert not (await client.script_exists(script.sha))[0]
        assert await script(keys=["k2"], args=["w", 1]) == [b"k2", b"w", 2]
        assert (await client.script_exists(script.sha))[0]
    finally:
        await client.aclose()


async def test_an_error_reply_is_a_response_error_and_the_line_goes_on(line):
    await line.execute("SET", "sf:test:line:text", "not a number")
    with pytest.raises(redis.ResponseError, match="not an integer"):
        await line.execute("INCR", "sf:test:line:text")
    with pytest.raises(redis.ResponseError, match="boom"):
        await line.script("return redis.error_reply('boom')")()
    assert await line.execute("PING") == b"PONG"


async def test_a_cancelled_caller_leaves_the_replies_in_order(line):
    await line.execute("SET", "sf:test:line:a", "a")
    await line.execute("SET", "sf:test:line:b", "b")
    first = asyncio.create_task(line.execute("GET", "sf:test:line:a"))
    await asyncio.sleep(0)  # written, not answered yet
    first.cancel()
    assert await line.execute("GET", "sf:test:line:b") == b"b"
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_reply_past_the_timeout_fails_the_waiting_commands_and_the_next_one_reconnects(line):
    slow = asyncio.create_task(line.execute("BLPOP", "sf:test:line:never", 3))  # 3 s > the line's 1 s
    behind = asyncio.create_task(line.execute("PING"))  # queued behind it on the same connection
    with pytest.raises(redis.TimeoutError, match="no reply in 1 s"):
        await asyncio.wait_for(slow, 5)
    with pytest.raises(redis.TimeoutError):
        await behind
    assert await asyncio.wait_for(line.execute("PING"), 5) == b"PONG"


async def test_a_lost_connection_fails_what_was_sent_and_the_next_command_reconnects(line, redis_url):
    my_id = await line.execute("CLIENT", "ID")
    client = aioredis.Redis.from_url(redis_url)
    try:
        sent = asyncio.create_task(line.execute("BLPOP", "sf:test:line:never", 0.8))
        await asyncio.sleep(0.1)
        await client.client_kill_filter(_id=my_id)
        with pytest.raises(redis.ConnectionError):
            await asyncio.wait_for(sent, 5)
        assert await asyncio.wait_for(line.execute("CLIENT", "ID"), 5) != my_id
        # a loss found before the write: the command goes out on a new connection, once
        my_id = await line.execute("CLIENT", "ID")
        await client.client_kill_filter(_id=my_id)
        await asyncio.sleep(0.2)  # the line has seen the close
        assert await asyncio.wait_for(line.execute("PING"), 5) == b"PONG"
    finally:
        await client.aclose()


async def test_nothing_listening_is_a_connection_error_within_the_connect_timeout():
    line = RedisLine.from_url(f"redis://127.0.0.1:{servers.free_port()}/0", connect_timeout=1.0)
    with pytest.raises(redis.ConnectionError, match="connecting to Redis"):
        await asyncio.wait_for(line.execute("PING"), 5)
    await line.close()
    with pytest.raises(redis.ConnectionError, match="closed"):
        await line.execute("PING")


async def test_a_password_and_a_database_from_the_url(tmp_path):
    port = servers.free_port()
    proc = servers.start_redis(port, tmp_path / "redis", password="line-secret")
    try:
        wrong = RedisLine.from_url(f"redis://:nope@127.0.0.1:{port}/0")
        with pytest.raises(redis.AuthenticationError):
            await wrong.execute("PING")
        await wrong.close()
        line = RedisLine.from_url(f"redis://:line-secret@127.0.0.1:{port}/3")
        try:
            await line.execute("SET", "sf:test:line:db", "three")
            client = aioredis.Redis.from_url(f"redis://:line-secret@127.0.0.1:{port}/3")
            assert await client.get("sf:test:line:db") == b"three"
            await client.aclose()
        finally:
            await line.close()
    finally:
        servers.stop(proc)


def test_what_the_line_does_not_speak_is_left_to_redis_py():
    assert RedisLine.from_url("rediss://127.0.0.1:6379/0") is None
    assert RedisLine.from_url("redis://127.0.0.1:6379/0") is not None
