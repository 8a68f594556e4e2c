"""The gateway's key cache (real Redis): a key found in Redis is trusted for
`key_cache_seconds` without asking again; unknown keys are never cached."""

from __future__ import annotations

import pytest

from services.gateway.store import KEY_PREFIX, KeyStore, digest

pytestmark = pytest.mark.integration


async def test_found_keys_are_cached_for_a_while_and_unknown_ones_never(redis_url):
    store = KeyStore(redis_url, [], timeout=2.0, session_ttl=60, cache_seconds=0.3)
    uncached = KeyStore(redis_url, [], timeout=2.0, session_ttl=60, cache_seconds=0.0)
    now = [1000.0]
    store.clock = lambda: now[0]  # the cache's time is the test's: Redis round trips take none of it
    try:
        key = await store.add_session_key("sess-cache", "tenant-a")
        assert (await store.lookup(key)).session_id == "sess-cache"
        await store.redis.delete(KEY_PREFIX + digest(key))  # gone from Redis
        now[0] += 0.29
        assert (await store.lookup(key)).session_id == "sess-cache"  # still trusted, for now
        assert await uncached.lookup(key) is None
        now[0] += 0.02
        assert await store.lookup(key) is None  # the cache entry lapsed

        late = "sk-sf-not-yet"
        assert await store.lookup(late) is None
        await store.redis.set(KEY_PREFIX + digest(late), b'{"kind":"user","created":0.0}')
        assert (await store.lookup(late)).kind == "user"  # a miss was not remembered
        await store.redis.delete(KEY_PREFIX + digest(late))
    finally:
        await store.close()
        await uncached.close()
