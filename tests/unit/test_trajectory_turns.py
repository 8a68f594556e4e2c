"""services/trajectory/turns.py: the per-session token prefix tree and its samples."""

from __future__ import annotations

from services.trajectory.turns import Segment, Turn, leaves, path, sample, samples


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
