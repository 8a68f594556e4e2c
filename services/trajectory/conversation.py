"""Canonical OpenAI messages and conversation keys (pure).

A turn is found again by the key of the messages that led to it plus the reply
the agent received. Keys ignore what agents are free to change without changing
meaning: tool-call ids, JSON spacing in tool arguments, `null` versus "" content.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


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


def conversation_key(tools: list[dict[str, Any]], messages: list[dict[str, Any]]) -> str:
    body = json.dumps({"tools": tools, "messages": [canonical(m) for m in messages]}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def candidate_prefixes(messages: list[dict[str, Any]]) -> list[int]:
    """Lengths k, longest first, where messages[:k] ends with an assistant turn that may be stored."""
    return [k for k in range(len(messages) - 1, 0, -1) if messages[k - 1].get("role") == "assistant"]
