"""The gateway when what is behind it fails: no trajectory manager, a silent or stalled one,
Redis down, NATS down, and recovery from each without a gateway restart.

This module owns its NATS and Redis servers (stopping the shared ones would break other
tests); the gateway runs with short timeouts so each case takes about a second.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import openai
import pytest

from seamlessflow.stack import servers
from shared.config import Connections
from tests.integration.test_gateway_api import MODEL, USER_KEY, FakeTrajectory, run_gateway, user

pytestmark = pytest.mark.integration


class Restartable:
    """A server process that can be stopped and started again on the same port and data dir."""

    def __init__(self, kind: str, data: Path) -> None:
        self.kind, self.data, self.port = kind, data, servers.free_port()
        self.proc = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}" if self.kind == "nats" else f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "Restartable":
        if self.kind == "nats":
            self.proc = servers.start_nats(self.port, self.data)
        else:  # durable: the keys written before an outage are still there after it
            self.proc = servers.start_redis(self.port, self.data, durable=True)
        return self

    def stop(self) -> None:
        servers.stop(self.proc)


@pytest.fixture(scope="module")
def infra(tmp_path_factory):
    nats = Restartable("nats", tmp_path_factory.mktemp("outage-nats")).start()
    redis = Restartable("redis", tmp_path_factory.mktemp("outage-redis")).start()
    yield nats, redis
    nats.stop()
    redis.stop()


@pytest.fixture(scope="module")
async def gw(infra):
    nats, redis = infra
    async with run_gateway(Connections(nats_url=nats.url, redis_url=redis.url), first_token_timeout=1.0,
                           idle_timeout=1.0, silence_timeout=0.3, resend_attempts=1, redis_timeout=0.5) as running:
        yield running


@pytest.fixture
async def fake(infra):
    f = await FakeTrajectory(infra[0].url).start()
    yield f
    await f.stop()


async def eventually(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await check()
        except (AssertionError, openai.APIError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_no_trajectory_manager_is_503(gw):
    async with gw.http() as http:
        for stream in (False, True):
            r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("x"), "stream": stream})
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "trajectory_unavailable" and "sf.chat" in error["message"]
            assert r.headers["retry-after"] == "1"
        r = await http.post("/v1/sessions")
        assert r.status_code == 503 and "sf.session.create" in r.json()["error"]["message"]
        assert (await http.get("/healthz")).status_code == 200  # NATS and Redis themselves are fine
    with pytest.raises(openai.InternalServerError) as info:
        await gw.sdk().chat.completions.create(model=MODEL, messages=user("x"))
    assert info.value.status_code == 503


async def test_silence_is_resent_then_504(gw, fake):
    start = time.monotonic()
    async with gw.http() as http:
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("silent")})
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert "went silent" in r.json()["error"]["message"]
    assert time.monotonic() - start < 3
    rid = fake.find("silent").request_id
    assert [q.request_id for q in fake.requests].count(rid) == 2  # sent, then re-sent once
    assert await fake.cancelled(rid)


async def test_keepalives_without_tokens_hit_the_first_token_timeout(gw, fake):
    async with gw.http() as http:
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("no tokens")})
    assert r.status_code == 504 and "no first token within 1s" in r.json()["error"]["message"]
    rid = fake.find("no tokens").request_id
    assert [q.request_id for q in fake.requests].count(rid) == 1  # alive: never re-sent
    assert await fake.cancelled(rid)


async def test_stall_mid_stream_is_an_error_event(gw, fake):
    async with gw.http() as http:
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hang"), "stream": True})
    assert r.status_code == 200
    events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e]
    assert events[1]["choices"][0]["delta"]["content"] == "thinking"
    assert events[-1]["error"]["code"] == "upstream_timeout" and "no new tokens" in events[-1]["error"]["message"]
    assert await fake.cancelled(fake.find("hang").request_id)


async def test_redis_outage_and_recovery(gw, fake, infra):
    _, redis = infra
    async with gw.http() as http:
        session_key = (await http.post("/v1/sessions")).json()["api_key"]
        unused_key = (await http.post("/v1/sessions")).json()["api_key"]  # not in the gateway's key cache
    await gw.sdk(session_key).chat.completions.create(model=MODEL, messages=user("before"))

    redis.stop()
    try:
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            await gw.sdk(unused_key).chat.completions.create(model=MODEL, messages=user("during"))
        assert info.value.status_code == 503 and info.value.code == "redis_unavailable"
        assert "Redis is unreachable" in info.value.message
        assert info.value.response.headers["retry-after"] == "1"
        assert time.monotonic() - start < 3  # socket timeouts: an outage never hangs a request
        async with gw.http(key=None) as anon:
            r = await anon.get("/healthz")
            assert r.status_code == 503 and r.json() == {"nats": "ok", "redis": "down"}
        # static keys need no Redis: agents with them keep working
        resp = await gw.sdk(USER_KEY).chat.completions.create(model=MODEL, messages=user("static"))
        assert resp.choices[0].message.content == "echo: static"
    finally:
        redis.start()

    async def works():
        resp = await gw.sdk(session_key).chat.completions.create(model=MODEL, messages=user("after"))
        assert resp.choices[0].message.content == "echo: after"

    await eventually(works)  # same gateway process, same key: recovered


async def test_nats_outage_and_recovery(gw, fake, infra):
    nats, _ = infra
    nats.stop()
    try:
        await eventually(lambda: _expect_nats_down(gw))
        async with gw.http() as http:
            r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("x")})
        assert r.status_code == 503 and r.json()["error"]["code"] == "nats_unavailable"
        assert "NATS" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
    finally:
        nats.start()

    async def works():
        resp = await gw.sdk().chat.completions.create(model=MODEL, messages=user("back"))
        assert resp.choices[0].message.content == "echo: back"

    await eventually(works)


async def _expect_nats_down(gw):
    async with gw.http(key=None) as anon:
        r = await anon.get("/healthz")
    assert r.status_code == 503 and r.json() == {"nats": "down", "redis": "ok"}
