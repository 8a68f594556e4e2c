"""shared/toolcalls.py: <tool_call> parsing and stream hold-back."""

from __future__ import annotations

from shared import toolcalls


def test_toolcall_parse_and_stream_holdback():
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls = toolcalls.parse(text, "r1")
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert calls[0].id.startswith("call_")
    # malformed JSON: no tool calls, all text is content
    bad = 'x<tool_call>{"name": </tool_call>'
    assert toolcalls.parse(bad, "r") == (bad, [])
    assert toolcalls.visible_prefix("hello <tool") == "hello "
    assert toolcalls.visible_prefix("hello <tool_call>{") == "hello "
    assert toolcalls.visible_prefix("a < b") == "a < b"
