"""Redis state of the trajectory manager. The only module here that touches Redis.

Keys (all expire `session_ttl` seconds after the session's last write):
    sf:s:{sid}          hash  group_id, metadata (JSON), status open|finished, reward, created,
                              finished_at, worker (sticky rollout worker), anonymous
    sf:s:{sid}:turns    hash  turn_id -> msgpack Turn
    sf:s:{sid}:idx      hash  conversation key -> turn_id
    sf:s:{sid}:path     hash  turn_id -> msgpack [token ids]: the whole token path of a leaf turn (a cache:
                              a turn's entry goes when a turn extends it; without it the path is walked)
    sf:s:{sid}:alias    hash  raw digest of a turn's request messages -> "turn_id request-key turn-key":
                              how the next request finds the turn without hashing the whole history
    sf:s:{sid}:seq      int   last turn id handed out
    sf:open             zset  open (agent-created) session ids by creation time: admission control
    sf:req:{rid}        string msgpack InFlight: a running request's prompt (partial-rollout state)
    sf:req:{rid}:deltas list  msgpack [worker, starts_dispatch, version, token_ids, logprobs], in order
    sf:req:{rid}:owner  string the replica serving it; expires unless refreshed (lease)
    sf:done:{rid}       string msgpack ChatDone of a finished request, so a retry gets the same answer
    sf:s:{sid}:event    string msgpack TrajectoryCompleted of a `finishing` session; never expires
                               while the publication is pending, deleted once it is durable
    sf:finishing        zset  finishing session ids by the time finishing began: pending publications
    sf:fin:{sid}:owner  string the replica publishing it; expires unless refreshed (lease)

A session is open -> finishing (its TrajectoryCompleted is stored here, then published to
JetStream, retried while the stream is full) -> finished (durable in the stream). A replica that
dies while publishing leaves the session in sf:finishing; any replica takes it once the lease lapses.

A turn is written in one MULTI/EXEC with its index entry, so a failed turn leaves
no trace and earlier turns stay intact. A running request's tokens are appended to
sf:req:{rid}:deltas before the agent sees them, so a replica that takes over a request
whose replica died continues exactly where it stopped.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from services.trajectory.tokenpath import TokenPath
from services.trajectory.turns import Turn
from shared.logonce import OncePerCause
from shared.redisline import RedisLine
from shared.config import TlsFiles
from shared.redissentinel import pool_from_url

OPEN = "sf:open"

_turn_enc = msgspec.msgpack.Encoder()
_turn_dec = msgspec.msgpack.Decoder(Turn)


class InFlight(msgspec.Struct, array_like=True):
    session_id: str
    turn_id: int
    prompt_ids: list[int]  # written as TokenPath.wire(): the same msgpack array
    new_ids: list[int]
    parent: int
    new_messages: list[dict[str, Any]]
    request_key: str = ""  # conversation key of the request's messages ("": recompute)
    raw: str = ""  # raw digest of the request's messages (conversation.raw_digest)


class DeltaRecord(msgspec.Struct, array_like=True):
    worker: str
    starts_dispatch: bool
    version: int
    token_ids: list[int]
    logprobs: list[float]


class Alias(msgspec.Struct, frozen=True):
    """What the raw digest of a turn's request messages leads to (conversation.raw_digest)."""

    turn_id: int
    request_key: str  # conversation key of the request's messages
    turn_key: str  # ... and of them plus the reply: the turn's own key
    last_id: int | None = None  # the last id of the turn's token path (None: unknown, decode the path to learn it)

    # "<turn id> <request key> <turn key>[:<last id>]": a replica from before last_id reads three fields
    # still, finds its turn key unequal and takes the slow way (prompts.py step 2), rather than failing
    def encode(self) -> str:
        last = f":{self.last_id}" if self.last_id is not None else ""
        return f"{self.turn_id} {self.request_key} {self.turn_key}{last}"

    @classmethod
    def decode(cls, raw: bytes) -> "Alias":
        tid, request_key, turn_key = raw.decode().split(" ")
        turn_key, _, last = turn_key.partition(":")
        return cls(int(tid), request_key, turn_key, int(last) if last else None)


class Followed(msgspec.Struct):
    alias: Alias
    path: TokenPath | None  # None: not cached (a branch point); walk the turns


_inflight_dec = msgspec.msgpack.Decoder(InFlight)
_delta_dec = msgspec.msgpack.Decoder(DeltaRecord)
REQUEST_TTL = 3600
_warn = OncePerCause(logging.getLogger(__name__))
POOL_SIZE = 64  # Redis connections per replica; more commands at once wait for one (Store.connect)
POOL_WAIT = 5.0  # seconds a command waits for a free connection before it fails


class SessionNotFound(KeyError):
    pass


class SessionFinished(RuntimeError):
    pass


class Lookup(msgspec.Struct):
    done: bytes | None
    state: InFlight | None
    meta: dict[str, Any] | None
    turn_id: int
    session_id: str  # the request's session: where a running request began, else the one asked for
    follow: str = ""  # the raw digest looked up with it ("": none was asked) ...
    followed: Followed | None = None  # ... and the turn it names, as Store.follow returns it
    leased: bool = False  # a new request (no result, no state) whose lease the lookup's owner holds
    raw: str = ""  # the request's own raw digest, where its caller computed it with `follow` (not the store's)


def _followed(raw_alias: bytes, path: bytes | None) -> Followed:
    alias = Alias.decode(raw_alias)
    return Followed(alias, TokenPath.from_raw(path, alias.last_id) if path else None)


def _meta(sid: str, raw: dict[bytes, bytes]) -> dict[str, Any]:
    if not raw:
        raise SessionNotFound(sid)
    meta = {k.decode(): v.decode() for k, v in raw.items()}
    meta["metadata"] = json.loads(meta.get("metadata", "{}"))
    meta["reward"] = float(meta["reward"]) if "reward" in meta else None
    return meta


def _k(sid: str, part: str = "") -> str:
    return f"sf:s:{sid}" + (f":{part}" if part else "")


# A turn's Redis work is a few script calls (lookup, first append, save): atomic like MULTI/EXEC, and
# one command for the client to pack and parse instead of up to 16 (redis-py spends tens of microseconds
# of CPU per command; BENCHMARKS.md). A new request's lease is taken by its lookup and its state written
# with its first tokens (_APPEND_IF_HOLDER): no call of its own to begin it.

# KEYS: done, state, owner, then with a session: the session, its turn counter, then its alias and path
# hashes. ARGV: lease owner ('' none), lease ms, raw digest. GET done, GET state; for a new request (neither)
# the lease, for ARGV[1] (1: held by it); with a session: HGETALL it, INCR its turn counter; with the
# hashes: _FOLLOW's work for the raw digest, in the same round trip
_LOOKUP = """
local done, state = redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])
local leased = 0
if ARGV[1] ~= '' and not done and not state then
  local holder = redis.call('GET', KEYS[3])
  if not holder then
    redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
    leased = 1
  elseif holder == ARGV[1] then
    leased = 1
  end
end
local out = {done or false, state or false, leased}
if #KEYS > 3 then
  out[4] = redis.call('HGETALL', KEYS[4])
  out[5] = redis.call('INCR', KEYS[5])
  if #KEYS > 5 then
    local a = redis.call('HGET', KEYS[6], ARGV[3])
    if a then
      out[6] = a
      out[7] = redis.call('HGET', KEYS[7], string.match(a, '^(%S+)')) or false
    end
  end
end
return out
"""

# KEYS: state, deltas, owner, done, then the session's parts (SESSION_PARTS: meta, turns, idx, seq, path,
# alias). ARGV: result ('' none), request ttl, turn id, turn, key ('' none), worker, session ttl,
# path ('' none), parent, alias digest ('' none), alias value, lease owner ('' none), began ('1': its
# state was written). With an owner, the request's lease is checked as _HOLD does, in the same call: 0 and
# nothing written if it was lost. A request never begun (no tokens appended) must have neither a state
# (another handling began it) nor a result (another finished it).
_SAVE_TURN = """
if ARGV[12] ~= '' then
  if ARGV[13] == '1' then
    if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
  elseif redis.call('EXISTS', KEYS[1], KEYS[4]) > 0 then return 0 end
  local holder = redis.call('GET', KEYS[3])
  if holder and holder ~= ARGV[12] then return 0 end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
if ARGV[1] ~= '' then redis.call('SET', KEYS[4], ARGV[1], 'EX', ARGV[2]) end
redis.call('HSET', KEYS[6], ARGV[3], ARGV[4])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[7], ARGV[5], ARGV[3]) end
redis.call('HSET', KEYS[5], 'worker', ARGV[6])
if ARGV[8] ~= '' then
  redis.call('HSET', KEYS[9], ARGV[3], ARGV[8])
  if ARGV[9] ~= '-1' then redis.call('HDEL', KEYS[9], ARGV[9]) end
end
if ARGV[10] ~= '' then redis.call('HSET', KEYS[10], ARGV[10], ARGV[11]) end
for i = 5, 10 do redis.call('EXPIRE', KEYS[i], ARGV[7]) end
return 1
"""

_DROP_IF_OWNER = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
"""

# renew leases only for their holders (a replica waiting to resume must not keep a dead one's alive), many
# at once: KEYS owner keys, ARGV lease ms then one holder per key; 1 or 0 per key
_RENEW_MANY = """
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i + 1] then out[i] = redis.call('PEXPIRE', key, ARGV[1]) else out[i] = 0 end
end
return out
"""
RENEW_BATCH = 256  # leases per renewal call


# open -> finishing: store the event and queue the publication; a retried finish gets the stored event
_BEGIN_FINISH = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {'missing', ''} end
if st == 'open' then
  redis.call('HSET', KEYS[1], 'status', 'finishing', 'reward', ARGV[1], 'finishing_at', ARGV[3])
  redis.call('SET', KEYS[2], ARGV[2])
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[4])
  return {'finishing', ARGV[2]}
end
if st == 'finishing' then return {'finishing', redis.call('GET', KEYS[2]) or ''} end
return {st, ''}
"""

# the alias of a raw digest, and the cached token path of the turn it names
_FOLLOW = """
local a = redis.call('HGET', KEYS[1], ARGV[1])
if not a then return false end
return {a, redis.call('HGET', KEYS[2], string.match(a, '^(%S+)')) or false}
"""

# take a lapsed lease, or renew one's own
_CLAIM = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# A running request's state is written only by its lease's holder (or, while nobody holds the lease,
# by the replica that finds it lapsed), and only while the request runs: a replica that was paused
# past its lease (SIGSTOP, a stalled host) must not write a request another replica took over or
# finished. KEYS: owner, request state[, deltas]
_HOLD = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: owner, state, deltas, done. ARGV: owner, ttl s, the state to begin with ('' none: the request
# runs), records. Beginning, the request must have neither a state (another handling began it) nor a result.
_APPEND_IF_HOLDER = """
if ARGV[3] == '' then
  if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
elseif redis.call('EXISTS', KEYS[2], KEYS[4]) > 0 then return 0 end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
if ARGV[3] ~= '' then redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[2]) end
if #ARGV > 3 then
  redis.call('RPUSH', KEYS[3], unpack(ARGV, 4))
  redis.call('EXPIRE', KEYS[3], ARGV[2])
end
return 1
"""

_RELEASE_IF_OWNER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

FINISHING = "sf:finishing"
SESSION_PARTS = ("", "turns", "idx", "seq", "path", "alias")  # a session's keys, which expire together


class Store:
    def __init__(self, client: aioredis.Redis, ttl: int, line: RedisLine | None = None,
                 wait: tuple[int, int] = (0, 0)):
        self.r = client
        self.ttl = ttl
        self.line = line
        # (replicas, ms): a turn's save and a finish's stored event WAIT for that many replicas (issue 30)
        self.wait_replicas, self.wait_ms = wait
        self.under_replicated = 0  # writes acknowledged after WAIT timed out short of wait_replicas
        self._follow = client.register_script(_FOLLOW)
        # every turn's two calls (lookup, save) on the pipelined line where there is one (shared/redisline.py:
        # half redis-py's CPU a call); the rest through the pool
        hot = line.script if line is not None else client.register_script
        self._lookup = hot(_LOOKUP)
        self._save_turn = hot(_SAVE_TURN)
        # a turn's other scripts by their digest too (EVALSHA: the body is not sent and hashed at each call;
        # after a Redis restart redis-py loads it again on NOSCRIPT)
        self._renew_many = client.register_script(_RENEW_MANY)
        self._append = client.register_script(_APPEND_IF_HOLDER)
        self._hold = client.register_script(_HOLD)
        self._drop = client.register_script(_DROP_IF_OWNER)

    @classmethod
    def connect(cls, url: str, ttl: int, max_connections: int = POOL_SIZE, wait: tuple[int, int] = (0, 0),
                tls: TlsFiles | None = None) -> "Store":
        # One retry on a fresh connection after a connection error, never after a timeout (the
        # command may have run). Without it every pooled connection, after a Redis restart, failed
        # its next command with a 503, minutes later (found by tests/faults).
        # A blocking pool: a command waits (up to POOL_WAIT) for one of `max_connections` connections.
        # redis-py's default pool fails the 101st concurrent command at once ("Too many connections"):
        # with 200 agents in flight bench/load.py saw one turn or session call in three fail with a 503.
        # Waiters are served in order (shared/redispool.py): redis-py's blocking pool let newcomers
        # overtake, and at 500 agents some waits passed POOL_WAIT while the median was well under 1 s.
        pool = pool_from_url(
            url, tls=tls, max_connections=max_connections, timeout=POOL_WAIT,
            socket_timeout=5, socket_connect_timeout=3, health_check_interval=10,
            retry=Retry(ConstantBackoff(0.05), 1, supported_errors=(RedisConnectionError,)),
        )
        return cls(aioredis.Redis.from_pool(pool), ttl, RedisLine.from_url(url, timeout=5, connect_timeout=3, tls=tls),
                   wait)

    def _replicated(self, what: str, acked: int) -> None:
        if acked < self.wait_replicas:
            self.under_replicated += 1
            _warn(f"wait:{what}", "Redis WAIT: %s reached %d of %d replicas within %d ms; acknowledged anyway "
                  "(a failover now could lose it: docs/reliability.md)", what, acked, self.wait_replicas, self.wait_ms)

    async def close(self) -> None:
        if self.line is not None:
            await self.line.close()
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
            if not anonymous:
                p.zadd(OPEN, {sid: meta["created"]})
            await p.execute()
        return sid

    async def count_open(self, newer_than: float) -> int:
        return int(await self.r.zcount(OPEN, newer_than, "+inf"))

    async def lookup(self, rid: str, sid: str, follow: str = "", owner: str = "", lease_ms: int = 0) -> "Lookup":
        """Everything a new request needs to know, in one round trip: a finished result (a
        retry), a running request's state (a resume), the session, a fresh turn id (ids of
        requests that fail or turn out to be retries are skipped: ids only increase) and, given
        a raw digest to `follow`, what `follow` would find for it. With `owner`, a new request's
        lease is taken for `lease_ms` (Lookup.leased; False: another handling holds it)."""
        keys = [f"sf:done:{rid}", f"sf:req:{rid}", f"sf:req:{rid}:owner"]
        follow = follow if sid else ""
        if sid:
            keys += [_k(sid), _k(sid, "seq")] + ([_k(sid, "alias"), _k(sid, "path")] if follow else [])
        out = await self._lookup(keys=keys, args=[owner, lease_ms, follow])
        done, raw_state = out[:2]
        state = _inflight_dec.decode(raw_state) if raw_state is not None else None
        return Lookup(
            done=done,
            state=state,
            meta=_meta(sid, dict(zip(out[3][::2], out[3][1::2]))) if sid else None,
            turn_id=int(out[4]) - 1 if sid else -1,
            session_id=state.session_id if state is not None else sid,
            follow=follow,
            followed=_followed(out[5], out[6]) if len(out) > 5 else None,
            leased=bool(out[2]),
        )

    async def session(self, sid: str) -> dict[str, Any]:
        return _meta(sid, await self.r.hgetall(_k(sid)))


    async def follow(self, sid: str, raw: str) -> Followed | None:
        """The turn whose request messages had raw digest `raw`, with its cached token path."""
        found = await self._follow(keys=[_k(sid, "alias"), _k(sid, "path")], args=[raw])
        return _followed(*found) if found else None

    async def path(self, sid: str, tid: int) -> TokenPath | None:
        """The cached token path of a leaf turn (None: walk the turns)."""
        raw = await self.r.hget(_k(sid, "path"), str(tid))
        return TokenPath.from_raw(raw) if raw else None

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

    async def done(self, rid: str) -> bytes | None:
        """The ChatDone of a finished request, if it finished."""
        return await self.r.get(f"sf:done:{rid}")

    async def load_request(self, rid: str) -> tuple[InFlight, list[DeltaRecord]] | None:
        async with self.r.pipeline(transaction=True) as p:
            p.get(f"sf:req:{rid}")
            p.lrange(f"sf:req:{rid}:deltas", 0, -1)
            state, deltas = await p.execute()
        if state is None:
            return None
        return _inflight_dec.decode(state), [_delta_dec.decode(d) for d in deltas]

    async def claim_request(self, rid: str, owner: str, lease_ms: int) -> bool:
        """Take over a request whose lease lapsed (its replica died). False if it is still held."""
        current = await self.r.get(f"sf:req:{rid}:owner")
        if current is not None and current.decode() != owner:
            return False
        return bool(await self.r.set(f"sf:req:{rid}:owner", owner, px=lease_ms, nx=current is None, xx=current is not None))

    async def renew_lease(self, rid: str, owner: str, lease_ms: int) -> bool:
        """Extend `owner`'s lease; False (and nothing changed) if another replica holds it."""
        return (await self.renew_leases([(rid, owner)], lease_ms))[0]

    async def renew_leases(self, leases: list[tuple[str, str]], lease_ms: int) -> list[bool]:
        """renew_lease for each (request id, owner), in one call per RENEW_BATCH: whether each was renewed."""
        out: list[bool] = []
        for i in range(0, len(leases), RENEW_BATCH):
            part = leases[i:i + RENEW_BATCH]
            got = await self._renew_many(keys=[f"sf:req:{rid}:owner" for rid, _ in part],
                                         args=[lease_ms, *(owner for _, owner in part)])
            out += [bool(x) for x in got]
        return out

    async def append_deltas(self, rid: str, recs: list[DeltaRecord], owner: str, begin: InFlight | None = None) -> bool:
        """Append to a running request's deltas if `owner` holds its lease (or nobody does);
        False, and nothing written, if another replica holds it or the request ended. With `begin`
        (a new request's first tokens), its state is written first, in the same call: False if
        another handling began the request or finished it."""
        keys = [f"sf:req:{rid}:owner", f"sf:req:{rid}", f"sf:req:{rid}:deltas", f"sf:done:{rid}"]
        state = _turn_enc.encode(begin) if begin is not None else b""
        return bool(await self._append(keys=keys, args=[owner, REQUEST_TTL, state,
                                                        *(_turn_enc.encode(r) for r in recs)]))

    async def hold(self, rid: str, owner: str, lease_ms: int) -> bool:
        """Renew `owner`'s lease on a running request (or take it if it lapsed) for `lease_ms`;
        False if another replica holds it or the request ended (finished by another)."""
        return bool(await self._hold(keys=[f"sf:req:{rid}:owner", f"sf:req:{rid}"], args=[owner, lease_ms]))

    async def drop_request(self, rid: str, owner: str) -> bool:
        """Forget a running request, if `owner` still holds its lease (or nobody does): a replica
        that lost the lease must not delete the state its new owner continues from."""
        keys = [f"sf:req:{rid}:owner", f"sf:req:{rid}", f"sf:req:{rid}:deltas"]
        return bool(await self._drop(keys=keys, args=[owner]))

    # -- turns -------------------------------------------------------------------------------------

    async def save_turn(  # noqa: PLR0913  one per input of the save script, all but three named at each call
            self, sid: str, turn: Turn, worker: str, result: bytes = b"",
            path: TokenPath | None = None, alias: tuple[str, Alias] | None = None,
            owner: str = "", began: bool = True) -> bool:
        """The turn, its index entry, the request's result (for a retried request) and the end
        of its partial state: all or nothing. `path` (the turn's whole token path) replaces
        its parent's cached path; `alias` is (raw digest of the request messages, what it names).
        With `owner`, only if `owner` still holds the request's lease (or nobody does) and the request
        still runs, as `hold` checks: False, and nothing written, if not. One round trip for both.
        `began`: the request's state was written (append_deltas' `begin`); a request never begun must
        have neither a state nor a result."""
        rid = turn.request_id
        keys = [f"sf:req:{rid}", f"sf:req:{rid}:deltas", f"sf:req:{rid}:owner", f"sf:done:{rid}",
                *(_k(sid, part) for part in SESSION_PARTS)]
        digest, value = (alias[0], alias[1].encode()) if alias is not None else ("", "")
        args = [result, REQUEST_TTL, turn.turn_id, _turn_enc.encode(turn), turn.key, worker, self.ttl,
                path.raw if path is not None else b"", turn.parent, digest, value, owner, "1" if began else "0"]
        if not self.wait_replicas:
            return bool(await self._save_turn(keys=keys, args=args))
        # WAIT counts the writes of its own connection: on the line, after the save (which may have been
        # loaded and run again on NOSCRIPT); turns pipelined behind it wait for the replica too
        if self.line is not None:
            saved = await self._save_turn(keys=keys, args=args)
            acked = await self.line.execute("WAIT", self.wait_replicas, self.wait_ms)
        else:
            async with self.r.pipeline(transaction=False) as p:
                p.eval(_SAVE_TURN, len(keys), *keys, *args)
                p.execute_command("WAIT", self.wait_replicas, self.wait_ms)
                saved, acked = await p.execute()
        self._replicated("a turn's save", int(acked))
        return bool(saved)

    async def set_reward(self, sid: str, reward: float) -> None:
        meta = await self.session(sid)
        if meta["status"] != "open":
            raise SessionFinished(sid)
        await self.r.hset(_k(sid), "reward", repr(float(reward)))

    # -- finishing: the publication of a session's TrajectoryCompleted ------------------------------

    async def begin_finish(self, sid: str, reward: float, event: bytes) -> tuple[str, bytes]:
        """open -> finishing with `event` stored and queued. Returns the status after the call and the
        event to publish: ("finishing", the stored event, which a retried finish reuses), ("finished",
        b"") or ("missing", b"")."""
        now = time.time()
        args = (_BEGIN_FINISH, 3, _k(sid), _k(sid, "event"), FINISHING, repr(float(reward)), event, now, sid)
        if not self.wait_replicas:
            st, raw = await self.r.eval(*args)
        else:  # the stored event reaches a replica before the finish is answered
            async with self.r.pipeline(transaction=False) as p:
                p.eval(*args)
                p.execute_command("WAIT", self.wait_replicas, self.wait_ms)
                (st, raw), acked = await p.execute()
            self._replicated("a finish's event", int(acked))
        return st.decode(), raw or b""

    async def finishing_event(self, sid: str) -> bytes | None:
        return await self.r.get(_k(sid, "event"))

    async def claim_finish(self, sid: str, owner: str, lease_ms: int) -> bool:
        """Take (or renew) the lease on publishing `sid`; False while another live replica holds it."""
        return bool(await self.r.eval(_CLAIM, 1, f"sf:fin:{sid}:owner", owner, lease_ms))

    async def release_finish(self, sid: str, owner: str) -> None:
        await self.r.eval(_RELEASE_IF_OWNER, 1, f"sf:fin:{sid}:owner", owner)

    async def finish_published(self, sid: str) -> None:
        """finishing -> finished: the event is durable in the stream."""
        async with self.r.pipeline(transaction=True) as p:
            p.hset(_k(sid), mapping={"status": "finished", "finished_at": time.time()})
            p.zrem(OPEN, sid)
            p.zrem(FINISHING, sid)
            p.delete(_k(sid, "event"), f"sf:fin:{sid}:owner")
            for part in SESSION_PARTS:
                p.expire(_k(sid, part), self.ttl)
            await p.execute()

    async def pending_finishes(self, limit: int) -> list[str]:
        """The oldest finishing sessions, first come first published."""
        return [m.decode() for m in await self.r.zrange(FINISHING, 0, limit - 1)]

    async def count_finishing(self) -> int:
        return int(await self.r.zcard(FINISHING))
