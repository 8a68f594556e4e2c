"""The host registry in Redis (the only scheduler module touching Redis).

    sf:hosts                  set     host ids
    sf:host:<id>              hash    tags (JSON), capacity, mode, target, epoch, healthy, cordoned,
                                      last_seen, worker_id, restarts
    sf:host:<id>:timeline     list    msgpack Interval(activity, t_start, t_end), newest last, capped
    sf:sched:policy           string  the policy in force (set_policy survives a restart)

A restarted scheduler rebuilds its registry from these keys; host agents keep their last
assignment meanwhile and re-register with their next heartbeat.
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from services.scheduler.registry import TIMELINE_KEEP, HostRecord
from shared.codec import decode, encode
from shared.messages.scheduler import Interval
from shared.config import TlsFiles
from shared.redissentinel import client_from_url

HOSTS = "sf:hosts"
POLICY = "sf:sched:policy"


def host_key(host: str) -> str:
    return f"sf:host:{host}"


def timeline_key(host: str) -> str:
    return f"sf:host:{host}:timeline"


class Store:
    def __init__(self, r: aioredis.Redis):
        self.r = r

    @classmethod
    def connect(cls, url: str, tls: TlsFiles | None = None) -> Store:
        return cls(client_from_url(url, tls, socket_timeout=5, socket_connect_timeout=5))

    async def close(self) -> None:
        await self.r.aclose()

    async def save_host(self, rec: HostRecord) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.sadd(HOSTS, rec.host)
            p.hset(host_key(rec.host), mapping={
                "tags": json.dumps(rec.tags), "capacity": rec.capacity, "mode": rec.mode, "target": rec.target,
                "epoch": rec.epoch, "healthy": int(rec.healthy), "cordoned": int(rec.cordoned),
                "last_seen": rec.last_seen, "worker_id": rec.worker_id, "restarts": rec.restarts,
            })
            await p.execute()

    async def load_hosts(self) -> list[HostRecord]:
        out = []
        for raw in sorted(await self.r.smembers(HOSTS)):
            host = raw.decode()
            h = {k.decode(): v.decode() for k, v in (await self.r.hgetall(host_key(host))).items()}
            if not h:
                continue
            out.append(HostRecord(host, json.loads(h["tags"]), float(h["capacity"]), h["mode"], h["target"],
                                  int(h["epoch"]), h["healthy"] == "1", h["cordoned"] == "1", float(h["last_seen"]),
                                  h.get("worker_id", ""), int(h.get("restarts", 0))))
        return out

    async def append_intervals(self, closed: list[tuple[str, Interval]]) -> None:
        if not closed:
            return
        async with self.r.pipeline(transaction=False) as p:
            for host, iv in closed:
                p.rpush(timeline_key(host), encode(iv))
            for host in {h for h, _ in closed}:
                p.ltrim(timeline_key(host), -TIMELINE_KEEP, -1)
            await p.execute()

    async def timeline(self, host: str) -> list[Interval]:
        return [decode(x, Interval) for x in await self.r.lrange(timeline_key(host), 0, -1)]

    async def policy(self) -> str | None:
        v = await self.r.get(POLICY)
        return v.decode() if v else None

    async def set_policy(self, name: str) -> None:
        await self.r.set(POLICY, name)
