"""Redis state of the trajectory manager. The only module here that touches Redis.

Keys (all expire `session_ttl` seconds after the session's last write):
    sf:s:{sid}          hash  group_id, metadata (JSON), status open|finished, reward, created,
                              finished_at, worker (sticky rollout worker), anonymous
    sf:s:{sid}:turns    hash  turn_id -> msgpack Turn
    sf:s:{sid}:idx      hash  conversation key -> turn_id
    sf:s:{sid}:seq      int   last turn id handed out
    sf:completed        list  finished session ids, oldest first

A turn is written in one MULTI/EXEC with its index entry, so a failed turn leaves
no trace and earlier turns stay intact.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

from services.trajectory.turns import Turn

COMPLETED = "sf:completed"

_turn_enc = msgspec.msgpack.Encoder()
_turn_dec = msgspec.msgpack.Decoder(Turn)


class SessionNotFound(KeyError):
    pass


class SessionFinished(RuntimeError):
    pass


def _k(sid: str, part: str = "") -> str:
    return f"sf:s:{sid}" + (f":{part}" if part else "")


class Store:
    def __init__(self, client: aioredis.Redis, ttl: int):
        self.r = client
        self.ttl = ttl

    @classmethod
    def connect(cls, url: str, ttl: int) -> "Store":
        client = aioredis.from_url(
            url, socket_timeout=5, socket_connect_timeout=3, health_check_interval=10,
            retry_on_timeout=False,
        )
        return cls(client, ttl)

    async def close(self) -> None:
        await self.r.aclose()

    async def ping(self) -> bool:
        return bool(await self.r.ping())

    async def create_session(
        self, group_id: str = "", metadata: dict[str, Any] | None = None, anonymous: bool = False
    ) -> str:
        sid = "sess-" + secrets.token_hex(12)
        meta = {
            "group_id": group_id or sid,
            "metadata": json.dumps(metadata or {}),
            "status": "open",
            "created": time.time(),
            "anonymous": int(anonymous),
        }
        async with self.r.pipeline(transaction=True) as p:
            p.hset(_k(sid), mapping=meta)
            p.expire(_k(sid), self.ttl)
            await p.execute()
        return sid

    async def session(self, sid: str) -> dict[str, Any]:
        raw = await self.r.hgetall(_k(sid))
        if not raw:
            raise SessionNotFound(sid)
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        meta["metadata"] = json.loads(meta.get("metadata", "{}"))
        meta["reward"] = float(meta["reward"]) if "reward" in meta else None
        return meta

    async def turns(self, sid: str) -> dict[int, Turn]:
        raw = await self.r.hgetall(_k(sid, "turns"))
        return {int(k): _turn_dec.decode(v) for k, v in raw.items()}

    async def find_turn(self, sid: str, keys: list[str]) -> tuple[str, int] | None:
        """The first of `keys` (longest prefix first) that names a stored turn."""
        if not keys:
            return None
        found = await self.r.hmget(_k(sid, "idx"), keys)
        for key, tid in zip(keys, found):
            if tid is not None:
                return key, int(tid)
        return None

    async def next_turn_id(self, sid: str) -> int:
        return int(await self.r.incr(_k(sid, "seq"))) - 1

    async def save_turn(self, sid: str, turn: Turn, worker: str) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.hset(_k(sid, "turns"), str(turn.turn_id), _turn_enc.encode(turn))
            if turn.key:
                p.hset(_k(sid, "idx"), turn.key, str(turn.turn_id))
            p.hset(_k(sid), "worker", worker)
            for part in ("", "turns", "idx", "seq"):
                p.expire(_k(sid, part), self.ttl)
            await p.execute()

    async def set_reward(self, sid: str, reward: float) -> None:
        meta = await self.session(sid)
        if meta["status"] == "finished":
            raise SessionFinished(sid)
        await self.r.hset(_k(sid), "reward", repr(float(reward)))

    async def mark_finished(self, sid: str, reward: float) -> bool:
        """Returns False if it was already finished (a retried finish)."""
        async with self.r.pipeline(transaction=True) as p:
            p.hget(_k(sid), "status")
            p.hset(_k(sid), mapping={"status": "finished", "reward": repr(float(reward)),
                                     "finished_at": time.time()})
            prev, _ = await p.execute()
        if prev == b"finished":
            return False
        await self.r.rpush(COMPLETED, sid)
        return True
