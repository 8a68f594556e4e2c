"""shared/deltas.py: queued TokenDeltas merge within one request and version, never across."""

from shared.deltas import merge_deltas
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
