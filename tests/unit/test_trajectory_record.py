"""services/trajectory/record.py: the Turn and the ChatDone of a finished generation agree."""

from __future__ import annotations

from services.trajectory.conversation import conversation_key
from services.trajectory.generation import Generated
from services.trajectory.record import Prompt, last_worker, record, versions_of
from services.trajectory.turns import Segment
from shared.messages import ChatRequest, Sampling

USER = [{"role": "user", "content": "weather?"}]
TOOLS = [{"type": "function", "function": {"name": "get"}}]


def gen(*segs: Segment, finish: str = "stop") -> Generated:
    return Generated(segments=list(segs), finish_reason=finish)


def texts(ids):  # every token shows, as its id
    return [(k, str(t)) for k, t in enumerate(ids)]


def test_a_chat_turn_records_the_reply_the_agent_sees():
    req = ChatRequest("r", "s", "chat", "m", Sampling(), messages=USER, logprobs=True)
    g = gen(Segment([1, 2], [-0.1, -0.2], 3, "w0"), Segment([3], [-0.3], 4, "w1"))
    turn, done = record(req, "s", 7, Prompt([9, 9, 9], [9], 2, USER), g, "sunny", texts, created=5.0)
    assert (turn.turn_id, turn.parent, turn.prefix_ids, turn.segments, turn.created) == (7, 2, [9], g.segments, 5.0)
    assert turn.reply == {"role": "assistant", "content": "sunny"} and turn.messages == USER
    assert turn.key == conversation_key([], USER + [turn.reply])
    assert (done.text, done.finish_reason, done.turn_id, done.session_id, done.versions) == ("sunny", "stop", 7, "s", [3, 4])
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 3)
    assert [(lp.token, lp.logprob) for lp in done.logprobs] == [("1", -0.1), ("2", -0.2), ("3", -0.3)]
    assert last_worker(g, "sticky") == "w1" and last_worker(gen(), "sticky") == "sticky"


def test_tool_calls_become_the_finish_reason_and_part_of_the_key():
    req = ChatRequest("r", "s", "chat", "m", Sampling(), messages=USER, tools=TOOLS)
    text = 'let me look <tool_call>{"name": "get", "arguments": {"city": "Oslo"}}</tool_call>'
    turn, done = record(req, "s", 0, Prompt([1], [1], -1, USER), gen(Segment([5], [0.0], 0, "w")), text, texts, 0.0)
    assert done.finish_reason == "tool_calls" and done.text == "let me look " and done.tool_calls[0].name == "get"
    assert turn.reply["tool_calls"][0]["function"] == {"name": "get", "arguments": '{"city": "Oslo"}'}
    assert turn.key == conversation_key(TOOLS, USER + [turn.reply]) and done.logprobs == []


def test_a_completion_has_no_conversation_key_and_length_stays_length():
    req = ChatRequest("r", "s", "completion", "m", Sampling(), prompt="once")
    turn, done = record(req, "s", 0, Prompt([1], [1], -1, [{"role": "user", "content": "once"}]),
                        gen(Segment([5], [0.0], 0, "w"), finish="length"), " upon", texts, 0.0)
    assert turn.key == "" and turn.reply == {"role": "assistant", "content": " upon"} and done.finish_reason == "length"


def test_versions_are_listed_once_per_run():
    g = gen(Segment([1], [0.0], 1, "a"), Segment([2], [0.0], 1, "b"), Segment([3], [0.0], 2, "b"))
    assert versions_of(g) == [1, 2]
