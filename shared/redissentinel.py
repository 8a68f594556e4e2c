"""Redis behind Sentinel, for every Redis client of the services: `redis+sentinel://` URLs.

    redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?sentinel_password=P]

HOST:PORT are the sentinels (any of them will do: each is asked in turn), SERVICE is the name they
monitor the primary under (`sentinel monitor SERVICE ...`), DB the database (0 unless given). The
password, if any, is the primary's and its replicas' (`requirepass`/`masterauth`); sentinels that
need one of their own take `?sentinel_password=`.

Every client asks the sentinels for the current primary when it connects, and connects again after
a lost connection or a READONLY reply (a former primary that came back as a replica), so a failover
is a few failed commands (retryable 503s at the edge), not a restart of anything:
- `pool_from_url`: FairPool (shared/redispool.py) with sentinel-managed connections;
- `client_from_url`: a plain redis-py client (the scheduler's store);
- `master_resolver`: what RedisLine (shared/redisline.py) asks for the primary's address.
A plain `redis://` or `rediss://` URL goes straight to redis-py's `from_url`. Redis Cluster is not
supported: the trajectory store's multi-key scripts use no hash tags (docs/reliability.md).

Each takes `tls` (Connections.redis_tls, SF_REDIS_TLS_*): given, every connection is TLS, verified
against its CA, with its client certificate if any: to the server of a `redis://` URL, and to the
sentinels and the primary of a Sentinel URL (a TLS deployment serves both on TLS ports).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import (Sentinel, SentinelConnectionPool, SentinelManagedConnection,
                                    SentinelManagedSSLConnection)

from shared.config import ConfigError, TlsFiles
from shared.redispool import FairPool
from shared.tls import redis_kwargs

SCHEME = "redis+sentinel://"


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)


def is_sentinel(url: str) -> bool:
    return url.startswith(SCHEME)


def parse(url: str) -> SentinelUrl:
    if not is_sentinel(url):
        raise ConfigError(f"not a {SCHEME} URL")
    rest = url[len(SCHEME):]
    login, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    path, _, query = path.partition("?")
    parts = [p for p in path.split("/") if p]
    if not hosts or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError(f"a Sentinel URL is {SCHEME}[:PASSWORD@]HOST:PORT[,HOST:PORT]/SERVICE[/DB]")
    sentinels = []
    for hp in hosts.split(","):
        host, _, port = hp.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"sentinel {hp!r}: give HOST:PORT")
        sentinels.append((host, int(port)))
    user, _, password = login.partition(":") if login else ("", "", "")
    extra = parse_qs(urlsplit("x://h/?" + query).query)
    return SentinelUrl(tuple(sentinels), unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0,
                       unquote(user) or None, unquote(password) or None,
                       (extra.get("sentinel_password") or [None])[0])


def sentinel_for(target: SentinelUrl, timeout: float = 3.0, tls: TlsFiles | None = None) -> Sentinel:
    """A client of the sentinels (each call asks them; nothing is cached between failovers)."""
    kw: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if tls is not None:
        kw.update(ssl=True, **redis_kwargs(tls))
    if target.sentinel_password:
        kw["password"] = target.sentinel_password
    return Sentinel(list(target.sentinels), sentinel_kwargs=kw)


class FairSentinelPool(FairPool, SentinelConnectionPool):
    """FairPool's FIFO line over connections to whichever server the sentinels name primary."""


def _with_tls(url: str, kwargs: dict[str, Any], tls: TlsFiles | None) -> dict[str, Any]:
    """`kwargs` plus the TLS connection class and files (a `unix://` URL cannot be TLS: config.check_tls)."""
    if tls is None:
        return kwargs
    cls = SentinelManagedSSLConnection if is_sentinel(url) else SSLConnection
    return {**kwargs, "connection_class": cls, **redis_kwargs(tls)}


def pool_from_url(url: str, pool_class: type[FairPool] = FairPool, tls: TlsFiles | None = None,
                  **kwargs: Any) -> FairPool:
    """`pool_class.from_url(url, **kwargs)`, or for a Sentinel URL the same line over sentinel-managed
    connections (connection kwargs apply to the primary; the sentinels get the socket timeouts)."""
    if not is_sentinel(url):
        return pool_class.from_url(url, **_with_tls(url, kwargs, tls))
    target = parse(url)
    manager = sentinel_for(target, kwargs.get("socket_connect_timeout") or 3.0, tls)
    kwargs = {"connection_class": SentinelManagedConnection, **_with_tls(url, kwargs, tls)}
    return FairSentinelPool(service_name=target.service, sentinel_manager=manager, db=target.db,
                            username=target.username, password=target.password, **kwargs)


def client_from_url(url: str, tls: TlsFiles | None = None, **kwargs: Any) -> aioredis.Redis:
    """`redis.asyncio.from_url(url, **kwargs)`, or a client of a Sentinel URL's primary."""
    if not is_sentinel(url):
        return aioredis.from_url(url, **_with_tls(url, kwargs, tls))
    target = parse(url)
    manager = sentinel_for(target, kwargs.get("socket_connect_timeout") or 3.0, tls)
    return manager.master_for(target.service, db=target.db, username=target.username, password=target.password,
                              **_with_tls(url, kwargs, tls))


def master_resolver(url: str, timeout: float = 3.0,
                    tls: TlsFiles | None = None) -> Callable[[], Awaitable[tuple[str, int]]]:
    """For RedisLine: an async call that returns the primary's (host, port), from the sentinels."""
    target = parse(url)
    manager = sentinel_for(target, timeout, tls)

    async def resolve() -> tuple[str, int]:
        return await manager.discover_master(target.service)

    return resolve
