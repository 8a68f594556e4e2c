"""One leading scheduler among several: a lease in Redis with a term (issue 30).

    sf:sched:leader  string "<instance>:<term>", PX lease: who leads, until when
    sf:sched:term    counter: +1 at every change of leader

An instance leads while it holds the lease, renewing it every `lease_s / 3`. A standby tries to take
it every `POLL_S`; when the leader dies, the lease runs out and a standby leads within `lease_s +
POLL_S` (3.5 s by default), rebuilding from the registry in Redis as a restart does. A leader that
cannot renew (Redis away, or paused past its lease) stops deciding once its own lease has run out
by its clock, before any standby can hold it, and quits if another took over.

Fencing: each term's assignments carry the term in the epoch's bits above `TERM_SHIFT`
(`first_epoch`), so any assignment of a new leader is newer than every one of the old leader's,
and the leader announces its term on `sf.sched.leader`; a host agent ignores an assignment whose
term is older than the newest it has seen (host.py), so a deposed leader's late assignment is never
applied once the new leader has spoken.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

LEADER_KEY = "sf:sched:leader"
TERM_KEY = "sf:sched:term"
TERM_SHIFT = 32
POLL_S = 0.5  # a standby's tries at the lease

# take the lease if nobody holds it (a new term), or renew our own; returns the term, or 0
_ACQUIRE = """
local held = redis.call('GET', KEYS[1])
if held then
  local inst, term = string.match(held, '^(.*):(%d+)$')
  if inst == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(term)
  end
  return 0
end
local term = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. term, 'PX', ARGV[2])
return term
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def term_of(epoch: int) -> int:
    return epoch >> TERM_SHIFT


def first_epoch(term: int) -> int:
    """The epoch a host's records start from in `term`: above every epoch of earlier terms."""
    return term << TERM_SHIFT


class Lease:
    def __init__(self, r: aioredis.Redis, instance: str, lease_s: float = 3.0,
                 clock=time.monotonic) -> None:
        self.r, self.instance, self.lease_s, self.clock = r, instance, lease_s, clock
        self.term = 0
        self.valid_until = 0.0  # by our clock: we lead until then without renewing
        self._acquire = r.register_script(_ACQUIRE)
        self._renew = r.register_script(_RENEW)
        self._release = r.register_script(_RELEASE)

    @property
    def value(self) -> str:
        return f"{self.instance}:{self.term}"

    @property
    def leading(self) -> bool:
        return self.term > 0 and self.clock() < self.valid_until

    def due(self) -> bool:
        """Time to renew (a third of the lease has passed since the last renewal)."""
        return self.clock() >= self.valid_until - self.lease_s * 2 / 3

    async def try_acquire(self) -> bool:
        t0 = self.clock()
        term = int(await self._acquire(keys=[LEADER_KEY, TERM_KEY], args=[self.instance, int(self.lease_s * 1000)]))
        if term:
            self.term, self.valid_until = term, t0 + self.lease_s
        return bool(term)

    async def renew(self) -> bool:
        """True while we still hold it; False once another instance does (or it ran out and was taken)."""
        t0 = self.clock()
        if await self._renew(keys=[LEADER_KEY], args=[self.value, int(self.lease_s * 1000)]):
            self.valid_until = t0 + self.lease_s
            return True
        self.valid_until = 0.0
        return False

    async def release(self) -> None:
        if self.term:
            await self._release(keys=[LEADER_KEY], args=[self.value])
            self.valid_until = 0.0

    async def holder(self) -> str | None:
        raw = await self.r.get(LEADER_KEY)
        return raw.decode() if raw else None
