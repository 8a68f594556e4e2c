"""What one tenant may ask of the gateway: a request rate, turns in flight, and the size of a turn.

A tenant is a user API key together with the session keys it minted (`KeyRecord.owner`), so a
user cannot escape its limits by opening more sessions. Its rate and turns in flight are the
gateway's settings unless its key was minted with its own (`TenantLimits`, POST /admin/keys; a
session key carries its tenant's). Pure: no I/O, the clock is an argument.

    limiter = Limiter(rate=10_000, burst=20_000, concurrent=8192)
    limiter.check_rate(tenant, now, own)     # every authenticated request; LimitExceeded -> 429
    permit = limiter.acquire(tenant, now, own)  # a turn, from validation to its last byte
    ...
    permit.release()                         # idempotent

The limiter is per gateway process: N gateway replicas allow N times the rate. It knows nothing of
HTTP beyond its error: LimitExceeded is the 429 (with Retry-After) the agent gets; `check_turn`
refuses a turn bigger than the settings allow (a 400 naming the field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from services.gateway.errors import ApiError
from shared.messages.chat import ChatRequest

MAX_TENANTS = 100_000  # tenants remembered; idle ones (full bucket, nothing in flight) are dropped past it

NonNegative = msgspec.Meta(ge=0)


class TenantLimits(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One tenant's own limits, stored with its keys (store.KeyRecord). None: the gateway's setting
    (SF_GATEWAY_RATE_LIMIT, _RATE_BURST, _MAX_CONCURRENT); 0: that limit off, as in the settings."""

    rate_limit: Annotated[float, NonNegative] | None = None  # requests per second
    rate_burst: Annotated[int, NonNegative] | None = None  # requests at once after a quiet spell
    max_concurrent: Annotated[int, NonNegative] | None = None  # turns in flight


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
    rate: float  # the bucket's own rate and size, from the tenant's last request
    burst: float
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
    """A token bucket (`rate` per second, up to `burst`) and a cap on turns in flight, per tenant:
    these are the defaults, and a tenant's own `TenantLimits` (passed with each call) override them.
    0 turns a limit off."""

    # how long a refused turn is told to wait: a turn takes about this long to free its place
    CONCURRENCY_RETRY_AFTER = 1.0

    def __init__(self, rate: float, burst: float, concurrent: int, max_tenants: int = MAX_TENANTS) -> None:
        self.rate = rate
        self.burst = max(burst, 1.0)
        self.concurrent = concurrent
        self.max_tenants = max_tenants
        self._tenants: dict[str, _Tenant] = {}

    def _get(self, tenant: str, now: float, rate: float, burst: float) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            if len(self._tenants) >= self.max_tenants:
                self._forget_idle(now)
            t = self._tenants[tenant] = _Tenant(burst, now, rate, burst)
        return t

    def _forget_idle(self, now: float) -> None:
        self._tenants = {k: t for k, t in self._tenants.items()
                         if t.in_flight or self._refilled(t, now) < t.burst}

    @staticmethod
    def _refilled(t: _Tenant, now: float) -> float:
        return min(t.burst, t.tokens + max(0.0, now - t.stamp) * t.rate)

    def check_rate(self, tenant: str, now: float, own: TenantLimits | None = None) -> None:
        """Take one token from the tenant's bucket, or raise LimitExceeded (how long until one is there)."""
        rate, burst = self.rate, self.burst
        if own is not None:
            rate = rate if own.rate_limit is None else own.rate_limit
            burst = burst if own.rate_burst is None else max(own.rate_burst, 1.0)
        if rate <= 0:
            return
        t = self._get(tenant, now, rate, burst)
        t.rate, t.burst = rate, burst
        t.tokens, t.stamp = self._refilled(t, now), now
        if t.tokens < 1.0:
            raise LimitExceeded("rate", rate, (1.0 - t.tokens) / rate)
        t.tokens -= 1.0

    def acquire(self, tenant: str, now: float, own: TenantLimits | None = None) -> Permit:
        """A place among the tenant's turns in flight, or LimitExceeded."""
        limit = self.concurrent if own is None or own.max_concurrent is None else own.max_concurrent
        if limit <= 0:
            return Permit(None, tenant)
        t = self._get(tenant, now, self.rate, self.burst)
        if t.in_flight >= limit:
            raise LimitExceeded("concurrency", limit, self.CONCURRENCY_RETRY_AFTER)
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
