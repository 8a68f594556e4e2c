"""/v1/responses (services/gateway/responses*.py): the official openai SDK and the OpenAI Agents SDK
against the real gateway app, in process.

The code under test stays real (routes, auth, translation, formats, the stored responses, chat.py's
turn machinery); only the edges are faked: the trajectory manager at the NATS edge (`Gateway.chat`)
and the Redis client (a dict). The conversation-key checks use the trajectory manager's own
functions, so "a Responses turn continues the same prefix-tree path as chat" is checked here,
without servers; tests/integration/test_responses_api.py checks it token by token on vLLM.
"""

from __future__ import annotations

import json

import httpx
import msgspec
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from services.gateway import responses_format as rfmt
from services.gateway import translate
from services.gateway.app import create_agent_app
from services.gateway.config import GatewayConfig
from services.gateway.responses_schemas import ResponseCreateRequest
from services.gateway.responses_translate import chat_request
from services.gateway.schemas import ChatCompletionRequest, decode
from services.gateway.service import Gateway
from services.gateway.store import KEY_PREFIX, KeyRecord, KeyStore, digest
from services.trajectory.conversation import candidate_prefixes, conversation_key
from services.trajectory.record import reply_message
from shared.config import Connections
from shared.messages.chat import ChatDelta, ChatDone, ChatFailed, ChatRequest, ToolCall, TokenLogprob, Usage

MODEL = "m"
USER_KEY = "sk-user-unit"
CFG = GatewayConfig(model=MODEL, api_keys=USER_KEY, max_context=1024, max_tokens_default=64)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


# --- the edges: the trajectory manager (NATS) and Redis ---------------------------------------------

class FakeRedis:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.reads: list[str] = []

    async def get(self, key: str):
        self.reads.append(key)
        return self.data.get(key)

    async def set(self, key: str, value, ex=None) -> bool:
        self.data[key] = value
        return True


class FakeManager:
    """Answers as the real manager would: with tools and a user message last, one get_weather call;
    after a tool result, "It is <result>."; else "echo: <last user text>", in word deltas."""

    def __init__(self) -> None:
        self.requests: list[ChatRequest] = []
        self.turns: dict[str, int] = {}

    async def chat(self, req: ChatRequest):
        self.requests.append(req)
        rid = req.request_id
        sid = req.session_id or "sess-oneoff-" + rid[:8]
        turn = self.turns[sid] = self.turns.get(sid, -1) + 1
        last = req.messages[-1]
        if last["content"] == "fail":
            yield ChatFailed(rid, 503, "rollout_unavailable", "every rollout worker went away")
            return
        if req.tools and last["role"] == "user":
            yield ChatDone(rid, "", "tool_calls", Usage(20, 8), turn, session_id=sid,
                           tool_calls=[ToolCall("call_" + rid[:6], "get_weather", '{"city": "Paris"}')])
            return
        answer = f"It is {last['content']}." if last["role"] == "tool" else f"echo: {last['content']}"
        offset = 0
        for i, word in enumerate(answer.split(" ")):
            piece = word if i == 0 else " " + word
            yield ChatDelta(rid, piece, offset)
            offset += len(piece)
        lps = [TokenLogprob(w, -0.5) for w in answer.split(" ")] if req.logprobs else []
        finish = "length" if last["content"] == "long story" else "stop"
        yield ChatDone(rid, answer, finish, Usage(10, 3), turn, versions=[7], session_id=sid, logprobs=lps)


class Harness:
    def __init__(self) -> None:
        self.gw = Gateway(CFG, Connections())
        self.gw.store = KeyStore("redis://127.0.0.1:1/0", CFG.static_keys(), 1.0, 3600)
        self.redis = self.gw.store.redis = FakeRedis()
        self.manager = FakeManager()
        self.gw.chat = self.manager.chat

        async def cancel(request_id: str, reason: str) -> None:
            pass

        self.gw.cancel = cancel
        self.app = create_agent_app(self.gw)

    def session_key(self, session_id: str) -> str:
        key = f"sk-sf-{session_id}"
        record = KeyRecord(kind="session", session_id=session_id, created=1.0, owner=digest(USER_KEY))
        self.redis.data[KEY_PREFIX + digest(key)] = msgspec.json.encode(record)
        return key

    def http(self, key: str = USER_KEY) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw",
                                 headers={"Authorization": f"Bearer {key}"})

    def sdk(self, key: str = USER_KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, http_client=self.http(key), max_retries=0)


@pytest.fixture
def h() -> Harness:
    return Harness()


def items(response) -> list[dict]:
    """Output items as an agent replays them in its next input."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def continues(first: ChatRequest, done: ChatDone, second: ChatRequest) -> bool:
    """The trajectory manager would find `first`'s turn as the prefix of `second` (its lookup rule)."""
    key = conversation_key(first.tools, first.messages + [reply_message(done.text, done.tool_calls)])
    return any(conversation_key(second.tools, second.messages[:k]) == key for k in candidate_prefixes(second.messages))


def done_of(response) -> ChatDone:
    """The ChatDone the fake answered `response` with, rebuilt from what the agent got."""
    calls = [ToolCall(i.call_id, i.name, i.arguments) for i in response.output if i.type == "function_call"]
    return ChatDone("", response.output_text, "tool_calls" if calls else "stop", Usage(0, 0), 0, calls)


# --- the official SDK: create ----------------------------------------------------------------------

async def test_text_over_two_turns_stateless_and_with_previous_response_id(h):
    sdk = h.sdk()
    r1 = await sdk.responses.create(model=MODEL, instructions="Be terse.", input="hello there", temperature=0.2,
                                    max_output_tokens=32)
    assert (r1.object, r1.status, r1.output_text, r1.model) == ("response", "completed", "echo: hello there", MODEL)
    assert r1.id.startswith("resp_") and r1.output[0].type == "message" and r1.output[0].role == "assistant"
    assert (r1.usage.input_tokens, r1.usage.output_tokens, r1.usage.total_tokens) == (10, 3, 13)
    first = h.manager.requests[-1]
    assert first.messages == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello there"}]
    assert (first.kind, first.sampling.max_tokens, first.sampling.temperature, first.agent_streams) == (
        "chat", 32, 0.2, False)
    assert r1.model_extra["seamlessflow"]["turn_id"] == 0

    stateless = await sdk.responses.create(model=MODEL, instructions="Be terse.", store=False,
                                           input=[{"role": "user", "content": "hello there"}, *items(r1),
                                                  {"role": "user", "content": "and then?"}])
    by_id = await sdk.responses.create(model=MODEL, instructions="Be terse.", previous_response_id=r1.id,
                                       input="and then?")
    a, b = h.manager.requests[-2:]
    assert a.messages == b.messages == first.messages + [{"role": "assistant", "content": "echo: hello there"},
                                                          {"role": "user", "content": "and then?"}]
    assert continues(first, done_of(r1), a) and continues(first, done_of(r1), b)
    assert stateless.output_text == by_id.output_text == "echo: and then?"
    # a third turn on the second: the chain is kept whole
    await sdk.responses.create(model=MODEL, instructions="Be terse.", previous_response_id=by_id.id, input="end")
    assert [m["content"] for m in h.manager.requests[-1].messages] == [
        "Be terse.", "hello there", "echo: hello there", "and then?", "echo: and then?", "end"]
    assert (await sdk.responses.retrieve(by_id.id)).output_text == "echo: and then?"


async def test_function_tools_over_two_turns_stateless_and_with_previous_response_id(h):
    sdk = h.sdk()
    r1 = await sdk.responses.create(model=MODEL, input="weather in Paris?", tools=[WEATHER])
    [call] = r1.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call", "get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and r1.output_text == ""
    first = h.manager.requests[-1]
    assert first.tools == [{"type": "function", "function": {k: WEATHER[k] for k in
                                                             ("name", "description", "parameters", "strict")}}]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}

    stateless = await sdk.responses.create(model=MODEL, tools=[WEATHER], store=False,
                                           input=[{"role": "user", "content": "weather in Paris?"}, *items(r1), result])
    by_id = await sdk.responses.create(model=MODEL, tools=[WEATHER], previous_response_id=r1.id, input=[result])
    a, b = h.manager.requests[-2:]
    expected = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": call.call_id}]
    assert a.messages == b.messages == expected
    assert continues(first, done_of(r1), a) and continues(first, done_of(r1), b)
    assert stateless.output_text == by_id.output_text == "It is sunny."


async def test_a_session_may_mix_chat_and_responses(h):
    """The same conversation sent by either API is the same ChatRequest, so the same prefix-tree path."""
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters",
                                                                       "strict")}}]
    chat = translate.chat_request(decode(msgspec.json.encode({
        "model": MODEL, "tools": tools, "messages": [
            {"role": "developer", "content": "Be terse."}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}), ChatCompletionRequest), "r", "s", CFG)
    responses = chat_request(decode(msgspec.json.encode({
        "model": MODEL, "instructions": "Be terse.", "tools": [WEATHER], "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}), ResponseCreateRequest),
        "r", "s", CFG, []).chat
    # the same bytes on the wire (the trajectory manager's raw digests hash them), though the chat side
    # sends some messages as the Structs they were validated into
    wire = msgspec.msgpack.encode
    assert wire((responses.messages, responses.tools)) == wire((chat.messages, chat.tools))
    messages = msgspec.msgpack.decode(wire(chat.messages))
    assert conversation_key(responses.tools, responses.messages[:3]) == conversation_key(chat.tools, messages[:3])


async def test_a_user_key_continues_in_the_session_of_the_response_it_names(h):
    sdk = h.sdk()
    r1 = await sdk.responses.create(model=MODEL, input="one")
    session = r1.model_extra["seamlessflow"]["session_id"]
    assert session.startswith("sess-oneoff-") and h.manager.requests[-1].session_id == ""
    r2 = await sdk.responses.create(model=MODEL, input="two", previous_response_id=r1.id)
    assert h.manager.requests[-1].session_id == session and r2.model_extra["seamlessflow"]["session_id"] == session


async def test_logprobs_and_incomplete(h):
    r = await h.sdk().responses.create(model=MODEL, input="hi", include=["message.output_text.logprobs"])
    assert [lp.logprob for lp in r.output[0].content[0].logprobs] == [-0.5, -0.5]
    assert h.manager.requests[-1].logprobs
    r = await h.sdk().responses.create(model=MODEL, input="long story", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"


# --- the official SDK: stream ----------------------------------------------------------------------

async def test_stream_helper_text_then_previous_response_id(h):
    sdk = h.sdk()
    async with sdk.responses.stream(model=MODEL, input="stream me please") as s:
        events = [e async for e in s]
        final = await s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 4 and deltas[-1].snapshot == "echo: stream me please"
    assert final.output_text == "echo: stream me please" and final.usage.total_tokens == 13
    assert h.manager.requests[-1].agent_streams
    # stored before the stream's end: the next turn may name it at once
    async with sdk.responses.stream(model=MODEL, input="more", previous_response_id=final.id) as s:
        second = await s.get_final_response()
    assert second.output_text == "echo: more"
    assert [m["content"] for m in h.manager.requests[-1].messages] == [
        "stream me please", "echo: stream me please", "more"]


async def test_stream_helper_function_tools_over_two_turns(h):
    sdk = h.sdk()
    async with sdk.responses.stream(model=MODEL, input="weather?", tools=[WEATHER]) as s:
        events = [e async for e in s]
        final = await s.get_final_response()
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    [call] = final.output
    assert call.type == "function_call" and call.arguments == done.arguments
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "rainy"}
    async with sdk.responses.stream(model=MODEL, input=[result], tools=[WEATHER],
                                    previous_response_id=final.id) as s:
        second = await s.get_final_response()
    assert second.output_text == "It is rainy."


async def test_failure_mid_stream_is_an_error_event(h):
    with pytest.raises(openai.APIStatusError) as info:  # the first reply decides the status: a plain 503
        await h.sdk().responses.create(model=MODEL, input="fail", stream=True)
    assert info.value.status_code == 503
    stream = rfmt.EventStream(rfmt.Shape("resp_x", 0, MODEL, _body(input="x"), "s"))
    stream.start()
    event = stream.error({"error": {"message": "gone", "type": "server_error", "param": None, "code": "c"}})
    data = json.loads(event.split(b"data: ", 1)[1])
    assert (data["type"], data["sequence_number"], data["message"], data["error"]["code"]) == ("error", 2, "gone", "c")


# --- the OpenAI Agents SDK: its default (Responses) model -----------------------------------------

async def test_agents_sdk_default_model_runs_a_tool_agent(h):
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        seen.append(city)
        return "cloudy"

    agent = Agent(name="w", instructions="Use the tool.", tools=[get_weather],
                  model_settings=ModelSettings(max_tokens=32))
    config = RunConfig(model=MODEL, model_provider=OpenAIProvider(openai_client=h.sdk()))  # base_url + api_key only
    result = await Runner.run(agent, "weather?", run_config=config)
    assert result.final_output == "It is cloudy." and seen == ["Paris"]
    streamed = Runner.run_streamed(agent, "weather?", run_config=config)
    async for _ in streamed.stream_events():
        pass
    assert streamed.final_output == "It is cloudy." and seen == ["Paris", "Paris"]
    roles = [[m["role"] for m in r.messages] for r in h.manager.requests]
    assert roles == [["system", "user"], ["system", "user", "assistant", "tool"]] * 2
    assert all(r.tools and r.tools[0]["function"]["name"] == "get_weather" for r in h.manager.requests)
    # its chaining mode sends only the new items, with previous_response_id: the same chat turns
    assert not [k for k in h.redis.reads if k.startswith("sf:resp:")]
    chained = await Runner.run(agent, "weather?", run_config=config, auto_previous_response_id=True)
    assert len([k for k in h.redis.reads if k.startswith("sf:resp:")]) == 1
    assert chained.final_output == "It is cloudy."
    def shown(r: ChatRequest) -> list:  # the call ids are new ones each run
        return [(m["role"], m["content"], [c["function"] for c in m.get("tool_calls", [])]) for m in r.messages]

    assert [shown(r) for r in h.manager.requests[-2:]] == [shown(r) for r in h.manager.requests[:2]]


# --- bad input: typed 400/404, never 5xx ----------------------------------------------------------

OK = {"model": MODEL, "input": "fine"}


@pytest.mark.parametrize("body,status,param,code", [
    ({**OK, "input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, 400, "input[0].type",
     "unsupported_parameter"),
    ({**OK, "input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type", "unsupported_parameter"),
    ({**OK, "input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type", "unsupported_parameter"),
    ({**OK, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input[0].content[0].type", "unsupported_parameter"),
    ({**OK, "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400, "input[0].content[0].text",
     "missing_required_parameter"),
    ({**OK, "input": [{"role": "wizard", "content": "x"}]}, 400, "input[0].role", "invalid_value"),
    ({**OK, "input": [{"type": "message", "content": "x"}]}, 400, "input[0].role", "missing_required_parameter"),
    ({**OK, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input[0].call_id",
     "missing_required_parameter"),
    ({**OK, "input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input[0].output",
     "missing_required_parameter"),
    ({**OK, "input": [{"role": "user", "content": 5}]}, 400, "input[0].content", "invalid_type"),
    ({**OK, "input": 7}, 400, "input", "invalid_type"),
    ({**OK, "input": []}, 400, "input", "invalid_value"),
    ({"model": MODEL}, 400, "input", "missing_required_parameter"),
    ({**OK, "tools": [{"type": "web_search"}]}, 400, "tools[0].type", "unsupported_parameter"),
    ({**OK, "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, 400, "tools[0].type",
     "unsupported_parameter"),
    ({**OK, "tools": [{"type": "computer_use_preview", "display_width": 1}]}, 400, "tools[0].type",
     "unsupported_parameter"),
    ({**OK, "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0].name", "invalid_value"),
    ({**OK, "tools": [{"type": "function"}]}, 400, "tools[0].name", "missing_required_parameter"),
    ({**OK, "tools": [WEATHER], "tool_choice": "required"}, 400, "tool_choice", "unsupported_parameter"),
    ({**OK, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice",
     "invalid_value"),
    ({**OK, "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice", "unsupported_parameter"),
    ({**OK, "tools": [WEATHER], "tool_choice": {"type": "function", "name": ""}}, 400, "tool_choice.name",
     "invalid_value"),
    ({**OK, "tools": [WEATHER] * 129}, 400, "tools", "too_many_tools"),
    ({**OK, "input": [{"role": "user", "content": "x"}] * 2048}, 400, "input", "too_many_messages"),
    ({**OK, "tools": [{**WEATHER, "parameters": {"maximum": 2**70}}], "tool_choice": "none"}, 400, "tools",
     "invalid_value"),
    ({**OK, "background": True}, 400, "background", "unsupported_parameter"),
    ({**OK, "reasoning": {"effort": "high"}}, 400, "reasoning", "unsupported_parameter"),
    ({**OK, "conversation": "conv_1"}, 400, "conversation", "unsupported_parameter"),
    ({**OK, "prompt": {"id": "p"}}, 400, "prompt", "unsupported_parameter"),
    ({**OK, "truncation": "auto"}, 400, "truncation", "unsupported_parameter"),
    ({**OK, "top_logprobs": 2}, 400, "top_logprobs", "unsupported_parameter"),
    ({**OK, "include": ["reasoning.encrypted_content"]}, 400, "include[0]", "unsupported_parameter"),
    ({**OK, "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, 400, "text.format",
     "unsupported_parameter"),
    ({**OK, "temperature": 3}, 400, "temperature", "invalid_value"),
    ({**OK, "max_output_tokens": 0}, 400, "max_output_tokens", "invalid_value"),
    ({**OK, "max_output_tokens": 5000}, 400, "max_output_tokens", "context_length_exceeded"),
    ({**OK, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({**OK, "previous_response_id": "resp_nope"}, 404, "previous_response_id", "previous_response_not_found"),
])
async def test_bad_input_is_a_typed_error(h, body, status, param, code):
    async with h.http() as http:
        r = await http.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert h.manager.requests == []  # refused before the trajectory manager


async def test_another_sessions_response_is_not_found(h):
    mine, theirs = h.sdk(h.session_key("sess-a")), h.sdk(h.session_key("sess-b"))
    r = await mine.responses.create(model=MODEL, input="secret")
    assert h.manager.requests[-1].session_id == "sess-a"
    with pytest.raises(openai.NotFoundError, match="not found") as info:
        await theirs.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        await theirs.responses.retrieve(r.id)
    assert (await mine.responses.retrieve(r.id)).id == r.id
    assert (await h.sdk().responses.retrieve(r.id)).id == r.id  # the user key that owns the session may
    h.redis.data[KEY_PREFIX + digest("sk-other-user")] = msgspec.json.encode(KeyRecord(kind="user", created=1.0))
    with pytest.raises(openai.NotFoundError):  # another tenant's user key may not
        await h.sdk("sk-other-user").responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await h.sdk("sk-other-user").responses.create(model=MODEL, input="x", previous_response_id=r.id)


async def test_store_false_is_stateless(h):
    r = await h.sdk().responses.create(model=MODEL, input="x", store=False)
    assert r.store is False and not [k for k in h.redis.data if k.startswith("sf:resp:")]
    with pytest.raises(openai.NotFoundError):
        await h.sdk().responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await h.sdk().responses.create(model=MODEL, input="y", previous_response_id=r.id)


async def test_auth_and_openapi(h):
    async with h.http(key="sk-nope") as http:
        assert (await http.post("/v1/responses", json=OK)).status_code == 401
        assert (await http.get("/v1/responses/resp_x")).status_code == 401
        doc = (await http.get("/openapi.json")).json()
    assert doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponseCreateRequest"}
    assert "/v1/responses/{response_id}" in doc["paths"]
    # the published schema is what the server decodes: a body it rejects by shape, the schema rejects too
    import jsonschema

    schema = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ResponseCreateRequest",
                                              "components": doc["components"]})
    bodies = [OK, {**OK, "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}],
                   "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}},
              {**OK, "input": 7}, {**OK, "temperature": 2.5}, {**OK, "tool_choice": "sometimes"}, {"input": "x"},
              {**OK, "input": [{"role": "robot", "content": "x"}]}, {**OK, "max_output_tokens": 0}]
    async with h.http() as http:
        for body in bodies:
            r = await http.post("/v1/responses", json=body)
            assert schema.is_valid(body) == (r.status_code == 200), (body, r.text)


# --- the formats, validated by the SDK's own models -------------------------------------------------

def _body(**fields) -> ResponseCreateRequest:
    return decode(msgspec.json.encode({"model": MODEL, **fields}), ResponseCreateRequest)


def _events(stream: rfmt.EventStream, replies) -> list[dict]:
    raw = stream.start()
    for reply in replies:
        raw += stream.delta(reply.text, reply.offset) if isinstance(reply, ChatDelta) else b"".join(stream.done(reply))
    out = []
    for block in raw.decode().strip().split("\n\n"):
        event, data = block.split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert event == "event: " + out[-1]["type"]
    return out


@pytest.mark.parametrize("replies", [
    [ChatDelta("r", "a", 0), ChatDelta("r", "a b", 0), ChatDone("r", "a bc", "stop", Usage(1, 2), 0)],  # resumed
    [ChatDone("r", "", "tool_calls", Usage(1, 2), 0, [ToolCall("c1", "f", "{}"), ToolCall("c2", "g", '{"x": 1}')])],
    [ChatDelta("r", "so", 0), ChatDone("r", "so", "tool_calls", Usage(1, 2), 0, [ToolCall("c1", "f", "{}")])],
    [ChatDone("r", "", "length", Usage(1, 2), 0)],
])
def test_event_stream_shapes_are_what_the_sdk_validates(replies):
    shape = rfmt.Shape("resp_r", 5, MODEL, _body(input="x", tools=[WEATHER]), "s")
    events = _events(rfmt.EventStream(shape), replies)
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)  # strict: every required field, every literal
    final = Response.model_validate(events[-1]["response"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = replies[-1]
    assert text == done.text and final.output_text == done.text
    assert [i.call_id for i in final.output if i.type == "function_call"] == [c.id for c in done.tool_calls]
    assert final.status == ("incomplete" if done.finish_reason == "length" else "completed")
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(final.output)))
