"""Tool calls in model text, Hermes/Qwen style (pure).

The model writes `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`
inside its turn; the chat template from `seamlessflow init-model` renders the same
format back. The assistant message content is the text before the first
`<tool_call>`; if any block fails to parse as JSON with a string "name", the reply
has no tool calls and all of its text is content.
"""

from __future__ import annotations

import hashlib
import json
import re

from shared.messages import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse(text: str, request_id: str) -> tuple[str, list[ToolCall]]:
    """Split model text into (content, tool_calls)."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for i, block in enumerate(_BLOCK.findall(text[start:])):
        try:
            obj = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        arguments = args if isinstance(args, str) else json.dumps(args)
        call_id = "call_" + hashlib.sha1(f"{request_id}:{i}".encode()).hexdigest()[:16]
        calls.append(ToolCall(id=call_id, name=obj["name"], arguments=arguments))
    if not calls:
        return text, []
    return text[:start], calls


def visible_prefix(text: str) -> str:
    """How much of a growing text can be streamed as content now.

    Stops before a `<tool_call>` and holds back a tail that could still become one.
    """
    start = text.find(OPEN)
    if start >= 0:
        return text[:start]
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return text[:-n]
    return text
