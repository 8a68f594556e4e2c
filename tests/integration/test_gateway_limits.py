"""The gateway's limits over real HTTP (SF_GATEWAY_RATE_LIMIT, _MAX_CONCURRENT, _MAX_MESSAGES, _MAX_TOOLS,
_MAX_TOKENS_LIMIT, _MAX_PROMPT_TOKENS): a 429 with Retry-After in the OpenAI shape, or a 400 naming
the field, alike on chat, completions and responses. The trajectory manager is faked at the NATS
edge (test_gateway_api.FakeTrajectory); the limiter itself is unit-tested in test_gateway_limits.py.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from seamlessflow.stack import servers
from shared.config import Connections
from tests.integration.test_gateway_api import ADMIN_KEY, MODEL, FakeTrajectory, run_gateway, user

pytestmark = pytest.mark.integration

TURNS = {  # one turn of each API, as (path, body)
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": user("hi")}),
    "completion": ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
    "response": ("/v1/responses", {"model": MODEL, "input": "hi"}),
}


@pytest.fixture(scope="module")
def conn(tmp_path_factory, redis_url):
    port = servers.free_port()
    proc = servers.start_nats(port, tmp_path_factory.mktemp("limits-nats"))
    yield Connections(nats_url=f"nats://127.0.0.1:{port}", redis_url=redis_url)
    servers.stop(proc)


@pytest.fixture(scope="module")
async def fake(conn):
    f = await FakeTrajectory(conn.nats_url).start()
    yield f
    await f.stop()


def assert_429(r, code: str) -> None:
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "rate_limit_error",
                                 "param": None, "code": code}


async def test_rate_limit_is_429_with_retry_after_per_tenant(conn, fake):
    async with run_gateway(conn, rate_limit=0.5, rate_burst=4) as gw:
        async with gw.http() as http:
            session_key = (await http.post("/v1/sessions")).json()["api_key"]  # 1
            for api in ("chat", "completion", "response"):  # 2, 3, 4
                path, body = TURNS[api]
                assert (await http.post(path, json=body)).status_code == 200
            for api in ("chat", "completion", "response"):
                path, body = TURNS[api]
                assert_429(await http.post(path, json=body), "rate_limit_exceeded")
            assert_429(await http.get("/v1/models"), "rate_limit_exceeded")
        # the session key the user minted counts against the same tenant: no way around the limit
        async with gw.http(session_key) as own:
            path, body = TURNS["chat"]
            assert_429(await own.post(path, json=body), "rate_limit_exceeded")
        # the SDK sees its usual typed error, and (with retries) would wait Retry-After by itself
        with pytest.raises(openai.RateLimitError) as info:
            await gw.sdk().chat.completions.create(model=MODEL, messages=user("hi"))
        assert info.value.code == "rate_limit_exceeded"
        async with gw.http(key=None) as anon:
            assert (await anon.get("/healthz")).status_code == 200  # not an agent request


async def test_a_key_minted_with_its_own_limits_is_held_to_them_and_its_sessions_too(conn, fake):
    async with run_gateway(conn) as gw, gw.http(ADMIN_KEY, admin=True) as adm:
        r = await adm.post("/admin/keys", json={"name": "low", "rate_limit": 0.5, "rate_burst": 3,
                                                "max_concurrent": 1})
        assert r.status_code == 201, r.text
        assert r.json()["limits"] == {"rate_limit": 0.5, "rate_burst": 3, "max_concurrent": 1}
        low = r.json()["api_key"]
        r = await adm.post("/admin/keys", json={"name": "defaults"})
        cfg = gw.gateway.cfg
        assert r.json()["limits"] == {"rate_limit": cfg.rate_limit, "rate_burst": cfg.rate_burst,
                                      "max_concurrent": cfg.max_concurrent}
        plain = r.json()["api_key"]
        for bad in ({"rate_limit": -1}, {"max_concurrent": 1.5}, {"rate_burst": "many"}):
            r = await adm.post("/admin/keys", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text
        async with gw.http(low) as http:
            session_key = (await http.post("/v1/sessions")).json()["api_key"]  # 1
            path, body = TURNS["chat"]
            assert (await http.post(path, json=body)).status_code == 200  # 2
            assert (await http.post(path, json=body)).status_code == 200  # 3: the burst is spent
            r = await http.post(path, json=body)
            assert_429(r, "rate_limit_exceeded")
            assert r.headers["retry-after"] == "2" and "0.5 requests per second" in r.json()["error"]["message"]
        async with gw.http(session_key) as own:  # the session's key carries its tenant's limits
            assert_429(await own.post(path, json=body), "rate_limit_exceeded")
        async with gw.http(plain) as http:  # a key minted without limits has the gateway's
            for _ in range(10):
                assert (await http.post(path, json=body)).status_code == 200


async def test_concurrency_limit_counts_turns_in_flight_until_they_end(conn, fake):
    async with run_gateway(conn, max_concurrent=1, first_token_timeout=5, idle_timeout=5,
                           silence_timeout=1.0) as gw, gw.http() as http:
        for api, (path, body) in TURNS.items():
            hang = {**body, "stream": True, **({"prompt": "hang " + api} if api == "completion" else
                                                {"input": "hang " + api} if api == "response" else
                                                {"messages": user("hang " + api)})}
            async with http.stream("POST", path, json=hang) as held:
                assert held.status_code == 200
                lines = held.aiter_lines()  # held here: a dropped iterator closes the stream when collected
                async for line in lines:
                    if "thinking" in line:
                        break  # the turn is in flight: its place is taken
                for other in TURNS.values():
                    assert_429(await http.post(other[0], json=other[1]), "too_many_concurrent_requests")
                await lines.aclose()
            # the client left: the turn is cancelled and its place given back
            for _ in range(50):
                if (r := await http.post(path, json=body)).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            assert r.status_code == 200, (api, r.text)
        # a refused or failed turn gives its place back too
        assert (await http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("too long")})
                ).status_code == 400
        assert (await http.post(TURNS["chat"][0], json=TURNS["chat"][1])).status_code == 200
        assert gw.gateway.limiter.in_flight(next(iter(gw.gateway.keys.static.values())).owner) == 0


@pytest.mark.parametrize("api,extra,param,code", [
    ("chat", {"messages": user("x") * 3}, "messages", "too_many_messages"),
    ("response", {"input": [{"role": "user", "content": "x"}] * 5}, "input", "too_many_messages"),
    ("chat", {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3)]}, "tools",
     "too_many_tools"),
    ("response", {"tools": [{"type": "function", "name": f"f{i}"} for i in range(3)]}, "tools", "too_many_tools"),
    ("chat", {"max_tokens": 101}, "max_tokens", "max_tokens_too_large"),
    ("chat", {"max_completion_tokens": 101}, "max_tokens", "max_tokens_too_large"),
    ("completion", {"max_tokens": 101}, "max_tokens", "max_tokens_too_large"),
    ("response", {"max_output_tokens": 101}, "max_output_tokens", "max_tokens_too_large"),
])
async def test_size_limits_are_400_naming_the_field(conn, fake, api, extra, param, code):
    async with run_gateway(conn, max_messages=4, max_tools=2, max_tokens_limit=100, max_tokens_default=64,
                           max_context=4096) as gw:
        path, body = TURNS[api]
        async with gw.http() as http:
            r = await http.post(path, json={**body, **extra})
            assert r.status_code == 400, r.text
            assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
            assert (await http.post(path, json=body)).status_code == 200


async def test_max_prompt_tokens_rides_on_the_request_to_the_trajectory_manager(conn, fake):
    async with run_gateway(conn, max_prompt_tokens=1234) as gw, gw.http() as http:
        for api, (path, body) in TURNS.items():
            text = f"prompt limit {api}"
            body = {**body, **({"prompt": text} if api == "completion" else {"input": text} if api == "response"
                               else {"messages": user(text)})}
            assert (await http.post(path, json=body)).status_code == 200
            assert fake.find(text).max_prompt_tokens == 1234
