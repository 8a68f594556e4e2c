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


def test_keys_are_chained_so_a_known_key_extends_by_the_new_messages_alone():
    from services.trajectory.conversation import chain_start, extend_key, last_reply, prefix_keys

    tools = [{"type": "function", "function": {"name": "f"}}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "a2"}, {"role": "tool", "tool_call_id": "t", "content": "r"}]
    ks = candidate_prefixes(msgs)
    keys = prefix_keys(tools, msgs, ks)
    assert set(keys) == {5, 3, 6}
    for k in keys:
        assert keys[k] == conversation_key(tools, msgs[:k])
    assert extend_key(keys[3], msgs[3:5]) == keys[5] == extend_key(extend_key(chain_start(tools), msgs[:3]), msgs[3:5])
    assert last_reply(msgs) == 5 and last_reply(msgs[:2]) == 0


def test_the_raw_digest_is_the_exact_bytes():
    from services.trajectory.conversation import raw_digest

    a = [{"role": "user", "content": "hi"}]
    assert raw_digest([], a) == raw_digest([], [{"role": "user", "content": "hi"}])
    assert raw_digest([], a) != raw_digest([], [{"content": "hi", "role": "user"}])  # what canonical keys ignore
    assert raw_digest([], a) != raw_digest([{"type": "function"}], a)
