"""Every retryable 503 the gateway answers carries Retry-After (issue 30): a turn's ChatFailed
503 (redis_unavailable, overloaded, no worker) and a session op's 503 from the trajectory manager."""

from __future__ import annotations

import pytest

from services.gateway.chat import failed
from services.gateway.errors import ApiError
from services.gateway.sessions import _check
from shared.messages.chat import ChatFailed
from shared.messages.session import SessionReply


@pytest.mark.parametrize("code", ["redis_unavailable", "nats_unavailable", "overloaded", ""])
def test_a_failed_turn_503_says_when_to_retry(code):
    e = failed(ChatFailed("r1", 503, code, "down"))
    assert e.status == 503 and e.headers["retry-after"] == "1"
    assert not (failed(ChatFailed("r1", 400, "bad", "no")).headers or {}).get("retry-after")


@pytest.mark.parametrize("reply", [SessionReply(503, message="Redis is unreachable"),
                                   SessionReply(503, message="x", retry_after=1.0, code="redis_unavailable")])
def test_a_session_op_503_says_when_to_retry(reply):
    with pytest.raises(ApiError) as info:
        _check(reply, "s1")
    assert info.value.status == 503 and info.value.headers["retry-after"] == "1"
