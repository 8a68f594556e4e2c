"""API keys and stored responses in Redis: the only gateway module that touches Redis.

A key is never stored, only its SHA-256: `sf:key:<sha256 hex>` -> JSON
{"kind": "user"|"session", "session_id": ..., "created": ..., "name": ..., "owner": ..., "limits": ...}.
A key is found by the hash of what the caller sent, a dictionary lookup: no secret is ever
compared byte by byte, so the time an answer takes tells nothing of a key (the admin key, the one
secret compared as such, goes through hmac.compare_digest: edge.same_secret).
Static user keys from the config are hashed in memory and need no Redis.
`sf:owner:<session id>` -> the tenant (hash of the user key) that created the session: only that
tenant's keys may use the session (sessions.py, responses.py).
`sf:group:<group id>` -> the tenant whose session first named that GRPO group; another tenant's
session in it is refused with 404 (sessions.py).
A stored Responses-API response is `sf:resp:<response id>` -> msgpack `StoredResponse`,
expiring with session keys (responses.py).
Logs name a key by `key_id` (a short hash prefix), never by the key itself.

Every call has a socket timeout and at most one retry, so a Redis outage turns
into StoreUnavailable (503) quickly instead of a hung request; redis-py reconnects
on the next call once Redis is back.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff
from redis.exceptions import RedisError

from services.gateway.errors import StoreBusy, StoreUnavailable
from services.gateway.limits import TenantLimits
from shared.redispool import PoolExhausted
from shared.config import TlsFiles
from shared.redissentinel import pool_from_url

log = logging.getLogger(__name__)

KEY_PREFIX = "sf:key:"
GROUP_PREFIX = "sf:group:"  # sf:group:<group id> -> the tenant whose session first named it (issue 30)
OWNER_PREFIX = "sf:owner:"  # sf:owner:<session id> -> the tenant (hash of the user key) that created it
SESSION_KEY_PREFIX = "sk-sf-"
POOL_SIZE = 64  # Redis connections per gateway process


class KeyRecord(msgspec.Struct, frozen=True):
    kind: Literal["user", "session"]
    session_id: str = ""
    created: float = 0.0
    name: str = ""
    # The tenant: a user key's own hash; for a session key, the hash of the user key that created
    # its session. Sessions, stored responses and limits belong to a tenant. Filled in by `lookup`
    # where Redis has none (user keys; session keys minted before tenants existed: their own hash).
    owner: str = ""
    # The tenant's own rate and concurrency limits, set when its user key was minted and copied onto
    # the session keys it mints; None: the gateway's settings.
    limits: TenantLimits | None = None


_record = msgspec.json.Decoder(KeyRecord)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(key: str) -> str:
    """What logs and admin output may show of a key."""
    return digest(key)[:10]


def mint() -> str:
    return SESSION_KEY_PREFIX + secrets.token_urlsafe(24)


KEY_CACHE_MAX = 100_000  # remembered keys per gateway process


class KeyStore:
    def __init__(self, redis_url: str, static_keys: list[str], timeout: float, session_ttl: int,
                 cache_seconds: float = 0.0, pool_wait: float | None = None, tls: TlsFiles | None = None) -> None:
        self.timeout = timeout
        self.pool_wait = timeout if pool_wait is None else pool_wait  # in line for a connection, under load
        self.session_ttl = session_ttl
        # Keys found in Redis are remembered this long (an agent sends many requests with one
        # key; keys are never revoked early, so the cost is a key outliving its TTL by this much).
        self.cache_seconds = cache_seconds
        self._cache: dict[str, tuple[KeyRecord, float]] = {}
        self.clock: Callable[[], float] = time.monotonic  # the cache's seconds (a test sets its own)
        # a blocking pool: a call waits (up to `pool_wait`) for one of POOL_SIZE connections; redis-py's
        # default pool failed the 101st concurrent call at once (bench/load.py, 500 agents: 463 503s);
        # waiters are served in order (shared/redispool.py), so no wait outlasts a short line
        self.redis = aioredis.Redis.from_pool(pool_from_url(
            redis_url,
            tls=tls,  # SF_REDIS_TLS_*
            max_connections=POOL_SIZE,
            timeout=self.pool_wait,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(ConstantBackoff(0.05), retries=1),
            health_check_interval=10,
        ))
        now = time.time()
        self.static = {h: KeyRecord(kind="user", created=now, name="static", owner=h)
                       for h in map(digest, static_keys)}

    async def _call(self, what: str, coro):
        # The line and the socket timeouts bound each part; this bounds the whole call including the retry.
        try:
            async with asyncio.timeout(self.pool_wait + self.timeout * 3 + 0.5):
                return await coro
        except PoolExhausted as e:
            raise StoreBusy(f"{what} failed: {e}") from None
        except (RedisError, OSError, TimeoutError) as e:
            raise StoreUnavailable(f"{what} failed: {type(e).__name__}: {e}") from None

    async def lookup(self, key: str) -> KeyRecord | None:
        h = digest(key)
        if (record := self.static.get(h)) is not None:
            return record
        now = self.clock()
        if (hit := self._cache.get(h)) is not None and hit[1] > now:
            return hit[0]
        raw = await self._call("key lookup", self.redis.get(KEY_PREFIX + h))
        if raw is None:
            return None  # not cached: a key created a moment later must work at once
        record = _record.decode(raw)
        if not record.owner:
            record = msgspec.structs.replace(record, owner=h)
        if self.cache_seconds > 0:
            if len(self._cache) >= KEY_CACHE_MAX:
                self._cache = {k: v for k, v in self._cache.items() if v[1] > now}
                if len(self._cache) >= KEY_CACHE_MAX:
                    self._cache.clear()
            self._cache[h] = (record, now + self.cache_seconds)
        return record

    async def add_user_key(self, name: str = "", limits: TenantLimits | None = None) -> tuple[str, KeyRecord]:
        key = mint()
        record = KeyRecord(kind="user", created=time.time(), name=name, limits=limits)
        await self._call("key create", self.redis.set(KEY_PREFIX + digest(key), msgspec.json.encode(record)))
        log.info("created user key %s (%s)", key_id(key), name or "unnamed")
        return key, msgspec.structs.replace(record, owner=digest(key))

    async def add_session_key(self, session_id: str, owner: str, limits: TenantLimits | None = None) -> str:
        """A key for `session_id`, and the session's tenant (`owner`), written together; the key
        carries the tenant's `limits`."""
        key = mint()
        record = KeyRecord(kind="session", session_id=session_id, created=time.time(), owner=owner, limits=limits)
        ttl = self.session_ttl or None
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(KEY_PREFIX + digest(key), msgspec.json.encode(record), ex=ttl)
        pipe.set(OWNER_PREFIX + session_id, owner, ex=ttl)
        await self._call("key create", pipe.execute())
        log.info("created session key %s for session %s", key_id(key), session_id)
        return key

    async def claim_session(self, session_id: str, owner: str) -> None:
        """Record the tenant of a session a user key's turn created (a one-off session)."""
        await self._call("session owner", self.redis.set(OWNER_PREFIX + session_id, owner, ex=self.session_ttl or None))

    async def claim_group(self, group_id: str, owner: str) -> bool:
        """Whether `owner` may open a session in GRPO group `group_id`: the first tenant to name a group
        owns it (for the session TTL, renewed by each of its sessions); another tenant's is refused, so
        its rewards are never grouped with the owner's in training."""
        ttl = self.session_ttl or None
        key = GROUP_PREFIX + group_id
        if await self._call("group owner", self.redis.set(key, owner, nx=True, ex=ttl)):
            return True
        raw = await self._call("group owner", self.redis.get(key))
        if raw is None:  # expired between the two calls: claim it again
            return bool(await self._call("group owner", self.redis.set(key, owner, nx=True, ex=ttl)))
        if raw.decode() != owner:
            return False
        if ttl:
            await self._call("group owner", self.redis.expire(key, ttl))
        return True

    async def session_owner(self, session_id: str) -> str | None:
        """The tenant that created `session_id` through this gateway, or None (unknown, or expired)."""
        raw = await self._call("session owner", self.redis.get(OWNER_PREFIX + session_id))
        return None if raw is None else raw.decode()

    async def ping(self) -> bool:
        try:
            await self._call("ping", self.redis.ping())
            return True
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        await self.redis.aclose()


RESPONSE_PREFIX = "sf:resp:"


class StoredResponse(msgspec.Struct):
    """A response kept for previous_response_id and GET /v1/responses/{id}."""

    session_id: str  # the session its turn was recorded in: only that session's key may use it
    turn_id: int
    conversation: list[dict[str, Any]]  # chat messages after `instructions`: its inputs so far and its reply
    response: dict[str, Any]  # the Response object, as the agent got it
    owner: str = ""  # the tenant (KeyRecord.owner) whose turn it was: its user keys may use it too


_stored = msgspec.msgpack.Decoder(StoredResponse)


class ResponseStore:
    """Stored responses, on the key store's Redis client (same timeouts, same 503 on an outage)."""

    def __init__(self, keys: KeyStore, ttl: int) -> None:
        self.keys = keys
        self.ttl = ttl

    async def put(self, response_id: str, record: StoredResponse) -> None:
        await self.keys._call("response store", self.keys.redis.set(
            RESPONSE_PREFIX + response_id, msgspec.msgpack.encode(record), ex=self.ttl or None))

    async def get(self, response_id: str) -> StoredResponse | None:
        raw = await self.keys._call("response lookup", self.keys.redis.get(RESPONSE_PREFIX + response_id))
        return None if raw is None else _stored.decode(raw)
