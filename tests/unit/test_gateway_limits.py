"""services/gateway/limits.py: the per-tenant rate and concurrency limits and a turn's size (pure)."""

from __future__ import annotations

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.limits import LimitExceeded, Limiter, TenantLimits, TurnLimits, check_turn
from shared.messages.chat import ChatRequest
from shared.messages.rollout import Sampling


def refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


def test_the_rate_is_a_token_bucket_per_tenant():
    lim = Limiter(rate=2.0, burst=3, concurrent=0)
    for _ in range(3):
        lim.check_rate("a", 100.0)  # the burst
    e = refused(lim.check_rate, "a", 100.0)
    assert isinstance(e, LimitExceeded) and (e.status, e.code, e.type) == (429, "rate_limit_exceeded",
                                                                          "rate_limit_error")
    assert e.headers == {"retry-after": "1"} and e.retry_after == pytest.approx(0.5)
    lim.check_rate("b", 100.0)  # another tenant has its own bucket
    lim.check_rate("a", 100.5)  # half a second: one more token
    refused(lim.check_rate, "a", 100.5)
    lim.check_rate("a", 200.0)


def test_retry_after_is_whole_seconds_and_never_zero():
    lim = Limiter(rate=0.1, burst=1, concurrent=0)
    lim.check_rate("a", 0.0)
    assert refused(lim.check_rate, "a", 0.0).headers["retry-after"] == "10"


def test_concurrency_counts_turns_in_flight_and_a_permit_releases_once():
    lim = Limiter(rate=0, burst=0, concurrent=2)
    p1, p2 = lim.acquire("a", 0.0), lim.acquire("a", 0.0)
    e = refused(lim.acquire, "a", 0.0)
    assert (e.status, e.code, e.headers) == (429, "too_many_concurrent_requests", {"retry-after": "1"})
    lim.acquire("b", 0.0)
    p1.release()
    p1.release()  # idempotent: the second call gives nothing back
    assert lim.in_flight("a") == 1
    p3 = lim.acquire("a", 0.0)
    refused(lim.acquire, "a", 0.0)
    p2.release()
    p3.release()
    assert lim.in_flight("a") == 0


def test_zero_turns_a_limit_off():
    lim = Limiter(rate=0, burst=0, concurrent=0)
    for _ in range(10_000):
        lim.check_rate("a", 0.0)
        lim.acquire("a", 0.0)
    assert lim.in_flight("a") == 0


def test_idle_tenants_are_forgotten_and_busy_or_draining_ones_kept():
    lim = Limiter(rate=1.0, burst=1, concurrent=5, max_tenants=3)
    busy = lim.acquire("busy", 0.0)
    lim.check_rate("a", 0.0)
    lim.check_rate("b", 0.0)  # both buckets empty at t=0
    lim.check_rate("c", 0.5)  # full table: nobody is idle yet (half-refilled buckets are kept)
    assert set(lim._tenants) == {"busy", "a", "b", "c"}
    lim.check_rate("d", 100.0)  # every bucket but the busy tenant's is full again: forgotten
    assert set(lim._tenants) == {"busy", "d"} and lim.in_flight("busy") == 1
    busy.release()


def test_a_tenants_own_limits_override_the_defaults_field_by_field():
    lim = Limiter(rate=1000.0, burst=1000, concurrent=1000)
    low = TenantLimits(rate_limit=1.0, rate_burst=2, max_concurrent=1)
    lim.check_rate("low", 0.0, low)
    lim.check_rate("low", 0.0, low)
    e = refused(lim.check_rate, "low", 0.0, low)
    assert (e.status, e.code, e.headers) == (429, "rate_limit_exceeded", {"retry-after": "1"})
    assert "more than 1 requests per second" in e.message
    permit = lim.acquire("low", 0.0, low)
    e = refused(lim.acquire, "low", 0.0, low)
    assert (e.status, e.code, e.headers) == (429, "too_many_concurrent_requests", {"retry-after": "1"})
    permit.release()
    for _ in range(500):  # another tenant, on the defaults, is not held to them
        lim.check_rate("other", 0.0)
        lim.acquire("other", 0.0)
    # a field left out is the default: here only the concurrency is the tenant's own
    only = TenantLimits(max_concurrent=0)
    for _ in range(1000):
        lim.check_rate("unbounded turns", 0.0, only)
        lim.acquire("unbounded turns", 0.0, only)  # 0: off, as in the settings
    refused(lim.check_rate, "unbounded turns", 0.0, only)  # the default burst of 1000 still holds
    high = TenantLimits(rate_limit=1e6, rate_burst=10**6, max_concurrent=10**6)
    for _ in range(5000):  # above the defaults
        lim.check_rate("high", 0.0, high)
        lim.acquire("high", 0.0, high)


def test_the_defaults_admit_4096_agents_of_one_job_and_still_bound_a_runaway_client():
    cfg = GatewayConfig()
    lim = Limiter(cfg.rate_limit, cfg.rate_burst, cfg.max_concurrent)
    agents = 4096
    # every agent at once: it opens its session, then its first turn is in flight
    for _ in range(agents):
        lim.check_rate("job", 0.0)
    permits = []
    for _ in range(agents):
        lim.check_rate("job", 0.0)
        permits.append(lim.acquire("job", 0.0))
    assert lim.in_flight("job") == agents
    # then a turn each every half second, for 30 s: one ends, the next begins (a session's finish
    # and the next creation are two more requests every 6 turns): ~11,000 requests/s
    for step in range(1, 61):
        now = step * 0.5
        for i in range(agents):
            permits[i].release()
            lim.check_rate("job", now)
            permits[i] = lim.acquire("job", now)
            if i % 6 == step % 6:
                lim.check_rate("job", now)
                lim.check_rate("job", now)
    assert lim.in_flight("job") == agents
    # a client in a tight loop is stopped once it has spent the burst and the second's refill
    with pytest.raises(LimitExceeded):
        for _ in range(cfg.rate_burst + int(cfg.rate_limit) + 1):
            lim.check_rate("runaway", 1000.0)
    with pytest.raises(LimitExceeded):
        for _ in range(cfg.max_concurrent + 1):
            lim.acquire("runaway", 1000.0)


def test_a_key_record_carries_its_limits_and_an_old_record_reads_as_the_defaults():
    import msgspec

    from services.gateway.store import KeyRecord

    record = KeyRecord(kind="user", name="job-7", limits=TenantLimits(max_concurrent=16))
    raw = msgspec.json.encode(record)
    assert b'"limits":{"max_concurrent":16}' in raw  # the fields not set are not stored
    assert msgspec.json.decode(raw, type=KeyRecord) == record
    old = msgspec.json.decode(b'{"kind": "session", "session_id": "s", "owner": "abc"}', type=KeyRecord)
    assert old.limits is None
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"kind": "user", "limits": {"max_concurrent": -1}}', type=KeyRecord)


def turn(messages: int = 1, tools: int = 0, max_tokens: int = 16) -> ChatRequest:
    return ChatRequest("r", "", "chat", "m", Sampling(max_tokens=max_tokens),
                       messages=[{"role": "user", "content": "x"}] * messages,
                       tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(tools)])


@pytest.mark.parametrize("req,api,param,code", [
    (turn(messages=5), "chat", "messages", "too_many_messages"),
    (turn(messages=5), "response", "input", "too_many_messages"),
    (turn(tools=3), "chat", "tools", "too_many_tools"),
    (turn(max_tokens=101), "chat", "max_tokens", "max_tokens_too_large"),
    (turn(max_tokens=101), "response", "max_output_tokens", "max_tokens_too_large"),
])
def test_a_turn_over_a_size_limit_is_a_400_naming_the_field(req, api, param, code):
    e = refused(check_turn, req, TurnLimits(max_messages=4, max_tools=2, max_tokens=100), api)
    assert (e.status, e.param, e.code) == (400, param, code)


def test_a_turn_at_the_limits_passes_and_zero_is_off():
    check_turn(turn(messages=4, tools=2, max_tokens=100), TurnLimits(4, 2, 100), "chat")
    check_turn(turn(messages=500, tools=500, max_tokens=10**6), TurnLimits(), "chat")


def test_secrets_are_compared_in_constant_time_and_api_keys_by_hash(monkeypatch):
    """The admin key (the one secret compared as such) goes through hmac.compare_digest on
    equal-length digests; an API key is found by its SHA-256, never compared."""
    import hmac

    from services.gateway import edge
    from services.gateway.store import KeyStore, digest

    seen = []
    real = hmac.compare_digest
    monkeypatch.setattr(edge.hmac, "compare_digest", lambda a, b: seen.append((len(a), len(b))) or real(a, b))
    assert edge.same_secret("admin-key", "admin-key")
    assert not edge.same_secret("admin", "admin-key") and not edge.same_secret("", "")
    assert seen == [(32, 32), (32, 32)]
    store = KeyStore("redis://127.0.0.1:1/0", ["sk-static"], 1.0, 60)
    assert set(store.static) == {digest("sk-static")}  # only the hash is kept
