"""sf.chat: OpenAI-level turns between the gateway and the trajectory manager.

The gateway validates HTTP input and forwards a `ChatRequest`; the trajectory
manager renders, tokenizes, generates and records, then streams `ChatDelta`s
(if asked) and ends with one `ChatDone` or `ChatFailed`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from shared.messages.rollout import Sampling


class ChatRequest(msgspec.Struct, tag=True, omit_defaults=True):
    request_id: str
    session_id: str
    kind: Literal["chat", "completion"]
    model: str
    sampling: Sampling
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    prompt: str = ""  # kind == "completion"
    # Retired: nobody reads it (the trajectory manager always streams to the gateway, for liveness;
    # `agent_streams` says whether the agent does). Kept, with its default, for older senders.
    stream: bool = False
    stop: list[str] = []  # OpenAI stop strings, matched on the decoded text by the trajectory manager
    logprobs: bool = False  # return each generated token's behaviour logprob in ChatDone
    # Does the agent see deltas as they come (OpenAI's `stream`)? Deltas always flow to the gateway
    # (they double as liveness); if the agent does not stream, they are persisted in chunks and sent
    # as progress only now and then.
    agent_streams: bool = True
    # The longest prompt, in tokens, the gateway accepts (SF_GATEWAY_MAX_PROMPT_TOKENS); 0: only the
    # model's context window. The trajectory manager checks it: only it tokenizes.
    max_prompt_tokens: int = 0


class ToolCall(msgspec.Struct, omit_defaults=True):
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """One generated token as OpenAI's `logprobs` shows it: its text alone, and the
    behaviour logprob the rollout engine recorded (NaN if the engine gave none)."""

    token: str
    logprob: float


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int


class ChatDelta(msgspec.Struct, tag=True, gc=False):
    """`text` starts at character `offset` of the reply's content. A replica that resumes a
    request re-sends from offset 0, and the gateway forwards only what the agent lacks. An
    empty `text` is a keepalive: the replica serving a request sends one at least every
    KEEPALIVE_INTERVAL seconds, so the gateway can tell a dead replica from a slow model.

    Not array_like: msgspec decodes a tagged union only when all members share one layout."""

    request_id: str
    text: str
    offset: int = 0


class ChatDone(msgspec.Struct, tag=True, omit_defaults=True):
    request_id: str
    text: str
    finish_reason: Literal["stop", "length", "tool_calls"]
    usage: Usage
    turn_id: int
    tool_calls: list[ToolCall] = []
    versions: list[int] = []  # the policy versions that produced this turn, in order
    session_id: str = ""  # the session the turn was recorded in (a new one if none was given)
    logprobs: list[TokenLogprob] = []  # when the request asked for them: the reply's tokens, in order


class ChatFailed(msgspec.Struct, tag=True):
    """`status` is the HTTP status the gateway should answer with."""

    request_id: str
    status: int
    code: str
    message: str


ChatReply = ChatDelta | ChatDone | ChatFailed

KEEPALIVE_INTERVAL = 1.0  # seconds between keepalive ChatDeltas while a request runs


class ChatCancel(msgspec.Struct, tag=True):
    """Event on sf.chat.cancel: the agent disconnected; whoever serves `request_id` stops it."""

    request_id: str
