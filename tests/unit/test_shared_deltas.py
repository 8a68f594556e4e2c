"""shared/deltas.py: queued TokenDeltas merge within one request and version, never across; Held sends
one request's at most every hold_s."""

from shared.deltas import Held, merge_deltas, tail_of, with_tail
from shared.messages import GenerateDone, TokenDelta


def test_merges_runs_of_one_version_and_keeps_other_items_in_place():
    got = merge_deltas([TokenDelta("r", [1], [-0.1], 0), TokenDelta("r", [2], [-0.2], 0),
                        TokenDelta("r", [3], [-0.3], 1), TokenDelta("r", [4], [-0.4], 1),
                        GenerateDone("r", "stop", 3, 1)])
    assert [type(x).__name__ for x in got] == ["TokenDelta", "TokenDelta", "GenerateDone"]
    assert (got[0].token_ids, got[0].logprobs, got[0].version) == ([1, 2], [-0.1, -0.2], 0)
    assert (got[1].token_ids, got[1].version) == ([3, 4], 1)


def test_never_merges_across_requests_or_non_deltas_and_leaves_inputs_alone():
    a, b = TokenDelta("r1", [1], [0.0], 0), TokenDelta("r2", [2], [0.0], 0)
    err = RuntimeError("x")
    got = merge_deltas([a, b, err, TokenDelta("r2", [3], [0.0], 0)])
    assert got[:3] == [a, b, err] and got[3].token_ids == [3]
    merge_deltas([a, TokenDelta("r1", [9], [0.0], 0)])
    assert a.token_ids == [1]


def test_empty_and_single():
    assert merge_deltas([]) == []
    one = TokenDelta("r", [1], [0.0], 0)
    assert merge_deltas([one]) == [one]


def test_held_sends_at_most_every_hold_s_from_the_start_merged():
    h = Held(0.1, start=0.0)
    d = lambda t, v=0: TokenDelta("r", [t], [-t / 10], v)  # noqa: E731
    # the first ones too: a reply shorter than hold_s is one message, its GenerateDone
    assert h.add(d(0), now=0.01) == [] and h.add(d(1), now=0.02) == []
    [sent] = h.add(d(2), now=0.1)  # hold_s since the start
    assert sent.token_ids == [0, 1, 2]
    assert h.add(d(2), now=0.13) == [] and h.add(d(3), now=0.16) == []  # held
    [sent] = h.add(d(4), now=0.2)  # hold_s since the last send: all that was held, merged
    assert (sent.token_ids, sent.logprobs, sent.version) == ([2, 3, 4], [-0.2, -0.3, -0.4], 0)
    assert h.add(d(5), now=0.25) == []
    # a new version sends what is held first: a merge never crosses one
    [before] = h.add(d(6, v=1), now=0.26)
    assert (before.token_ids, before.version) == ([5], 0)
    assert h.flush() == TokenDelta("r", [6], [-0.6], 1) and h.flush() is None  # the end: nothing held is lost


def test_held_with_no_hold_sends_each_as_it_comes():
    h = Held(0.0)
    for t in range(5):
        assert h.add(TokenDelta("r", [t], [0.0], 0), now=1.0) == [TokenDelta("r", [t], [0.0], 0)]
    assert h.flush() is None


def test_the_held_tail_rides_on_the_generate_done_and_comes_off_as_it_went_on():
    tail = TokenDelta("r", [7, 8], [-0.7, -0.8], 3)
    first, done = with_tail(GenerateDone("r", "stop", 5, 3, "w"), tail)
    assert first is None and done.tail_ids == [7, 8]
    assert tail_of(done) == tail
    # another version than the done's (never from a worker: its last tokens are its last version) goes first
    other = TokenDelta("r", [9], [-0.9], 2)
    first, done = with_tail(GenerateDone("r", "stop", 5, 3, "w"), other)
    assert first == other and not done.tail_ids and tail_of(done) is None
    assert with_tail(GenerateDone("r", "stop", 5, 3), None)[0] is None
