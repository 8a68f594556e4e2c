"""Pure trajectory-manager logic: conversation keys, tool calls, the turn tree, routing and
the preemption-safe generation loop. The code under test stays real; only the rollout
transport (`call`) is faked, at the edge."""

from __future__ import annotations

import pytest

from services.trajectory import toolcalls
from services.trajectory.conversation import candidate_prefixes, canonical, conversation_key
from services.trajectory.generation import GenerationFailed, coalesce_deltas, generate
from services.trajectory.routing import WorkerTable
from services.trajectory.turns import Segment, Turn, leaves, path, sample, samples
from shared.messages import GenerateDone, Sampling, TokenDelta, WorkerStatus


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


def _turn(tid, parent, prefix, gen, version=0):
    return Turn(tid, parent, prefix, [Segment(gen, [-0.5] * len(gen), version)], "stop", f"r{tid}", 0.0)


def test_turn_tree_paths_branches_and_masks():
    turns = {0: _turn(0, -1, [1, 2], [3, 4]), 1: _turn(1, 0, [5], [6], version=1), 2: _turn(2, 0, [7], [8, 9])}
    assert [t.turn_id for t in path(turns, 1)] == [0, 1]
    assert leaves(turns) == [1, 2]
    s = sample(path(turns, 1))
    assert s.token_ids == [1, 2, 3, 4, 5, 6]
    assert s.loss_mask == [0, 0, 1, 1, 0, 1]
    assert s.versions == [-1, -1, 0, 0, -1, 1]
    assert s.logprobs == [0.0, 0.0, -0.5, -0.5, 0.0, -0.5]
    assert [x.token_ids for x in samples(turns)] == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9]]


def _status(wid, running=0, state="serving", ts=100.0, cap=4):
    return WorkerStatus(wid, state, 0, running, cap, "m", 2048, ts)


def test_routing_sticky_then_least_loaded():
    t = WorkerTable(stale_after=5)
    t.update(_status("a", running=1))
    t.update(_status("b", running=0))
    assert t.choose(101, sticky="a") == "a"
    assert t.choose(101) == "b"
    t.update(_status("a", running=4))  # full: sticky yields
    assert t.choose(101, sticky="a") == "b"
    t.update(_status("b", state="vacated"))
    assert t.choose(101) == "a"
    assert t.choose(200) is None  # heartbeats stale
    assert t.choose(101, exclude=frozenset({"a"})) is None
    # another live worker exists (vacated b), so a re-dispatch may wait for it; none beyond a and b
    assert t.others(101, frozenset({"a"})) and not t.others(101, frozenset({"a", "b"}))
    assert not t.others(200, frozenset({"a"}))  # b's heartbeat is stale


def _fake_worker(script):
    """`script` maps dispatch number -> list of replies; records what was sent."""
    sent = []

    async def call(worker, cmd):
        sent.append((worker, cmd))
        for r in script[len(sent) - 1]:
            yield r

    return call, sent


async def test_generation_redispatches_prompt_plus_partial_after_preemption():
    call, sent = _fake_worker({
        0: [TokenDelta("r.0", [10, 11], [-1.0, -1.1], 0), GenerateDone("r.0", "preempted", 3, 0)],
        1: [TokenDelta("r.1", [12], [-1.2], 1), TokenDelta("r.1", [2], [-0.1], 1), GenerateDone("r.1", "stop", 5, 1)],
    })
    workers = iter(["w1", "w2"])
    excluded = []

    async def pick(exclude):
        excluded.append(exclude)
        return next(workers)

    seen = []

    async def on_tokens(delta, worker, first):
        seen.extend(delta.token_ids)

    out = await generate(call, pick, "r", "s", [1, 2, 3], Sampling(max_tokens=8), on_tokens, 4)
    assert out.finish_reason == "stop"
    assert out.token_ids == seen == [10, 11, 12, 2]
    assert [(s.token_ids, s.version, s.worker_id) for s in out.segments] == [([10, 11], 0, "w1"), ([12, 2], 1, "w2")]
    assert sent[1][1].prompt_ids == [1, 2, 3, 10, 11]
    assert sent[1][1].sampling.max_tokens == 6
    assert excluded == [frozenset(), frozenset({"w1"})]


async def test_generation_gives_up_after_bounded_redispatches():
    call, _ = _fake_worker({i: [GenerateDone("r", "preempted", 1, 0)] for i in range(10)})

    async def pick(exclude):
        return "w"

    async def on_tokens(delta, worker, first):
        pass

    with pytest.raises(GenerationFailed, match="preempted"):
        await generate(call, pick, "r", "s", [1], Sampling(max_tokens=4), on_tokens, 3, backoff=0.0)


async def test_generation_error_maps_to_status():
    call, _ = _fake_worker({0: [GenerateDone("r", "error", 1, 0, error="prompt is longer than max_model_len")]})

    async def pick(exclude):
        return "w"

    async def on_tokens(delta, worker, first):
        pass

    with pytest.raises(GenerationFailed) as e:
        await generate(call, pick, "r", "s", [1], Sampling(max_tokens=4), on_tokens, 3, backoff=0.0)
    assert e.value.status == 400


def test_admission_bound_and_staleness():
    from services.trajectory.admission import Admission, staleness

    a = Admission(max_staleness=1, batch_samples=4)
    assert a.capacity == 8
    assert a.admit(open_sessions=5, untrained=2)
    assert not a.admit(open_sessions=5, untrained=3)
    assert "staleness bound (8" in a.refusal(5, 3)
    assert Admission(-1, 4).admit(10**6, 10**6)
    assert staleness(5, [-1, 3, 4, -1, 5]) == 2
    assert staleness(5, [-1]) == 0 and staleness(-1, [0]) == 0


async def test_generation_resumes_from_persisted_partial():
    from services.trajectory.generation import Generated

    partial = Generated()
    partial.add(TokenDelta("r.0", [10, 11], [-1.0, -1.1], 0), "w1", True)
    partial.dispatches = 1
    call, sent = _fake_worker({0: [TokenDelta("r.1", [2], [-0.1], 0), GenerateDone("r.1", "stop", 5, 0)]})

    async def pick(exclude):
        return "w2"

    async def on_tokens(delta, worker, first):
        pass

    out = await generate(call, pick, "r", "s", [1, 2, 3], Sampling(max_tokens=8), on_tokens, 4, resume=partial)
    assert sent[0][1].prompt_ids == [1, 2, 3, 10, 11] and sent[0][1].sampling.max_tokens == 6
    assert sent[0][1].request_id == "r.1"
    assert out.token_ids == [10, 11, 2] and len(out.segments) == 2


def test_coalesce_merges_same_version_runs_and_keeps_the_done_last():
    from shared.messages import GenerateDone, TokenDelta

    replies = [TokenDelta("r", [1], [-0.1], 0), TokenDelta("r", [2, 3], [-0.2, -0.3], 0),
               TokenDelta("r", [4], [-0.4], 1), TokenDelta("r", [5], [-0.5], 1),
               GenerateDone("r", "length", 3, 1, "w")]
    out = coalesce_deltas(replies)
    assert [(d.token_ids, d.logprobs, d.version) for d in out[:-1]] == [
        ([1, 2, 3], [-0.1, -0.2, -0.3], 0), ([4, 5], [-0.4, -0.5], 1)]
    assert out[-1] == replies[-1]
    assert replies[0].token_ids == [1]  # the inputs are not modified
    assert coalesce_deltas([]) == []


async def test_repeated_preemptions_back_off_before_redispatching():
    import time

    from shared.messages import GenerateDone, TokenDelta

    script = [[TokenDelta("r.0", [5], [-0.5], 0), GenerateDone("r.0", "preempted", 1, 0, "w")]] + \
        [[GenerateDone(f"r.{i}", "preempted", 1, 0, "w")] for i in range(1, 4)] + \
        [[TokenDelta("r.4", [6], [-0.6], 0), GenerateDone("r.4", "length", 2, 0, "w")]]
    call, sent = _fake_worker(script)

    async def pick(exclude):
        return "w"  # the only worker

    async def on_tokens(delta, worker, first):
        pass

    t0 = time.monotonic()
    out = await generate(call, pick, "r", "s", [1], Sampling(max_tokens=2), on_tokens, 8, backoff=0.05)
    waited = time.monotonic() - t0
    assert out.token_ids == [5, 6] and len(sent) == 5
    assert 0.05 + 0.1 + 0.2 <= waited < 2.0  # no wait after the first preemption, then doubling


def test_stop_strings_find_holdback_and_matcher():
    from services.trajectory.stopstrings import StopMatcher, find_stop, holdback

    assert find_stop("abc END x", ["END"]) == 4 and find_stop("abc", ["END"]) is None
    assert find_stop("xEND yEN", ["EN", "END"]) == 1  # the earliest start wins
    assert find_stop("abcEND", ["END"], start=4) == 3  # a match straddling what was checked before
    assert holdback("hello EN", ["END"]) == 2 and holdback("hello", ["END"]) == 0
    assert holdback("a\n\nObs", ["\nObservation:"]) == 4 and holdback("", ["x"]) == 0

    class Text:  # one character per token id
        def __init__(self):
            self.text = ""

        def add(self, ids):
            self.text += "".join(chr(i) for i in ids)

    m = StopMatcher(Text(), ["END"])
    assert m.add([ord(c) for c in "abcE"]) is None and m.visible(m.text.text) == "abc"
    assert m.add([ord(c) for c in "NDxyz"]) == 2  # "N", "D" kept; "xyz" dropped
    assert m.text.text == "abcEND" and m.at == 3 and m.visible(m.text.text) == "abc"
    plain = StopMatcher(Text(), [])
    assert plain.add([ord("E")]) is None and plain.visible(plain.text.text) == "E"


async def test_generation_ends_stop_when_on_tokens_says_so_and_closes_the_call():
    from shared.messages import GenerateDone, TokenDelta

    closed = []

    async def call(worker, cmd):
        try:
            yield TokenDelta("r.0", [1, 2], [-0.1, -0.2], 0)
            yield TokenDelta("r.0", [3, 4, 5], [-0.3, -0.4, -0.5], 0)
            yield GenerateDone("r.0", "length", 1, 0, "w")
        finally:
            closed.append(True)  # the real call aborts the worker's request here

    async def pick(exclude):
        return "w"

    async def on_tokens(delta, worker, first):
        return 2 if 4 in delta.token_ids else None  # "a stop string completed at token 4"

    out = await generate(call, pick, "r", "s", [0], Sampling(max_tokens=10), on_tokens, 3)
    assert out.finish_reason == "stop" and out.token_ids == [1, 2, 3, 4] and closed == [True]
    assert [s.logprobs for s in out.segments] == [[-0.1, -0.2, -0.3, -0.4]]
