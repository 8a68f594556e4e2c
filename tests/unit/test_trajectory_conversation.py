"""services/trajectory/conversation.py: canonical messages and conversation keys."""

from __future__ import annotations

from services.trajectory.conversation import candidate_prefixes, canonical, conversation_key


def test_conversation_key_ignores_what_agents_may_rewrite():
    a = [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}]}]
    b = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
         {"role": "assistant", "content": "",
          "tool_calls": [{"id": "y", "type": "function", "function": {"name": "f", "arguments": '{"b":2,"a":1}'}}]}]
    assert conversation_key([], a) == conversation_key([], b)
    assert conversation_key([], a) != conversation_key([{"type": "function"}], a)
    c = [{"role": "user", "content": "hi!"}] + a[1:]
    assert conversation_key([], a) != conversation_key([], c)
    assert canonical({"role": "tool", "tool_call_id": "t1", "content": "ok"})["tool_call_id"] == "t1"


def test_candidate_prefixes_end_on_assistant_turns_longest_first():
    roles = ["system", "user", "assistant", "user", "assistant", "tool"]
    msgs = [{"role": r, "content": ""} for r in roles]
    assert candidate_prefixes(msgs) == [5, 3]
