"""OpenAI response shapes, built from the trajectory manager's replies. Pure: no I/O.

Non-streaming: `chat_completion` / `text_completion` turn one ChatDone into the
response object. Streaming: a `ChunkStream` turns ChatDelta/ChatDone/ChatFailed
into Server-Sent Events bytes, in the order the official SDK expects:

    role chunk (chat only) -> content chunks -> [tool_calls chunk] -> finish chunk
    -> [usage chunk, when stream_options.include_usage] -> data: [DONE]

A failure after the stream started is one `data: {"error": {...}}` event, then
the stream ends (the SDK raises APIError on it).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from shared.messages.chat import ChatDone, ToolCall, Usage

_json = msgspec.json.Encoder()

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def usage(u: Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def tool_calls(calls: list[ToolCall], indexed: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(calls):
        call: dict[str, Any] = {"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}}
        out.append({"index": i, **call} if indexed else call)
    return out


def extension(session_id: str, done: ChatDone) -> dict[str, Any]:
    """The "seamlessflow" field: where this turn landed in the trajectory (SDKs ignore it).
    A turn sent with a user key lands in a one-off session, named by ChatDone.session_id."""
    return {"session_id": done.session_id or session_id, "turn_id": done.turn_id, "versions": list(done.versions)}


def chat_logprobs(done: ChatDone) -> dict[str, Any] | None:
    """OpenAI's chat `logprobs` object, if the request asked for logprobs (else None)."""
    if not done.logprobs:
        return None
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
                         "top_logprobs": []} for t in done.logprobs], "refusal": None}


def completion_logprobs(done: ChatDone) -> dict[str, Any] | None:
    """The legacy completions `logprobs` object (sampled tokens only: no alternatives)."""
    if not done.logprobs:
        return None
    offsets, at = [], 0
    for t in done.logprobs:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in done.logprobs], "token_logprobs": [t.logprob for t in done.logprobs],
            "top_logprobs": None, "text_offset": offsets}


def chat_completion(id: str, created: int, model: str, done: ChatDone, session_id: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": done.text, "refusal": None}
    if done.tool_calls:
        message["tool_calls"] = tool_calls(done.tool_calls)
        message["content"] = done.text or None  # OpenAI sends null content beside tool calls
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": chat_logprobs(done),
                     "finish_reason": done.finish_reason}],
        "usage": usage(done.usage),
        "system_fingerprint": None,
        "seamlessflow": extension(session_id, done),
    }


def completion_finish_reason(done: ChatDone) -> str:
    return "stop" if done.finish_reason == "tool_calls" else done.finish_reason


def text_completion(id: str, created: int, model: str, done: ChatDone, session_id: str) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": done.text, "logprobs": completion_logprobs(done),
                     "finish_reason": completion_finish_reason(done)}],
        "usage": usage(done.usage),
        "system_fingerprint": None,
        "seamlessflow": extension(session_id, done),
    }


def unsent(sent: str, text: str, offset: int | None) -> str:
    """What of `text` (the reply from character `offset` on) the agent has not seen, given that
    `sent` went out. A resumed request re-sends from offset 0. A piece beyond what was sent means
    one was lost on the way (core NATS is at most once; a NATS restart drops what is in flight):
    nothing more goes out until the final message sends the rest whole."""
    if offset is None:
        return text
    if offset > len(sent):
        return ""
    return text[len(sent) - offset:] if offset < len(sent) else text


class ChunkStream:
    """SSE events for one streamed turn. Tracks the text already sent, so that a ChatDone
    whose text goes beyond the deltas (a responder that held text back) is completed, not lost.
    """

    def __init__(self, kind: Literal["chat", "completion"], id: str, created: int, model: str,
                 include_usage: bool, session_id: str = "") -> None:
        self.kind = kind
        self.id = id
        self.created = created
        self.model = model
        self.include_usage = include_usage
        self.session_id = session_id
        self.sent = ""

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.include_usage:
            obj["usage"] = None  # OpenAI sends usage: null on every chunk but the last
        obj.update(extra)
        return sse(obj)

    def _choice(self, delta: dict[str, Any] | None = None, text: str = "",
                finish_reason: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            return {"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def start(self) -> bytes:
        """The first event: the assistant role (chat); completions have no such chunk."""
        if self.kind != "chat":
            return b""
        return self._chunk([self._choice({"role": "assistant", "content": ""})])

    def delta(self, text: str, offset: int | None = None) -> bytes:
        """Content from character `offset` of the reply on; only what the agent has not seen
        goes out (b"" if none; see `unsent`)."""
        text = unsent(self.sent, text, offset)
        if not text:
            return b""
        self.sent += text
        return self._chunk([self._choice({"content": text}, text=text)])

    def done(self, done: ChatDone) -> list[bytes]:
        events: list[bytes] = []
        if done.text.startswith(self.sent) and len(done.text) > len(self.sent):
            events.append(self.delta(done.text[len(self.sent):]))
        if self.kind == "chat":
            if done.tool_calls:
                events.append(self._chunk([self._choice({"tool_calls": tool_calls(done.tool_calls, indexed=True)})]))
            finish = done.finish_reason
        else:
            finish = completion_finish_reason(done)
        # logprobs, when asked for, come whole with the final chunk (clients concatenate
        # chunks' logprobs, so the total is the same)
        lps = chat_logprobs(done) if self.kind == "chat" else completion_logprobs(done)
        events.append(self._chunk([self._choice(finish_reason=finish, logprobs=lps)],
                                  seamlessflow=extension(self.session_id, done)))
        if self.include_usage:
            events.append(self._chunk([], usage=usage(done.usage)))
        events.append(SSE_DONE)
        return events

    def error(self, body: dict[str, Any]) -> bytes:
        """`body` is an error body ({"error": {...}}); after it the stream ends without [DONE]."""
        return sse(body)
