"""shared/redispool.py without Redis: the pool's connections pack commands with hiredis, byte for byte
as redis-py's own packing (the pool's line and bound are tested against real Redis, in integration)."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import DataError

from shared.redispool import FairPool, _HiredisPacking

pytest.importorskip("hiredis")

ARGS = [
    ("GET", "sf:done:r1"),
    ("SCRIPT LOAD", "return 1"),  # a command name of two words
    (b"CLIENT SETINFO", b"LIB-NAME", "redis-py"),
    ("EVALSHA", "a" * 40, 2, "k1", "k2", b"\x00\xff" * 4000, 3600, -1, 0.1 + 0.2, 1e-20, 12345678901234567890,
     "é ü", bytearray(b"ba"), memoryview(b"mv"), ""),
]


@pytest.mark.parametrize("args", ARGS)
def test_hiredis_packing_is_byte_for_byte_redis_pys(args):
    plain = Connection()
    fast = FairPool.from_url("redis://127.0.0.1:1").make_connection()
    assert isinstance(fast, _HiredisPacking) and not isinstance(plain, _HiredisPacking)
    assert b"".join(fast.pack_command(*args)) == b"".join(plain.pack_command(*args))


def test_a_value_redis_py_refuses_is_refused_the_same_way():
    fast = FairPool.from_url("redis://127.0.0.1:1").make_connection()
    for bad in (True, None):
        with pytest.raises(DataError):
            Connection().pack_command("SET", "k", bad)
        with pytest.raises(DataError):
            fast.pack_command("SET", "k", bad)


def test_every_connection_kind_keeps_its_class_and_another_encoding_packs_in_python():
    unix = FairPool.from_url("unix:///tmp/nothing.sock").make_connection()
    assert isinstance(unix, UnixDomainSocketConnection) and isinstance(unix, _HiredisPacking)
    latin = FairPool.from_url("redis://127.0.0.1:1", encoding="latin-1").make_connection()
    assert b"".join(latin.pack_command("SET", "k", "é")) == b"".join(
        Connection(encoding="latin-1").pack_command("SET", "k", "é"))
