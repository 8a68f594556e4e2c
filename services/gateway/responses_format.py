"""Responses API shapes, built from the trajectory manager's replies. Pure: no I/O.

`Shape` holds what a response echoes of its request; `Shape.response(done)` is the
Response object of a finished turn (the body of a non-streamed one, of the final stream
event, and of GET /v1/responses/{id}). `EventStream` turns ChatDelta/ChatDone/ChatFailed
into the Responses event stream, each event with the next `sequence_number`:

    response.created -> response.in_progress
    [message:  output_item.added -> content_part.added -> output_text.delta* -> output_text.done
               -> content_part.done -> output_item.done]
    [per call: output_item.added -> function_call_arguments.delta -> function_call_arguments.done
               -> output_item.done]
    -> response.completed (or response.incomplete when max_output_tokens cut it)

Text streams as it comes; tool calls come whole at the end (the trajectory manager holds a
possible `<tool_call>` back until it parses). A failure after the stream started is one
`error` event (it also carries an "error" object, on which the SDK raises APIError), then
the stream ends. Output item ids derive from the request id, so a response and its stream
name the same items.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from services.gateway.openai_format import extension, unsent
from services.gateway.responses_schemas import ResponseCreateRequest
from shared.messages.chat import ChatDone, ToolCall, Usage

_json = msgspec.json.Encoder()


def usage(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def logprobs(done: ChatDone) -> list[dict[str, Any]]:
    """The recorded behaviour logprobs of the reply's tokens (sampled tokens only: no alternatives)."""
    return [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()), "top_logprobs": []}
            for t in done.logprobs]


def text_part(text: str, lps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": lps or []}


def message_item(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def echo(req: ResponseCreateRequest) -> dict[str, Any]:
    """What a Response repeats of its request (OpenAI's defaults where it was not given)."""
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
              "strict": t.strict} for t in req.tools or []]
    choice = req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None else \
        {"type": req.tool_choice.type, "name": req.tool_choice.name}
    return {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "text": {"format": {"type": "text"}},
        "tool_choice": choice or "auto", "tools": tools, "truncation": "disabled", "background": False,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "top_logprobs": 0,
        "max_tool_calls": None, "user": req.user, "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
    }


class Shape:
    """One response's identity (id, creation time, model, echoed request) and its Response objects."""

    def __init__(self, id: str, created: int, model: str, req: ResponseCreateRequest, session_id: str) -> None:
        self.id = id
        self.request_id = id.removeprefix("resp_")
        self.created = created
        self.model = model
        self.echo = echo(req)
        self.session_id = session_id
        self.message_id = "msg_" + self.request_id

    def call_id(self, i: int) -> str:
        return f"fc_{self.request_id}_{i}"

    def base(self, status: str) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": [], "error": None, "incomplete_details": None, "usage": None,
                **self.echo}

    def output(self, done: ChatDone, message: bool = False) -> list[dict[str, Any]]:
        """The output items: the message (if it has text, or is all there is, or `message` says a
        stream already opened it), then one function_call per tool call."""
        status = "incomplete" if done.finish_reason == "length" else "completed"
        items = []
        if message or done.text or not done.tool_calls:
            items.append(message_item(self.message_id, status, [text_part(done.text, logprobs(done))]))
        items += [call_item(self.call_id(i), c, "completed") for i, c in enumerate(done.tool_calls)]
        return items

    def response(self, done: ChatDone, message: bool = False) -> dict[str, Any]:
        cut = done.finish_reason == "length"
        return {**self.base("incomplete" if cut else "completed"),
                "completed_at": None if cut else int(time.time()),
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "output": self.output(done, message), "usage": usage(done.usage),
                "seamlessflow": extension(self.session_id, done)}


class EventStream:
    """The SSE events of one streamed response (see the module docstring for their order)."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.seq = 0
        self.sent = ""  # text already streamed
        self.open = False  # the message item was added

    def _event(self, type: str, **fields: Any) -> bytes:
        data = _json.encode({"type": type, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + type.encode() + b"\ndata: " + data + b"\n\n"

    def _item(self, **fields: Any) -> dict[str, Any]:
        return {"item_id": self.shape.message_id, "output_index": 0, "content_index": 0, **fields}

    def start(self) -> bytes:
        return (self._event("response.created", response=self.shape.base("in_progress"))
                + self._event("response.in_progress", response=self.shape.base("in_progress")))

    def _open(self) -> bytes:
        self.open = True
        return (self._event("response.output_item.added", output_index=0,
                            item=message_item(self.shape.message_id, "in_progress", []))
                + self._event("response.content_part.added", **self._item(part=text_part(""))))

    def delta(self, text: str, offset: int | None = None) -> bytes:
        """Text from character `offset` of the reply on; only what the agent has not seen goes
        out (openai_format.unsent)."""
        text = unsent(self.sent, text, offset)
        if not text:
            return b""
        start = b"" if self.open else self._open()
        self.sent += text
        return start + self._event("response.output_text.delta", **self._item(delta=text, logprobs=[]))

    def done(self, done: ChatDone) -> list[bytes]:
        events: list[bytes] = []
        if done.text.startswith(self.sent) and len(done.text) > len(self.sent):
            events.append(self.delta(done.text[len(self.sent):]))
        if not self.open and (done.text or not done.tool_calls):
            events.append(self._open())
        final = self.shape.response(done, message=self.open)
        items = final["output"]
        if self.open:
            message = items[0]
            part = message["content"][0]
            events += [self._event("response.output_text.done", **self._item(text=part["text"],
                                                                             logprobs=part["logprobs"])),
                       self._event("response.content_part.done", **self._item(part=part)),
                       self._event("response.output_item.done", output_index=0, item=message)]
        for index, item in enumerate(items[1 if self.open else 0:], start=1 if self.open else 0):
            events += self._call(index, item)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=final))
        return events

    def _call(self, index: int, item: dict[str, Any]) -> list[bytes]:
        ids = {"item_id": item["id"], "output_index": index}
        return [self._event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **ids, arguments=item["arguments"],
                            name=item["name"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def error(self, body: dict[str, Any]) -> bytes:
        """`body` is an error body ({"error": {...}}); after it the stream ends."""
        error = body["error"]
        return self._event("error", code=error.get("code"), message=error.get("message", ""),
                           param=error.get("param"), error=error)
