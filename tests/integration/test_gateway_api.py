"""The gateway over real HTTP, NATS and Redis, with the official `openai` SDK as the client.

The code under test stays real (uvicorn serving both apps, nats-py, redis-py);
only the trajectory manager is faked, at the NATS edge, by `FakeTrajectory`: it
answers sf.chat and sf.session.* the way the contract in shared/messages says.
Each module gets a private nats-server (another test's trajectory manager on the
shared one would answer sf.chat too); Redis is the shared session fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

import httpx
import jsonschema
import msgspec
import openai
import pytest
import redis.asyncio as aioredis
import uvicorn

from seamlessflow.stack import servers
from services.gateway.app import build_apps
from services.gateway.config import GatewayConfig
from services.gateway.service import Gateway
from services.gateway.store import digest
from shared import subjects
from shared.bus import connect, wait_closed
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages.chat import ChatCancel, ChatDelta, ChatDone, ChatFailed, ChatRequest, ToolCall, Usage
from shared.messages.session import SessionReply, SessionRequest

pytestmark = pytest.mark.integration

MODEL = "seamlessflow-tiny"
USER_KEY = "sk-user-test-0123456789"
ADMIN_KEY = "admin-test-0123456789"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


# --- the fake trajectory manager (the only fake) -------------------------------------------------

class FakeTrajectory:
    """Answers by the last user text (or the prompt), as the real manager would:
    "weather?" -> a tool call; "too long" -> ChatFailed 400; "silent" -> no reply at all;
    "no tokens" -> keepalives only; "hang..." -> one delta, then keepalives until cancelled;
    "fail midway" -> a delta, then ChatFailed 503; "die once" -> the first replica dies after
    one delta, the re-sent request is resumed from offset 0; anything else -> "echo: <text>"
    in word deltas, with a keepalive (an empty delta) after the first.
    """

    def __init__(self, nats_url: str) -> None:
        self.conn = Connections(nats_url=nats_url)
        self.requests: list[ChatRequest] = []
        self.cancels: list[str] = []
        self.sessions: dict[str, dict] = {}
        self.running: dict[str, asyncio.Task] = {}

    async def start(self) -> "FakeTrajectory":
        self.nc = await connect(self.conn, "fake-trajectory")
        q = subjects.TRAJECTORY_QUEUE
        await self.nc.subscribe(subjects.CHAT, queue=q, cb=self._on_chat)
        await self.nc.subscribe(subjects.session_op("*"), queue=q, cb=self._on_session)
        await self.nc.subscribe(subjects.CHAT_CANCEL, cb=self._on_cancel)
        await self.nc.flush()
        return self

    async def stop(self) -> None:
        for t in list(self.running.values()):
            t.cancel()
        await wait_closed(self.nc)

    def find(self, text: str) -> ChatRequest:
        return next(r for r in reversed(self.requests) if _text(r) == text)

    async def cancelled(self, request_id: str, timeout: float = 3.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if request_id in self.cancels:
                return True
            await asyncio.sleep(0.02)
        return False

    async def _on_cancel(self, msg) -> None:
        rid = decode(msg.data, ChatCancel).request_id
        self.cancels.append(rid)
        if task := self.running.get(rid):
            task.cancel()

    async def _on_chat(self, msg) -> None:
        req = decode(msg.data, ChatRequest)
        task = asyncio.create_task(self._turn(req, msg.reply))  # turns overlap, as in the real manager
        self.running[req.request_id] = task
        task.add_done_callback(lambda _: self.running.pop(req.request_id, None))

    async def _turn(self, req: ChatRequest, reply_to: str) -> None:
        attempt = sum(r.request_id == req.request_id for r in self.requests)
        self.requests.append(req)
        rid = req.request_id

        async def send(reply) -> None:
            await self.nc.publish(reply_to, encode(reply))

        async def keepalives(seconds: float = 10.0) -> None:
            for _ in range(int(seconds / 0.1)):
                await send(ChatDelta(rid, "", 0))
                await asyncio.sleep(0.1)

        text = _text(req)
        if req.session_id and req.session_id not in self.sessions:
            return await send(ChatFailed(rid, 404, "session_not_found", f"session {req.session_id} does not exist"))
        if self.sessions.get(req.session_id, {}).get("finished"):
            return await send(ChatFailed(rid, 409, "session_finished", f"session {req.session_id} is finished"))
        if text == "too long":
            return await send(ChatFailed(rid, 400, "context_length_exceeded",
                                         "the prompt is 5000 tokens; this model's context window is 2048 tokens"))
        if text == "silent":
            return
        if text == "no tokens":
            return await keepalives()
        if text.startswith("hang"):
            await send(ChatDelta(rid, "thinking", 0))
            return await keepalives()
        if text == "fail midway":
            await send(ChatDelta(rid, "partial", 0))
            return await send(ChatFailed(rid, 503, "rollout_unavailable", "every rollout worker went away"))
        if text == "die once" and attempt == 0:
            return await send(ChatDelta(rid, "echo: ", 0))  # ... and this replica is gone
        sid = req.session_id or "sess-oneoff-" + rid[:8]
        session = self.sessions.setdefault(sid, {"id": sid, "group_id": "", "metadata": {}, "turns": [],
                                                 "reward": None, "finished": False})
        session["turns"].append(req.messages or req.prompt)
        turn_id = len(session["turns"]) - 1
        if text == "weather?":
            return await send(ChatDone(rid, "", "tool_calls", Usage(20, 8), turn_id,
                                       tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Paris"}')],
                                       versions=[7], session_id=sid))
        answer = f"echo: {text}"
        words = answer.split(" ")
        offset = 0
        for i, word in enumerate(words):
            piece = word if i == 0 else " " + word
            await send(ChatDelta(rid, piece, offset))
            offset += len(piece)
            if i == 0:
                await send(ChatDelta(rid, "", 0))  # keepalive: must not reach the agent
        await send(ChatDone(rid, answer, "stop", Usage(10, len(words)), turn_id, versions=[7], session_id=sid))

    async def _on_session(self, msg) -> None:
        # Mirrors services/trajectory/sessions.py: finish is idempotent, reward after finish is 409.
        req = decode(msg.data, SessionRequest)
        s = self.sessions.get(req.session_id)
        if req.op == "create":
            sid = "sess-" + uuid.uuid4().hex[:12]
            self.sessions[sid] = {"id": sid, "group_id": req.group_id, "metadata": req.metadata, "turns": [],
                                  "reward": None, "finished": False}
            reply = SessionReply(200, sid, body={"group_id": req.group_id, "policy_version": 7})
        elif s is None:
            reply = SessionReply(404, req.session_id, f"session {req.session_id} does not exist")
        elif req.op == "get":
            reply = SessionReply(200, req.session_id, body=s)
        elif req.op == "finish" and s["finished"]:
            reply = SessionReply(200, req.session_id, "already finished", body={"reward": s["reward"]})
        elif s["finished"]:
            reply = SessionReply(409, req.session_id, f"session {req.session_id} is already finished")
        else:
            if req.reward is not None:
                s["reward"] = req.reward
            s["finished"] = req.op == "finish"
            reply = SessionReply(200, req.session_id, body={"reward": s["reward"]})
        await self.nc.publish(msg.reply, encode(reply))


def _text(req: ChatRequest) -> str:
    if req.kind == "completion":
        return req.prompt
    users = [m for m in req.messages if m["role"] in ("user", "tool")]
    return users[-1]["content"] if users else ""


# --- running the real gateway ------------------------------------------------------------------

class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # leave pytest's signal handlers alone


@dataclass
class Running:
    agent: str  # base URL of the agent API
    admin: str
    gateway: Gateway

    def sdk(self, key: str = USER_KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.agent + "/v1", api_key=key, max_retries=0, timeout=20)

    def http(self, key: str | None = USER_KEY, admin: bool = False) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.admin if admin else self.agent, headers=headers, timeout=20)


@contextlib.asynccontextmanager
async def run_gateway(conn: Connections, wait_nats: bool = True, **overrides):
    cfg = GatewayConfig(port=servers.free_port(), admin_port=servers.free_port(), api_keys=USER_KEY,
                        admin_key=ADMIN_KEY, **overrides)
    agent, admin = build_apps(cfg, conn)
    running = [_Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                      timeout_graceful_shutdown=2))
               for app, port in ((agent, cfg.port), (admin, cfg.admin_port))]
    tasks = [asyncio.create_task(s.serve()) for s in running]
    try:
        deadline = time.monotonic() + 10
        while not all(s.started for s in running):
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), "gateway did not start"
            await asyncio.sleep(0.02)
        gw: Gateway = agent.state.gateway
        while wait_nats and not (gw._nc and gw._nc.is_connected):
            assert time.monotonic() < deadline, "gateway did not connect to NATS"
            await asyncio.sleep(0.02)
        yield Running(f"http://127.0.0.1:{cfg.port}", f"http://127.0.0.1:{cfg.admin_port}", gw)
    finally:
        for s in running:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="module")
async def fake(private_nats):
    f = await FakeTrajectory(private_nats).start()
    yield f
    await f.stop()


@pytest.fixture(scope="module")
async def gw(private_nats, redis_url, fake):
    conn = Connections(nats_url=private_nats, redis_url=redis_url)
    async with run_gateway(conn, first_token_timeout=5, idle_timeout=5, silence_timeout=1.0, resend_attempts=1,
                           max_body_bytes=64 * 1024) as running:
        yield running


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


# --- the official SDK ----------------------------------------------------------------------------

async def test_stop_strings_reach_the_trajectory_manager(gw, fake):
    sdk = gw.sdk()
    await sdk.chat.completions.create(model=MODEL, messages=user("stops as a list"), stop=["\nObservation:", "END"])
    await sdk.chat.completions.create(model=MODEL, messages=user("stop as a string"), stop="END")
    await sdk.completions.create(model=MODEL, prompt="a completion stop", stop=["\n\n"])
    assert fake.find("stops as a list").stop == ["\nObservation:", "END"]
    assert fake.find("stop as a string").stop == ["END"]
    assert fake.find("a completion stop").stop == ["\n\n"]


async def test_sdk_chat(gw, fake):
    resp = await gw.sdk().chat.completions.create(model=MODEL, messages=user("hello there"), temperature=0.2,
                                                  max_tokens=32, seed=1, user="agent-7", metadata={"a": "b"})
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == MODEL
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == "echo: hello there"
    assert resp.choices[0].finish_reason == "stop"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (10, 3, 13)
    sent = fake.find("hello there")
    assert resp.model_extra["seamlessflow"] == {"session_id": "sess-oneoff-" + sent.request_id[:8], "turn_id": 0,
                                                "versions": [7]}
    assert resp.id == "chatcmpl-" + sent.request_id
    assert (sent.session_id, sent.kind, sent.model, sent.agent_streams) == ("", "chat", MODEL, False)
    assert (sent.sampling.max_tokens, sent.sampling.temperature, sent.sampling.seed) == (32, 0.2, 1)
    assert sent.messages == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"}]


async def test_sdk_chat_streaming(gw):
    stream = await gw.sdk().chat.completions.create(model=MODEL, messages=user("stream me please"), stream=True,
                                                    stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: stream me please"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 14
    assert len({c.id for c in chunks}) == 1


async def test_dead_replica_is_resent_and_the_stream_stays_continuous(gw, fake):
    """The first replica dies after one delta; the re-sent request resumes from offset 0 and
    the agent sees each character once."""
    stream = await gw.sdk().chat.completions.create(model=MODEL, messages=user("die once"), stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "echo: die once"
    rid = fake.find("die once").request_id
    assert [r.request_id for r in fake.requests].count(rid) == 2
    resp = await gw.sdk().chat.completions.create(model=MODEL, messages=user("die once"))
    assert resp.choices[0].message.content == "echo: die once"


async def test_sdk_stream_helper_accumulates(gw):
    async with gw.sdk().chat.completions.stream(model=MODEL, messages=user("helper"), tools=[WEATHER]) as s:
        final = await s.get_final_completion()
    assert final.choices[0].message.content == "echo: helper"


async def test_sdk_tool_call_turn(gw, fake):
    client = gw.sdk()
    messages = user("weather?")
    resp = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert (call.id, call.type, call.function.name, json.loads(call.function.arguments)) == (
        "call_1", "function", "get_weather", {"city": "Paris"})
    assert fake.find("weather?").tools == [WEATHER]

    # The agent runs the tool and sends the result back, as any OpenAI agent loop does.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    resp = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert resp.choices[0].message.content == "echo: sunny, 21C"
    sent = fake.find("sunny, 21C")
    assert sent.messages[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert sent.messages[3] == {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1"}

    # tool_choice "none": the model does not see the tools
    await client.chat.completions.create(model=MODEL, messages=user("no tools"), tools=[WEATHER], tool_choice="none")
    assert fake.find("no tools").tools == []


async def test_sdk_tool_call_streaming(gw):
    stream = await gw.sdk().chat.completions.create(model=MODEL, messages=user("weather?"), tools=[WEATHER],
                                                    stream=True)
    calls = [tc for c in [c async for c in stream] if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.id, c.function.name, c.function.arguments) for c in calls] == [
        (0, "call_1", "get_weather", '{"city": "Paris"}')]


async def test_sdk_completions(gw, fake):
    client = gw.sdk()
    resp = await client.completions.create(model=MODEL, prompt="once upon")
    assert resp.object == "text_completion" and resp.choices[0].text == "echo: once upon"
    sent = fake.find("once upon")
    assert (sent.kind, sent.prompt, sent.sampling.max_tokens) == ("completion", "once upon", 16)
    stream = await client.completions.create(model=MODEL, prompt="a time", stream=True, max_tokens=5)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == "echo: a time"
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_sdk_models(gw):
    client = gw.sdk()
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="gpt-4o", messages=user("x"))
    assert info.value.code == "model_not_found"


async def test_sdk_errors_are_typed(gw):
    with pytest.raises(openai.AuthenticationError):
        await gw.sdk("sk-wrong").chat.completions.create(model=MODEL, messages=user("x"))
    with pytest.raises(openai.BadRequestError) as info:
        await gw.sdk().chat.completions.create(model=MODEL, messages=user("too long"))
    assert info.value.code == "context_length_exceeded" and "2048" in info.value.message
    # A failure before the first token is a plain HTTP error even when streaming.
    with pytest.raises(openai.BadRequestError):
        await gw.sdk().chat.completions.create(model=MODEL, messages=user("too long"), stream=True)


async def test_failure_mid_stream_is_an_error_event(gw):
    stream = await gw.sdk().chat.completions.create(model=MODEL, messages=user("fail midway"), stream=True)
    seen = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            seen.append(chunk)
    assert "every rollout worker went away" in info.value.message
    assert "".join(c.choices[0].delta.content or "" for c in seen) == "partial"
    async with gw.http() as http:
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("fail midway"),
                                                          "stream": True})
    events = [line for line in r.text.split("\n\n") if line]
    assert r.status_code == 200 and "[DONE]" not in r.text
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "rollout_unavailable"


# --- sessions ------------------------------------------------------------------------------------

async def test_session_lifecycle(gw, fake, redis_url):
    async with gw.http() as http:
        r = await http.post("/v1/sessions", json={"group_id": "g1", "metadata": {"task": 3}})
        assert r.status_code == 200, r.text
        session = r.json()
        sid, key = session["id"], session["api_key"]
        assert key.startswith("sk-sf-") and session["group_id"] == "g1" and session["policy_version"] == 7
        assert fake.sessions[sid]["metadata"] == {"task": 3}

    # Redis holds the key's hash only.
    rds = aioredis.from_url(redis_url)
    record = json.loads(await rds.get(f"sf:key:{digest(key)}"))
    assert (record["kind"], record["session_id"]) == ("session", sid) and record["created"] > 0
    assert not [k async for k in rds.scan_iter(match=f"*{key}*")]
    await rds.aclose()

    # The session key attributes turns to its session.
    resp = await gw.sdk(key).chat.completions.create(model=MODEL, messages=user("turn one"))
    assert fake.find("turn one").session_id == sid
    assert resp.model_extra["seamlessflow"]["session_id"] == sid
    await gw.sdk(key).chat.completions.create(model=MODEL, messages=user("turn two"))
    assert len(fake.sessions[sid]["turns"]) == 2

    async with gw.http(key) as own, gw.http() as http:
        assert (await own.post(f"/v1/sessions/{sid}/reward", json={"reward": 0.5})).status_code == 200
        got = await own.get(f"/v1/sessions/{sid}")
        assert got.status_code == 200 and got.json()["reward"] == 0.5 and len(got.json()["turns"]) == 2
        r = await http.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
        assert r.status_code == 200 and r.json()["status"] == "finished"
        assert fake.sessions[sid]["reward"] == 1.0
        assert (await own.post(f"/v1/sessions/{sid}/finish")).status_code == 200  # idempotent
        r = await own.post(f"/v1/sessions/{sid}/reward", json={"reward": 0.0})
        assert r.status_code == 409 and "already finished" in r.json()["error"]["message"]
        with pytest.raises(openai.ConflictError):  # the manager's ChatFailed 409 passes through
            await gw.sdk(key).chat.completions.create(model=MODEL, messages=user("turn three"))

        # a session key cannot create sessions nor touch another session
        r = await own.post("/v1/sessions", json={})
        assert r.status_code == 403
        other = (await http.post("/v1/sessions")).json()
        r = await own.get(f"/v1/sessions/{other['id']}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        r = await own.post(f"/v1/sessions/{other['id']}/reward", json={"reward": 1})
        assert r.status_code == 404

        # unknown sessions
        r = await http.get("/v1/sessions/sess-nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        r = await http.post("/v1/sessions/sess-nope/reward", json={"reward": 1})
        assert r.status_code == 404
        r = await http.post(f"/v1/sessions/{other['id']}/reward", json={"reward": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reward"
        r = await http.post(f"/v1/sessions/{other['id']}/reward", content=b'{"reward": 1e999}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "reward"

    # The trajectory manager forgot the session (e.g. expired): its ChatFailed 404 passes through.
    del fake.sessions[other["id"]]
    with pytest.raises(openai.NotFoundError) as info:
        await gw.sdk(other["api_key"]).chat.completions.create(model=MODEL, messages=user("anyone?"))
    assert info.value.code == "session_not_found"


async def test_one_user_key_cannot_reach_another_users_session(gw, fake):
    """Cross-tenant: a session belongs to the user key that created it. Another user key gets 404
    on it (get, reward, finish, its stored responses), exactly as for a session that does not exist."""
    async with gw.http(ADMIN_KEY, admin=True) as adm:
        other_user = (await adm.post("/admin/keys", json={"name": "tenant-b"})).json()["api_key"]
    async with gw.http() as mine, gw.http(other_user) as theirs:
        session = (await mine.post("/v1/sessions", json={"group_id": "g-a"})).json()
        sid, session_key = session["id"], session["api_key"]
        await gw.sdk(session_key).chat.completions.create(model=MODEL, messages=user("tenant a's secret"))
        stored = await gw.sdk(session_key).responses.create(model=MODEL, input="a stored answer")
        assert (await mine.get(f"/v1/sessions/{sid}")).status_code == 200  # the owner reads it

        for r in (await theirs.get(f"/v1/sessions/{sid}"),
                  await theirs.post(f"/v1/sessions/{sid}/reward", json={"reward": 1.0}),
                  await theirs.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}),
                  await theirs.get("/v1/sessions/sess-does-not-exist")):
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
            assert "secret" not in r.text
        assert (await theirs.get(f"/v1/responses/{stored.id}")).status_code == 404
        with pytest.raises(openai.NotFoundError):
            await gw.sdk(other_user).responses.create(model=MODEL, input="x", previous_response_id=stored.id)
        assert fake.sessions[sid]["reward"] is None and not fake.sessions[sid]["finished"]

        # ... while its owner, and the session's own key, still may
        assert (await mine.get(f"/v1/responses/{stored.id}")).status_code == 200
        assert (await mine.post(f"/v1/sessions/{sid}/finish", json={"reward": 0.5})).status_code == 200

        # a user key's one-off turn: that session is its tenant's too
        done = await gw.sdk(other_user).chat.completions.create(model=MODEL, messages=user("b's own turn"))
        oneoff = done.model_extra["seamlessflow"]["session_id"]
        assert (await theirs.get(f"/v1/sessions/{oneoff}")).status_code == 200
        assert (await mine.get(f"/v1/sessions/{oneoff}")).status_code == 404


async def test_another_tenants_group_id_is_refused(gw, fake):
    """Issue 30: a GRPO group belongs to the tenant whose session first named it. Another tenant
    opening a session with that group_id gets 404, as for a group that does not exist, so its
    rewards are never grouped with the owner's in training; the owner opens more."""
    async with gw.http(ADMIN_KEY, admin=True) as adm:
        other_user = (await adm.post("/admin/keys", json={"name": "tenant-c"})).json()["api_key"]
    async with gw.http() as mine, gw.http(other_user) as theirs:
        first = await mine.post("/v1/sessions", json={"group_id": "g-owned"})
        assert first.status_code == 200, first.text
        before = len(fake.sessions)
        r = await theirs.post("/v1/sessions", json={"group_id": "g-owned"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "group_not_found", r.text
        assert len(fake.sessions) == before  # nothing reached the trajectory manager
        assert (await mine.post("/v1/sessions", json={"group_id": "g-owned"})).status_code == 200
        assert (await theirs.post("/v1/sessions", json={"group_id": "g-theirs"})).status_code == 200
        assert (await mine.post("/v1/sessions", json={"group_id": "g-theirs"})).status_code == 404


async def test_keys_are_never_logged(gw, caplog):
    caplog.set_level(logging.DEBUG)
    async with gw.http() as http, gw.http(ADMIN_KEY, admin=True) as adm:
        session_key = (await http.post("/v1/sessions")).json()["api_key"]
        user_key = (await adm.post("/admin/keys", json={"name": "ci"})).json()["api_key"]
        await http.get("/v1/models", headers={"Authorization": f"Bearer {session_key}x"})
    for secret in (session_key, user_key, USER_KEY, ADMIN_KEY):
        assert secret not in caplog.text
    assert digest(user_key)[:10] in caplog.text
    # ... nor in error bodies, nor in metric labels
    async with gw.http(session_key + "x") as wrong, gw.http(ADMIN_KEY, admin=True) as adm:
        bodies = [(await wrong.get("/v1/models")).text, (await wrong.post("/v1/chat/completions", json={})).text,
                  (await adm.get("/metrics")).text]
        async with gw.http(USER_KEY + "x", admin=True) as bad_admin:
            bodies.append((await bad_admin.get("/metrics")).text)
    for secret in (session_key, user_key, USER_KEY, ADMIN_KEY):
        assert not any(secret in body for body in bodies)


# --- bad input -----------------------------------------------------------------------------------

CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "fine"}]}


@pytest.mark.parametrize("path,body,status,param,needle", [
    ("/v1/chat/completions", b'{"model": "x", "messages": [', 400, None, "not valid JSON"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": "hot"}, 400, "temperature", "Expected `float | null`"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": 3}, 400, "temperature", "<= 2.0"),
    ("/v1/chat/completions", {**CHAT_OK, "top_p": 0}, 400, "top_p", "> 0.0"),
    ("/v1/chat/completions", {**CHAT_OK, "presence_penalty": -3}, 400, "presence_penalty", ">= -2.0"),
    ("/v1/chat/completions", {**CHAT_OK, "n": 2}, 400, "n", "only n=1"),
    ("/v1/chat/completions", {**CHAT_OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 strings"),
    ("/v1/chat/completions", {**CHAT_OK, "stop": ["ok", ""]}, 400, "stop", "must not be empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop", "must not be empty"),
    ("/v1/chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 3}, 400, "top_logprobs",
     "top_logprobs > 0 is not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs", "logprobs > 0"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", "Invalid value 'wizard'"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": "hi"}, 400, "messages", "Expected `array`"),
    ("/v1/chat/completions", {"messages": CHAT_OK["messages"]}, 400, "model", "missing required field `model`"),
    ("/v1/chat/completions", {**CHAT_OK, "model": "gpt-4o"}, 404, "model", "does not exist"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": "too long"}]}, 400, None,
     "context window is 2048"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "Expected `str`"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature", ">= 0.0"),
    ("/v1/completions", {"model": "davinci", "prompt": "x"}, 404, "model", "does not exist"),
])
async def test_bad_input(gw, path, body, status, param, needle):
    async with gw.http() as http:
        if isinstance(body, bytes):
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and needle in error["message"]


async def test_unknown_fields_are_ignored(gw):
    async with gw.http() as http:
        r = await http.post("/v1/chat/completions", json={**CHAT_OK, "store": False, "reasoning_effort": "low",
                                                          "x_vendor": {"a": 1}, "temperature": None})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "echo: fine"


async def test_auth(gw):
    async with gw.http(key=None) as anon:
        for headers in ({}, {"Authorization": "Bearer sk-nope"}, {"Authorization": f"Basic {USER_KEY}"},
                        {"Authorization": f"Bearer {ADMIN_KEY}"}):
            r = await anon.post("/v1/chat/completions", json=CHAT_OK, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = await anon.get("/v1/models")
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert (await anon.get("/healthz")).json() == {"nats": "ok", "redis": "ok"}
        assert (await anon.get("/openapi.json")).status_code == 200
        r = await anon.get("/v1/nothing-here")
        assert r.status_code == 404 and "error" in r.json()


async def test_body_limits(gw):
    big = {**CHAT_OK, "messages": [{"role": "user", "content": "x" * 70_000}]}
    async with gw.http() as http:
        r = await http.post("/v1/chat/completions", json=big)  # refused on Content-Length
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        async def chunked():  # no Content-Length: refused while reading
            data = msgspec.json.encode(big)
            for i in range(0, len(data), 8192):
                yield data[i:i + 8192]

        r = await http.post("/v1/chat/completions", content=chunked())
        assert r.status_code == 413 and "65536 bytes" in r.json()["error"]["message"]


async def test_openapi_matches_what_the_server_accepts(gw):
    async with gw.http(key=None) as anon:
        doc = (await anon.get("/openapi.json")).json()
    assert doc["openapi"] == "3.1.0"
    components = doc["components"]

    def validator(name: str) -> jsonschema.Draft202012Validator:
        return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": components})

    chat = validator("ChatCompletionRequest")
    bodies = [
        CHAT_OK,
        {**CHAT_OK, "temperature": 2, "top_p": 1, "top_k": -1, "stop_token_ids": [1], "tools": [WEATHER]},
        {**CHAT_OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "fine"}]}]},
        {**CHAT_OK, "temperature": 2.01},
        {**CHAT_OK, "top_p": 0},
        {**CHAT_OK, "max_tokens": 0},
        {**CHAT_OK, "messages": []},
        {**CHAT_OK, "messages": [{"role": "user", "content": None}]},
        {**CHAT_OK, "messages": [{"role": "tool", "content": "x"}]},
        {**CHAT_OK, "tool_choice": "sometimes"},
        {"messages": CHAT_OK["messages"]},
    ]
    async with gw.http() as http:
        for body in bodies:
            r = await http.post("/v1/chat/completions", json=body)
            assert chat.is_valid(body) == (r.status_code == 200), (body, r.text)
    assert validator("RewardBody").is_valid({"reward": 1.5}) and not validator("RewardBody").is_valid({})
    assert not validator("CompletionRequest").is_valid({"model": MODEL, "prompt": ["a"]})


# --- the agent goes away -------------------------------------------------------------------------

async def test_disconnect_mid_stream_publishes_cancel(gw, fake):
    async with gw.http() as http:
        body = {"model": MODEL, "messages": user("hang stream"), "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            async for line in r.aiter_lines():
                if "thinking" in line:
                    break  # leave with the turn still open
    assert await fake.cancelled(request_id), "no ChatCancel after the client went away"


async def test_disconnect_while_waiting_publishes_cancel(gw, fake):
    async with gw.http() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("hang plain")},
                            timeout=0.5)
    request_id = fake.find("hang plain").request_id
    assert await fake.cancelled(request_id), "no ChatCancel after the client went away"


# --- admin ---------------------------------------------------------------------------------------

async def test_admin_keys_and_metrics(gw):
    async with gw.http(ADMIN_KEY, admin=True) as adm, gw.http(USER_KEY, admin=True) as wrong:
        assert (await wrong.post("/admin/keys")).status_code == 401
        assert (await wrong.get("/metrics")).status_code == 401
        r = await adm.post("/admin/keys", json={"name": "team-a"})
        assert r.status_code == 201
        new_key = r.json()["api_key"]
        assert (await adm.get("/healthz")).json() == {"nats": "ok", "redis": "ok"}
        await gw.sdk(new_key).chat.completions.create(model=MODEL, messages=user("metered"))
        async with gw.http(new_key) as http:
            r = await http.post("/v1/sessions")  # an admin-made user key can create sessions
            assert r.status_code == 200
        metrics = (await adm.get("/metrics")).text
    assert 'sf_gateway_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in metrics
    assert 'route="/v1/sessions/{session_id}"' in metrics or 'route="/v1/sessions"' in metrics
    assert "sf_gateway_request_seconds_bucket" in metrics
    assert "sf_gateway_in_flight_requests" in metrics
    assert 'sf_gateway_time_to_first_token_seconds_count{kind="chat"}' in metrics
    assert 'sf_gateway_tokens_total{type="completion"}' in metrics


async def test_admin_disabled_without_admin_key(redis_url):
    from services.gateway.admin import create_admin_app

    app = create_admin_app(Gateway(GatewayConfig(admin_key=""), Connections(redis_url=redis_url)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as client:
        for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer anything"}):
            r = await client.post("/admin/keys", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "admin_disabled"


async def test_admin_hosts_shows_the_schedulers_hosts_and_needs_the_admin_key(gw, private_nats):
    import nats as nats_client

    from shared.messages.scheduler import HostInfo, SchedulerControl, SchedulerReply

    async with gw.http(ADMIN_KEY, admin=True) as adm:
        r = await adm.get("/admin/hosts")
        assert r.status_code == 404 and "no scheduler" in r.json()["error"]["message"]
        nc = await nats_client.connect(private_nats)
        seen = []

        async def on(msg):
            seen.append(decode(msg.data, SchedulerControl).op)
            host = HostInfo("host-0", ["train", "rollout", "cpu"], 1.0, "rollout", "rollout", 3, True, False, 1.0)
            await msg.respond(encode(SchedulerReply(True, "seamless", [host], counts={"lends": 2})))

        await nc.subscribe(subjects.SCHED_CTL, cb=on)
        await nc.flush()
        try:
            r = await adm.get("/admin/hosts")
        finally:
            await nc.close()
    assert r.status_code == 200 and seen == ["status"]
    body = r.json()
    assert body["policy"] == "seamless" and body["counts"] == {"lends": 2}
    assert body["hosts"][0]["host"] == "host-0" and body["hosts"][0]["epoch"] == 3
    async with gw.http() as agent_key_on_admin:
        r = await agent_key_on_admin.get(gw.admin + "/admin/hosts")
    assert r.status_code in (401, 403)
