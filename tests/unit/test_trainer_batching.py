"""services/trainer/batching.py: group completeness, next-token shift, token budget, sharding."""

from __future__ import annotations

import pytest
import torch

from services.trainer.algorithms import AlgoConfig
from services.trainer.batching import (
    GroupCollector,
    Row,
    build_global_batch,
    collate,
    empty_micro_batch,
    micro_batches,
    shard_rows,
)
from shared.messages.trajectory import Sample, TrajectoryCompleted

PAD = 0


def sample(prompt: list[int], completion: list[int], version: int = 3) -> Sample:
    n, m = len(prompt), len(completion)
    return Sample(
        token_ids=prompt + completion,
        loss_mask=[0] * n + [1] * m,
        logprobs=[0.0] * n + [-0.1 * (i + 1) for i in range(m)],
        versions=[-1] * n + [version] * m,
    )


def traj(sid: str, gid: str, reward: float, *samples: Sample) -> TrajectoryCompleted:
    return TrajectoryCompleted(session_id=sid, group_id=gid, reward=reward,
                               samples=list(samples) or [sample([5, 6], [7, 8])])


def test_collector_releases_whole_groups_in_completion_order():
    c = GroupCollector(group_size=2)
    assert c.add(traj("a1", "a", 1.0))
    assert c.add(traj("b1", "b", 1.0))
    assert not c.add(traj("a1", "a", 1.0))  # a redelivery is not a second member
    assert c.take(1) is None
    c.add(traj("b2", "b", 0.0))
    c.add(traj("a2", "a", 0.0))
    assert c.pending() == {}
    first, second = c.take(2)
    assert [t.session_id for t in first] == ["b1", "b2"]
    assert [t.session_id for t in second] == ["a1", "a2"]
    assert c.take(1) is None


def test_collector_evicts_incomplete_group():
    c = GroupCollector(group_size=3)
    c.add(traj("x1", "x", 1.0))
    assert c.pending() == {"x": 1}
    assert [t.session_id for t in c.evict("x")] == ["x1"]
    assert c.pending() == {}


def test_global_batch_broadcasts_trajectory_advantage_to_its_samples():
    g1 = [traj("a", "g1", 1.0, sample([1, 2], [3]), sample([1, 2, 3, 4], [5, 6])), traj("b", "g1", 0.0)]
    g2 = [traj("c", "g2", 0.5), traj("d", "g2", 0.5)]
    gb = build_global_batch([g1, g2], AlgoConfig(std_normalize=False))
    assert gb.trajectory_ids == ["a", "b", "c", "d"]
    assert [r.advantage for r in gb.rows] == pytest.approx([0.5, 0.5, -0.5, 0.0, 0.0])
    assert [r.traj for r in gb.rows] == [0, 0, 1, 2, 3]
    assert gb.metrics["reward_mean"] == pytest.approx(0.5)
    assert gb.metrics["samples"] == 5


def test_shift_aligns_targets_mask_logprobs_versions():
    s = sample([10, 11, 12], [13, 14], version=4)
    mb = collate([Row(s, 1.5, 0), Row(sample([20], [21]), -1.0, 1)], PAD)
    assert mb.input_ids.tolist() == [[10, 11, 12, 13], [20, PAD, PAD, PAD]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert mb.targets.tolist() == [[11, 12, 13, 14], [21, PAD, PAD, PAD]]
    # position t predicts token t+1: the two generated tokens are targets at positions 2 and 3
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert mb.behav_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2])
    assert mb.versions.tolist() == [[-1, -1, 4, 4], [3, -1, -1, -1]]
    assert mb.advantages.tolist() == [1.5, -1.0]
    assert (mb.num_tokens, mb.num_seqs) == (3, 2)


def test_micro_batches_respect_token_budget_and_keep_every_row():
    rows = [Row(sample([1] * (i % 5 + 1), [2] * (i % 3 + 1)), float(i), i) for i in range(23)]
    budget = 16
    mbs = micro_batches(rows, budget, PAD)
    assert all(mb.input_ids.numel() <= budget for mb in mbs)
    assert sum(mb.input_ids.shape[0] for mb in mbs) == 23
    assert sorted(a for mb in mbs for a in mb.advantages.tolist()) == [float(i) for i in range(23)]
    assert sum(mb.num_tokens for mb in mbs) == sum(sum(r.sample.loss_mask) for r in rows)


def test_overlong_row_gets_its_own_micro_batch():
    rows = [Row(sample([1] * 30, [2] * 10), 0.0, 0), Row(sample([1], [2]), 0.0, 1)]
    mbs = micro_batches(rows, 8, PAD)
    assert [tuple(mb.input_ids.shape) for mb in mbs] == [(1, 39), (1, 1)]


def test_invalid_samples_are_rejected():
    bad_first = Sample([1, 2], [1, 1], [-0.1, -0.1], [0, 0])
    with pytest.raises(ValueError, match="first token"):
        build_global_batch([[traj("a", "g", 1.0, bad_first)]], AlgoConfig())
    ragged = Sample([1, 2, 3], [0, 1], [0.0, -0.1], [-1, 0])
    with pytest.raises(ValueError, match="differ in length"):
        build_global_batch([[traj("a", "g", 1.0, ragged)]], AlgoConfig())


def test_shard_rows_is_a_balanced_partition():
    rows = [Row(sample([1] * n, [2]), 0.0, i) for i, n in enumerate([40, 8, 8, 8, 8, 8, 3, 2])]
    shards = [shard_rows(rows, r, 2) for r in range(2)]
    ids = sorted(r.traj for s in shards for r in s)
    assert ids == list(range(8))
    loads = [sum(r.length for r in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 8
    assert shard_rows(rows, 0, 2) == shards[0]  # deterministic: every rank computes the same split


def test_empty_micro_batch_has_nothing_in_the_loss():
    mb = empty_micro_batch(PAD)
    assert mb.num_tokens == 0 and mb.input_ids.shape == (1, 1)
    assert torch.equal(mb.to("cpu").targets, mb.targets)


def test_dynamic_sampling_leaves_out_groups_with_equal_rewards():
    mixed = [traj("a", "g1", 1.0), traj("b", "g1", 0.0)]
    solved = [traj("c", "g2", 1.0), traj("d", "g2", 1.0)]
    failed = [traj("e", "g3", 0.0), traj("f", "g3", 0.0)]
    gb = build_global_batch([mixed, solved, failed], AlgoConfig(drop_uniform_groups=True))
    assert [r.traj for r in gb.rows] == [0, 1]  # only the mixed group trains
    assert gb.trajectory_ids == ["a", "b", "c", "d", "e", "f"]  # all were consumed (acked)
    assert gb.metrics["groups_dropped"] == 2 and gb.metrics["groups"] == 1
    # off: every group stays (their advantages are 0 and dilute the token-mean)
    assert build_global_batch([mixed, solved], AlgoConfig()).metrics["groups_dropped"] == 0
    assert len(build_global_batch([mixed, solved], AlgoConfig()).rows) == 4
    # all uniform: the batch is kept whole rather than emptied
    gb = build_global_batch([solved, failed], AlgoConfig(drop_uniform_groups=True))
    assert len(gb.rows) == 4 and gb.metrics["groups_dropped"] == 0


def test_role_micro_batches_hold_one_role_each_with_the_groups_advantages():
    import msgspec

    from services.trainer.batching import role_counts, role_micro_batches

    def role(t, r):
        return msgspec.structs.replace(t, metadata={"role": r})

    # one reward group shared by two roles: the advantages are the group's, whatever the role
    group = [role(traj("p1", "g", 1.0, sample([5, 6], [7, 8, 9])), "planner"),
             role(traj("s1", "g", 0.0, sample([5], [7])), "solver"),
             role(traj("p2", "g", 0.0, sample([5, 6, 7], [8])), "planner"),
             role(traj("s2", "g", 1.0, sample([5, 6], [9, 9])), "solver")]
    gb = build_global_batch([group], AlgoConfig())
    assert [r.role for r in gb.rows] == ["planner", "solver", "planner", "solver"]
    mbs = role_micro_batches(gb.rows, max_tokens=6, pad_id=PAD, roles=("solver", "planner"))
    assert [mb.adapter for mb in mbs][:1] == ["solver"] and {mb.adapter for mb in mbs} == {"solver", "planner"}
    by_role: dict[str, list[float]] = {}
    for mb in mbs:
        by_role.setdefault(mb.adapter, []).extend(mb.advantages.tolist())
    want = {r: sorted(row.advantage for row in gb.rows if row.role == r) for r in ("solver", "planner")}
    for r in want:
        assert sorted(by_role[r]) == pytest.approx(want[r])
    assert sum(mb.num_tokens for mb in mbs) == 3 + 1 + 1 + 2
    assert role_counts(gb.rows) == {"role_samples_planner": 2.0, "role_tokens_planner": 4.0,
                                    "role_samples_solver": 2.0, "role_tokens_solver": 3.0}
    with pytest.raises(ValueError, match="critic"):
        role_micro_batches(gb.rows + [Row(sample([1], [2]), 0.0, 9, "critic")], 6, PAD, ("solver", "planner"))
    # without roles nothing changes: one adapter, unnamed
    assert {mb.adapter for mb in micro_batches(gb.rows, 6, PAD)} == {""}
