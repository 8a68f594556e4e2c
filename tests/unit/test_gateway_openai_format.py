"""OpenAI response and SSE chunk building (services/gateway/openai_format.py). Pure: no sockets.

The chunks are also parsed with the official SDK's own models, so a shape the SDK
would reject fails here before any integration test.
"""

from __future__ import annotations

import json

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.gateway import openai_format as fmt
from shared.messages.chat import ChatDone, ToolCall, Usage

DONE = ChatDone(request_id="r", text="Hello world", finish_reason="stop", usage=Usage(5, 2), turn_id=3, versions=[7, 8])
TOOLS = ChatDone(request_id="r", text="", finish_reason="tool_calls", usage=Usage(9, 4), turn_id=1,
                 tool_calls=[ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
                             ToolCall(id="call_2", name="get_time", arguments="{}")])


def events(raw: list[bytes]) -> list[dict | str]:
    out = []
    for e in raw:
        if not e:
            continue
        assert e.startswith(b"data: ") and e.endswith(b"\n\n")
        data = e[len(b"data: "):-2].decode()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_completion():
    body = fmt.chat_completion("chatcmpl-1", 100, "m", DONE, "s1")
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Hello world"
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.usage.total_tokens == 7
    assert body["seamlessflow"] == {"session_id": "s1", "turn_id": 3, "versions": [7, 8]}


def test_chat_completion_with_tool_calls():
    body = fmt.chat_completion("chatcmpl-1", 100, "m", TOOLS, "")
    msg = ChatCompletion.model_validate(body).choices[0].message
    assert msg.content is None
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        ("call_1", "function", "get_weather", '{"city": "Paris"}'), ("call_2", "function", "get_time", "{}")]
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_text_completion():
    body = fmt.text_completion("cmpl-1", 100, "m", TOOLS, "")
    parsed = Completion.model_validate(body)
    assert parsed.object == "text_completion" and parsed.choices[0].finish_reason == "stop"


def test_chat_stream_order_and_usage():
    s = fmt.ChunkStream("chat", "chatcmpl-1", 100, "m", include_usage=True, session_id="s1")
    raw = [s.start(), s.delta("Hello"), s.delta(""), s.delta(" wor"), *s.done(DONE)]
    ev = events(raw)
    assert ev[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in ev[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    # the text the deltas did not carry ("ld") is sent before the finish chunk
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
    assert ev[-3]["seamlessflow"]["versions"] == [7, 8]
    usage = ev[-2]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert all(e["usage"] is None for e in ev[:-2])


def test_chat_stream_without_usage_has_no_usage_key():
    s = fmt.ChunkStream("chat", "c", 1, "m", include_usage=False)
    ev = events([s.start(), *s.done(DONE)])
    assert all("usage" not in e for e in ev[:-1]) and ev[-1] == "[DONE]"


def test_chat_stream_tool_calls_have_indexes():
    s = fmt.ChunkStream("chat", "c", 1, "m", include_usage=False)
    ev = events([s.start(), *s.done(TOOLS)])
    chunk = ChatCompletionChunk.model_validate(ev[1])
    calls = chunk.choices[0].delta.tool_calls
    assert [(c.index, c.id, c.function.name) for c in calls] == [(0, "call_1", "get_weather"), (1, "call_2", "get_time")]
    assert ev[2]["choices"][0]["finish_reason"] == "tool_calls"


def test_completion_stream():
    s = fmt.ChunkStream("completion", "cmpl-1", 1, "m", include_usage=True)
    assert s.start() == b""
    ev = events([s.delta("Hello"), *s.done(DONE)])
    # (the SDK's Completion model types finish_reason as non-null, so check the dicts: OpenAI sends null too)
    assert [e["object"] for e in ev[:-1]] == ["text_completion"] * 4
    assert [e["choices"][0]["text"] for e in ev[:-2]] == ["Hello", " world", ""]
    assert [e["choices"][0]["finish_reason"] for e in ev[:-2]] == [None, None, "stop"]
    assert ev[-2]["usage"]["total_tokens"] == 7 and ev[-1] == "[DONE]"


def test_error_event_ends_without_done():
    s = fmt.ChunkStream("chat", "c", 1, "m", include_usage=False)
    body = {"error": {"message": "boom", "type": "server_error", "param": None, "code": "x"}}
    assert events([s.error(body)]) == [body]


def test_done_text_that_diverges_from_deltas_is_not_appended():
    s = fmt.ChunkStream("chat", "c", 1, "m", include_usage=False)
    s.delta("Goodbye")
    ev = events(s.done(DONE))
    assert ev[0]["choices"][0]["finish_reason"] == "stop"  # no stray content chunk


def test_resumed_deltas_are_deduplicated_by_offset():
    """A replica that resumes a request re-sends the reply from offset 0."""
    s = fmt.ChunkStream("chat", "c", 1, "m", include_usage=False)
    out = [s.delta("Hello", 0), s.delta(" wo", 5),
           s.delta("Hel", 0), s.delta("Hello wo", 0), s.delta("Hello world", 0), s.delta("!", 11)]
    texts = [e["choices"][0]["delta"]["content"] if e else None for e in
             [events([b])[0] if b else None for b in out]]
    assert texts == ["Hello", " wo", None, None, "rld", "!"]
    assert s.sent == "Hello world!"


def test_a_lost_delta_holds_the_rest_for_the_final_chunk():
    # found by tests/faults (a NATS restart dropped one ChatDelta): the agent got the text with a hole
    s = fmt.ChunkStream("chat", "c", 1, "m", include_usage=False)
    assert s.delta("Hel", 0) and not s.delta("o wor", 4) and not s.delta("ld", 9)  # "l" at 3 was lost
    ev = events(s.done(DONE))
    assert s.sent == DONE.text and ev[0]["choices"][0]["delta"]["content"] == DONE.text[3:]


def test_logprobs_in_responses_and_in_the_final_chunk():
    from shared.messages.chat import TokenLogprob

    done = ChatDone(request_id="r", text="Hé world", finish_reason="stop", usage=Usage(5, 2), turn_id=0,
                    logprobs=[TokenLogprob("Hé", -0.5), TokenLogprob(" world", -1.25)])
    content = ChatCompletion.model_validate(fmt.chat_completion("c", 1, "m", done, "")).choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes, c.top_logprobs) for c in content] == [
        ("Hé", -0.5, list("Hé".encode()), []), (" world", -1.25, list(b" world"), [])]
    legacy = Completion.model_validate(fmt.text_completion("c", 1, "m", done, "")).choices[0].logprobs
    assert (legacy.tokens, legacy.token_logprobs, legacy.text_offset) == (["Hé", " world"], [-0.5, -1.25], [0, 2])
    assert ChatCompletion.model_validate(fmt.chat_completion("c", 1, "m", DONE, "")).choices[0].logprobs is None

    s = fmt.ChunkStream("chat", "c", 1, "m", include_usage=False)
    chunks = [ChatCompletionChunk.model_validate(e) for e in events([s.start(), s.delta("Hé"), *s.done(done)])
              if e != "[DONE]"]
    got = [lp.token for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert got == ["Hé", " world"] and chunks[-1].choices[0].finish_reason == "stop"
