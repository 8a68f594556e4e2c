"""messagelist.py: a request's messages decoded only where read give what the decoded list gives
(digests, keys, short histories, continuations), and a long request reads only its end."""

from __future__ import annotations

import random

import msgspec
import pytest

from services.trajectory.conversation import conversation_key, last_reply, prefix_keys, raw_digest, raw_digests
from services.trajectory.messagelist import ChatRequestIn, InvalidMessage, Messages
from services.trajectory.prompts import follow_digest, request_digests
from services.trajectory.rendering import Renderer, short_history
from shared.codec import decode, encode
from shared.messages import ChatRequest, Sampling

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


def conversation(turns: int, seed: int = 0) -> list[dict]:
    """A tool agent's conversation: system, user, then tool calls, tool results and replies, with
    the odd float, null, unicode and nested value a real one carries."""
    rng = random.Random(seed)
    msgs: list[dict] = [{"role": "system", "content": "you are brief"}, {"role": "user", "content": "2+2? ünï"}]
    for t in range(turns):
        if rng.random() < 0.5:
            msgs.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{t}", "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "%d*%.3f"}' % (t, rng.random())}}]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{t}", "content": str(rng.random())})
        else:
            msgs.append({"role": "assistant", "content": f"step {t}: {rng.random()}"})
            msgs.append({"role": "user", "content": [{"type": "text", "text": f"go on {t}"}], "weight": 1.5})
    return msgs


def both(msgs: list[dict], tools=TOOLS) -> tuple[ChatRequest, ChatRequest]:
    req = ChatRequest(request_id="r", session_id="s", kind="chat", model="m", sampling=Sampling(max_tokens=4),
                      messages=msgs, tools=tools)
    data = encode(req)
    return decode(data, ChatRequest), decode(data, ChatRequestIn)


@pytest.mark.parametrize("seed", range(5))
def test_digests_and_keys_are_the_decoded_lists(seed):
    plain, lazy = both(conversation(30, seed))
    assert isinstance(lazy.messages, Messages) and lazy.messages == plain.messages
    assert raw_digest(lazy.tools, lazy.messages) == raw_digest(plain.tools, plain.messages)
    assert follow_digest(lazy) == follow_digest(plain) != ""
    for k in (0, 1, 7, len(plain.messages)):
        assert raw_digest(TOOLS, lazy.messages[:k]) == raw_digest(TOOLS, plain.messages[:k])
    ks = [3, 9, 20]
    assert prefix_keys(TOOLS, lazy.messages, ks) == prefix_keys(TOOLS, plain.messages, ks)
    assert conversation_key(TOOLS, lazy.messages + [{"role": "assistant", "content": "x"}]) == \
        conversation_key(TOOLS, plain.messages + [{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("seed", range(3))
def test_one_pass_gives_the_digest_of_a_prefix_and_of_the_whole(seed):
    plain, lazy = both(conversation(12, seed))
    n = len(plain.messages)
    for k in (0, 1, 5, n):
        for req in (plain, lazy):
            assert raw_digests(TOOLS, req.messages, k) == (raw_digest(TOOLS, plain.messages[:k]),
                                                           raw_digest(TOOLS, plain.messages))
    assert len({raw_digest(TOOLS, plain.messages[:k]) for k in range(n + 1)}) == n + 1  # every prefix its own
    k = last_reply(plain.messages)
    assert request_digests(lazy) == request_digests(plain) == (raw_digest(TOOLS, plain.messages[:k - 1]),
                                                              raw_digest(TOOLS, plain.messages))
    # where the messages end before any reply, nothing is followed but the request is still named
    first = both([{"role": "user", "content": "hi"}])[1]
    assert request_digests(first) == ("", raw_digest(TOOLS, first.messages))


def test_a_long_request_decodes_only_its_end_for_the_follow():
    plain, lazy = both(conversation(200, seed=1) + [{"role": "user", "content": "next"}])
    follow_digest(lazy)
    decoded = [i for i, d in enumerate(lazy.messages._dicts) if d is not None]
    n = len(plain.messages)
    assert decoded and min(decoded) >= n - 3, decoded  # the new message(s) and the reply, no more
    assert last_reply(lazy.messages) == last_reply(plain.messages)


def test_slices_and_sums_behave_as_lists():
    plain, lazy = both(conversation(6, seed=2))
    p, m = plain.messages, lazy.messages
    assert m[3:] == p[3:] and m[:-2] == p[:-2] and m[::2] == p[::2] and m[-1] == p[-1]
    assert isinstance(m[2:5], Messages) and len(m[2:5]) == 3
    assert m[:2] + [{"a": 1}] == p[:2] + [{"a": 1}] and [{"a": 1}] + m[4:] == [{"a": 1}] + p[4:]
    assert isinstance(m[:2] + m[4:], list) and m[:2] + m[4:] == p[:2] + p[4:]
    assert short_history(m) == short_history(p) and short_history(m[:5]) == short_history(p[:5])
    assert list(m) == p and m != p[:-1]


def test_continuations_are_the_same(tiny_model):
    renderer = Renderer.from_pretrained(str(tiny_model))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    for t in range(6):
        msgs += [{"role": "assistant", "content": f"reply {t}"}, {"role": "user", "content": f"more {t}"}]
    plain, lazy = both(msgs, tools=[])
    k = last_reply(plain.messages)
    for always_check in (False, True):
        renderer.always_check = always_check
        got = renderer.continuation(lazy.messages[:k], lazy.messages[k:], [], history_ends_with_eos=True)
        assert got == renderer.continuation(plain.messages[:k], plain.messages[k:], [], history_ends_with_eos=True)
        assert renderer.prompt(lazy.messages, []) == renderer.prompt(plain.messages, [])


def test_a_message_that_is_no_object_is_refused_where_read_with_its_index():
    data = encode(ChatRequest(request_id="r", session_id="s", kind="chat", model="m", sampling=Sampling(max_tokens=4),
                              messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]))
    req = decode(data, ChatRequest)
    raws = decode(encode([{"role": "user", "content": "a"}, 7, "x"]), list[msgspec.Raw])
    req.messages = Messages(raws)
    assert req.messages[0]["content"] == "a"
    with pytest.raises(InvalidMessage, match=r"messages\[1\]"):
        req.messages[1]
    with pytest.raises(InvalidMessage, match=r"messages\[2\]"):
        req.messages[1:][1]
    with pytest.raises(msgspec.ValidationError):  # the request itself is still checked at decode
        decode(encode({"type": "ChatRequest", "request_id": 1}), ChatRequestIn)
