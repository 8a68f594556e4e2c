"""Canonical OpenAI messages and conversation keys (pure).

A turn is found again by the key of the messages that led to it plus the reply
the agent received. Keys ignore what agents are free to change without changing
meaning: tool-call ids, JSON spacing in tool arguments, `null` versus "" content.

Keys are chained: the key after message i is a hash of the key after message i-1 and
message i (the first link hashes the tools), so the key of turn n is a hash of the key of
turn n-1 and what turn n added, and extending a known key costs only the new messages.

`raw_digest` is the other way to know a conversation again: a hash of the exact encoded
bytes, at C speed, with no canonical form. The trajectory manager remembers, per turn, the
raw digest of the request that made it (store.py: alias), so the next request, which resends
those messages unchanged before the reply and the new ones, finds the turn without walking
its history. Whatever the raw digest misses, the canonical keys still find.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import msgspec

from services.trajectory.messagelist import Messages

_CHAIN_SEED = b"sf-conversation-key-2\n"
_raw = msgspec.msgpack.Encoder()


def text_of(content: Any) -> str:
    """OpenAI content: a string, null, or a list of parts whose text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise ValueError(f"unsupported content type {type(content).__name__}")


def _norm_args(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def canonical(message: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.get("role"), "content": text_of(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {"name": c["function"]["name"], "arguments": _norm_args(c["function"].get("arguments", "{}"))}
            for c in calls
        ]
    if message.get("role") == "tool":
        out["tool_call_id"] = message.get("tool_call_id", "")
    return out


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """The message as chat templates expect it: string content, OpenAI tool_calls shape."""
    out = dict(message)
    out["content"] = text_of(message.get("content"))
    return out


def _link(key: str, payload: Any) -> str:
    body = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(key.encode() + b"\n" + body).hexdigest()[:32]


def chain_start(tools: list[dict[str, Any]]) -> str:
    """The key of an empty conversation with these tools."""
    return _link(_CHAIN_SEED.decode(), tools)


def extend_key(key: str, messages: list[dict[str, Any]]) -> str:
    """The key of (the conversation `key` names) + `messages`: work in the new messages only."""
    for m in messages:
        key = _link(key, canonical(m))
    return key


def conversation_key(tools: list[dict[str, Any]], messages: list[dict[str, Any]]) -> str:
    return extend_key(chain_start(tools), messages)


def prefix_keys(tools: list[dict[str, Any]], messages: list[dict[str, Any]], ks: list[int]) -> dict[int, str]:
    """conversation_key(tools, messages[:k]) for each k in `ks`, and for len(messages), in one pass."""
    want = set(ks)
    out: dict[int, str] = {}
    key = chain_start(tools)
    for k, m in enumerate(messages, 1):
        key = _link(key, canonical(m))
        if k in want:
            out[k] = key
    out[len(messages)] = key
    return out


def raw_digest(tools: list[dict[str, Any]], messages: Sequence[dict[str, Any]]) -> str:
    """A hash of the exact messages as sent (key order, ids and spacing included): of the tools' msgpack
    bytes and then each message's, one after the other (each is one whole msgpack value, so the
    concatenation reads back one way only). Messages not yet decoded (messagelist.Messages) are hashed
    as the bytes they came in, the same bytes."""
    return raw_digests(tools, messages, len(messages))[1]


def raw_digests(tools: list[dict[str, Any]], messages: Sequence[dict[str, Any]], k: int) -> tuple[str, str]:
    """(raw_digest(tools, messages[:k]), raw_digest(tools, messages)), hashing the messages once: a
    request's digest of what it resends and its own (prompts.request_digests) cost one pass over the
    history, not two (each pass ~18 µs at turn 200)."""
    raws = messages.raws if isinstance(messages, Messages) else [_raw.encode(m) for m in messages]
    h = hashlib.sha256(_raw.encode(tools))
    h.update(b"".join(raws[:k]))
    head = h.hexdigest()[:32]
    h.update(b"".join(raws[k:]))
    return head, h.hexdigest()[:32]


def candidate_prefixes(messages: list[dict[str, Any]]) -> list[int]:
    """Lengths k, longest first, where messages[:k] ends with an assistant turn that may be stored."""
    return [k for k in range(len(messages) - 1, 0, -1) if messages[k - 1].get("role") == "assistant"]


def last_reply(messages: list[dict[str, Any]]) -> int:
    """The longest candidate prefix (0 if none), looking back only as far as the last assistant
    message: what a request that extends its previous turn adds."""
    for k in range(len(messages) - 1, 0, -1):
        if messages[k - 1].get("role") == "assistant":
            return k
    return 0
