"""seamlessflow/demo/workload.py: the agents' session calls try a retryable answer again only as often as
`Load.retries` says (the gateway is a stand-in: httpx's MockTransport)."""

from __future__ import annotations

import httpx
import pytest

from seamlessflow.demo.workload import GroupAgents, Load


def gateway(answers: list[int]):
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        status = answers.pop(0) if answers else 200
        headers = {"retry-after": "0"} if status in (429, 503) else {}
        return httpx.Response(status, json={"id": "s1", "api_key": "k"}, headers=headers)

    return httpx.AsyncClient(base_url="http://gw", transport=httpx.MockTransport(handle)), seen


async def test_a_retryable_answer_is_tried_again_up_to_retries():
    agents = GroupAgents("http://gw/v1", "key", Load(retries=2))
    http, seen = gateway([503, 429])
    async with http:
        r = await agents._post(http, "/sessions", {"group_id": "g"})
    assert r.status_code == 200 and len(seen) == 3 and agents.retried == 2


async def test_past_its_retries_or_not_retryable_it_fails():
    agents = GroupAgents("http://gw/v1", "key", Load(retries=1))
    http, seen = gateway([503, 503])
    async with http:
        with pytest.raises(httpx.HTTPStatusError):
            await agents._post(http, "/sessions", {"group_id": "g"})
    assert len(seen) == 2
    none = GroupAgents("http://gw/v1", "key", Load())  # the default: every error is a failure at once
    http, seen = gateway([503])
    async with http:
        with pytest.raises(httpx.HTTPStatusError):
            await none._post(http, "/sessions", {"group_id": "g"})
    assert len(seen) == 1
    http, seen = gateway([404])
    async with http:
        with pytest.raises(httpx.HTTPStatusError):
            await agents._post(http, "/sessions", {"group_id": "g"})
    assert len(seen) == 1  # not retryable


def test_a_session_calls_retry_waits_its_retry_after_within_5_s_and_1_s_without_one():
    from seamlessflow.demo.workload import retry_delay

    assert [retry_delay(h, low=0.0, high=5.0, default=1.0) for h in ("2", "0", "60", None, "", "soon")] == \
        [2.0, 0.0, 5.0, 1.0, 1.0, 1.0]
