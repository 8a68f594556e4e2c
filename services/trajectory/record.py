"""The end of a turn (pure): from a finished generation, the `Turn` the prefix tree stores and
the `ChatDone` the agent gets.

They are made together so they cannot disagree: the reply message recorded in the turn (and
hashed into its conversation key) is the one the agent sees, tool calls included. Knows
nothing about Redis or NATS: chat.py saves the Turn and sends the ChatDone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.trajectory.conversation import conversation_key, extend_key
from services.trajectory.generation import Generated
from services.trajectory.tokenpath import TokenPath
from services.trajectory.turns import Turn
from shared import toolcalls
from shared.messages import ChatDone, ChatRequest, TokenLogprob, Usage

# generated token ids -> (index of each token that shows in the text, its text)
TokenTexts = Callable[[list[int]], list[tuple[int, str]]]


@dataclass
class Prompt:
    ids: TokenPath  # everything the engine reads (a list is taken as one)
    new_ids: list[int]  # the part this turn adds after its parent's tokens
    parent: int
    new_messages: list[dict[str, Any]]
    request_key: str = ""  # conversation key of the request's messages ("": hash them all when needed)
    raw: str = ""  # raw digest of the request's messages: the next request finds the turn by it

    def __post_init__(self) -> None:
        if not isinstance(self.ids, TokenPath):
            self.ids = TokenPath.of(list(self.ids))


def reply_message(content: str, calls: list) -> dict[str, Any]:
    reply: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        reply["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return reply


def versions_of(gen: Generated) -> list[int]:
    """The policy versions that produced the turn, in order, each once per run."""
    out: list[int] = []
    for s in gen.segments:
        if not out or out[-1] != s.version:
            out.append(s.version)
    return out


def turn_key(req: ChatRequest, prompt: Prompt, reply: dict[str, Any]) -> str:
    """The conversation key of the request's messages plus the reply (chained: only the reply is hashed)."""
    if prompt.request_key:
        return extend_key(prompt.request_key, [reply])
    return conversation_key(req.tools, req.messages + [reply])


def record(  # noqa: PLR0913  each is what one step of chat._handle made; the clock too, so this stays pure
        req: ChatRequest, session_id: str, turn_id: int, prompt: Prompt, gen: Generated, text: str,
        token_texts: TokenTexts, created: float) -> tuple[Turn, ChatDone]:
    """`text` is the generated text the agent may see (cut before a stop string)."""
    rid = req.request_id
    content, calls = toolcalls.parse(text, rid) if req.kind == "chat" and req.tools else (text, [])
    reply = reply_message(content, calls)
    turn = Turn(
        turn_id=turn_id,
        parent=prompt.parent,
        prefix_ids=prompt.new_ids,
        segments=gen.segments,
        finish_reason=gen.finish_reason,
        request_id=rid,
        created=created,
        key=turn_key(req, prompt, reply) if req.kind == "chat" else "",
        messages=prompt.new_messages,
        reply=reply if req.kind == "chat" else {"role": "assistant", "content": text},
    )
    logprobs: list[TokenLogprob] = []
    if req.logprobs:
        lps = [lp for seg in gen.segments for lp in seg.logprobs]
        logprobs = [TokenLogprob(t, lps[k]) for k, t in token_texts(gen.token_ids)]
    done = ChatDone(
        request_id=rid,
        text=content,
        finish_reason="tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason,
        usage=Usage(prompt_tokens=len(prompt.ids), completion_tokens=len(gen.token_ids)),
        turn_id=turn_id,
        tool_calls=calls,
        versions=versions_of(gen),
        session_id=session_id,
        logprobs=logprobs,
    )
    return turn, done


def last_worker(gen: Generated, default: str) -> str:
    """The worker that produced the turn's last tokens: the session sticks to it (prefix cache)."""
    return gen.segments[-1].worker_id if gen.segments else default
