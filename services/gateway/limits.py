"""What one tenant may ask of the gateway: a request rate, turns in flight, and the size of a turn.

A tenant is a user API key together with the session keys it minted (`KeyRecord.owner`), so a
user cannot escape its limits by opening more sessions. Pure: no I/O, the clock is an argument.

    limiter = Limiter(rate=1000, burst=2000, concurrent=1024)
    limiter.check_rate(tenant, now)          # every authenticated request; LimitExceeded -> 429
    permit = limiter.acquire(tenant)         # a turn, from validation to its last byte
    ...
    permit.release()                         # idempotent

The limiter is per gateway process: N gateway replicas allow N times the rate. It knows nothing of
HTTP beyond its error: LimitExceeded is the 429 (with Retry-After) the agent gets; `check_turn`
refuses a turn bigger than the settings allow (a 400 naming the field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from services.gateway.errors import ApiError
from shared.messages.chat import ChatRequest

MAX_TENANTS = 100_000  # tenants remembered; idle ones (full bucket, nothing in flight) are dropped past it


class LimitExceeded(ApiError):
    """429, OpenAI-shaped, with Retry-After in whole seconds (never 0): the SDK waits that long and
    retries by itself."""

    def __init__(self, kind: Literal["rate", "concurrency"], limit: float, retry_after: float) -> None:
        what = (f"more than {limit:g} requests per second" if kind == "rate"
                else f"more than {limit:g} requests in flight")
        wait = max(1, math.ceil(retry_after))
        super().__init__(429, f"this API key (with its sessions' keys) sent {what}; retry after {wait}s",
                         "rate_limit_exceeded" if kind == "rate" else "too_many_concurrent_requests",
                         headers={"retry-after": str(wait)})
        self.kind = kind
        self.retry_after = retry_after


@dataclass
class _Tenant:
    tokens: float
    stamp: float
    in_flight: int = 0


@dataclass
class Permit:
    """A turn's place in its tenant's concurrency; `release` gives it back once, however often called."""

    limiter: "Limiter | None"
    tenant: str
    _done: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._done and self.limiter is not None:
            self._done = True
            self.limiter.release(self.tenant)


class Limiter:
    """A token bucket (`rate` per second, up to `burst`) and a cap on turns in flight, per tenant.
    0 turns a limit off."""

    # how long a refused turn is told to wait: a turn takes about this long to free its place
    CONCURRENCY_RETRY_AFTER = 1.0

    def __init__(self, rate: float, burst: float, concurrent: int, max_tenants: int = MAX_TENANTS) -> None:
        self.rate = rate
        self.burst = max(burst, 1.0)
        self.concurrent = concurrent
        self.max_tenants = max_tenants
        self._tenants: dict[str, _Tenant] = {}

    def _get(self, tenant: str, now: float) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            if len(self._tenants) >= self.max_tenants:
                self._forget_idle(now)
            t = self._tenants[tenant] = _Tenant(self.burst, now)
        return t

    def _forget_idle(self, now: float) -> None:
        self._tenants = {k: t for k, t in self._tenants.items()
                         if t.in_flight or self._refilled(t, now) < self.burst}

    def _refilled(self, t: _Tenant, now: float) -> float:
        return min(self.burst, t.tokens + max(0.0, now - t.stamp) * self.rate)

    def check_rate(self, tenant: str, now: float) -> None:
        """Take one token from the tenant's bucket, or raise LimitExceeded (how long until one is there)."""
        if self.rate <= 0:
            return
        t = self._get(tenant, now)
        t.tokens, t.stamp = self._refilled(t, now), now
        if t.tokens < 1.0:
            raise LimitExceeded("rate", self.rate, (1.0 - t.tokens) / self.rate)
        t.tokens -= 1.0

    def acquire(self, tenant: str, now: float) -> Permit:
        """A place among the tenant's turns in flight, or LimitExceeded."""
        if self.concurrent <= 0:
            return Permit(None, tenant)
        t = self._get(tenant, now)
        if t.in_flight >= self.concurrent:
            raise LimitExceeded("concurrency", self.concurrent, self.CONCURRENCY_RETRY_AFTER)
        t.in_flight += 1
        return Permit(self, tenant)

    def release(self, tenant: str) -> None:
        t = self._tenants.get(tenant)
        if t is not None and t.in_flight > 0:
            t.in_flight -= 1

    def in_flight(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return t.in_flight if t is not None else 0


# --- the size of one turn ----------------------------------------------------------------------

@dataclass(frozen=True)
class TurnLimits:
    """0 turns a limit off."""

    max_messages: int = 0
    max_tools: int = 0
    max_tokens: int = 0  # the largest max_tokens (max_completion_tokens, max_output_tokens) a turn may ask


# the body's name of each limited quantity, per API (a Responses body calls messages `input`)
_PARAMS = {"chat": ("messages", "tools", "max_tokens"), "completion": ("prompt", "tools", "max_tokens"),
           "response": ("input", "tools", "max_output_tokens")}


def check_turn(chat: ChatRequest, limits: TurnLimits, api: Literal["chat", "completion", "response"]) -> None:
    """Refuse a turn larger than `limits` with a 400 that names the field."""
    messages, tools, max_tokens = _PARAMS[api]
    if limits.max_messages and len(chat.messages) > limits.max_messages:
        raise ApiError(400, f"{len(chat.messages)} messages is more than this gateway accepts in one request "
                            f"({limits.max_messages}, SF_GATEWAY_MAX_MESSAGES)", "too_many_messages", messages)
    if limits.max_tools and len(chat.tools) > limits.max_tools:
        raise ApiError(400, f"{len(chat.tools)} tools is more than this gateway accepts in one request "
                            f"({limits.max_tools}, SF_GATEWAY_MAX_TOOLS)", "too_many_tools", tools)
    if limits.max_tokens and chat.sampling.max_tokens > limits.max_tokens:
        raise ApiError(400, f"{max_tokens}={chat.sampling.max_tokens} is more than this gateway allows "
                            f"({limits.max_tokens}, SF_GATEWAY_MAX_TOKENS_LIMIT)", "max_tokens_too_large", max_tokens)
