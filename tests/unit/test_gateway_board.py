"""The status page's pure parts: timelines, rates, the snapshot, cookie tokens, trainer metrics."""

from __future__ import annotations

import pytest

from services.gateway.board import Board, Rate, Timeline, trainer_activity, worker_activity
from services.gateway.ui import parse_trainer_metrics, ui_token
from shared.messages.rollout import WorkerStatus
from shared.messages.scheduler import TrainerStatus


def _worker(wid="w0", state="serving", running=0, version=1, ts=100.0) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, state=state, version=version, running=running, capacity=8, model="m",
                        max_model_len=512, ts=ts)


def _trainer(state="waiting", step=1, version=1) -> TrainerStatus:
    return TrainerStatus(state=state, step=step, version=version, ready_groups=0, open_groups=0, buffered_samples=0,
                         groups_per_step=4, group_size=8, last_wait_s=0.0, last_compute_s=0.0, ts=0.0)


def test_a_serving_worker_with_nothing_running_is_a_bubble():
    assert worker_activity(_worker(running=0)) == "idle"
    assert worker_activity(_worker(running=3)) == "rollout"
    assert worker_activity(_worker(state="updating")) == "update"
    assert worker_activity(_worker(state="vacated")) == "vacated"
    assert trainer_activity(_trainer("waiting")) == "idle"
    assert trainer_activity(_trainer("computing")) == "train"
    assert trainer_activity(_trainer("ready")) == "switch"


def test_timeline_merges_contiguous_reports_and_splits_on_change_or_gap():
    t = Timeline(horizon=100, gap=5)
    for now, act in [(0, "idle"), (1, "idle"), (2, "rollout"), (3, "rollout"), (4, "idle"), (20, "idle")]:
        t.observe("w", act, now)
    # the previous interval lasts until the report that changed it; a 16 s silence is a gap
    assert list(map(list, t.rows["w"])) == [["idle", 0, 2], ["rollout", 2, 4], ["idle", 4, 4], ["idle", 20, 20]]
    assert t.window("w", since=3) == [["rollout", 3, 4], ["idle", 4, 4], ["idle", 20, 20]]


def test_timeline_forgets_beyond_its_horizon():
    t = Timeline(horizon=10, gap=5)
    t.observe("w", "idle", 0)
    t.observe("w", "rollout", 30)
    assert [iv[0] for iv in t.rows["w"]] == ["rollout"]


def test_rate_over_the_window():
    r = Rate(window=10)
    assert r.per_second() == 0.0
    for now, total in [(0, 0), (5, 10), (10, 20), (20, 40)]:
        r.add(now, total)
    assert r.per_second() == pytest.approx(2.0)


def test_snapshot_versions_lag_rewards_and_series():
    b = Board()
    b.worker(_worker("w0", version=3, running=1), 100)
    b.worker(_worker("w1", version=2), 100)
    b.trainer_status(_trainer("computing", step=4, version=4), 100)
    b.reward(1.0, 90)
    b.reward(0.0, 95)
    b.reward(5.0, 10)  # older than the 60 s reward window
    b.counters(100, 0, 0)
    b.counters(105, 10, 200)
    snap = b.snapshot(106, 60, [_worker("w0", version=3, ts=105), _worker("w1", version=2, ts=105)], 10.0)
    assert snap["newest_version"] == 4
    assert {w["id"]: w["lag"] for w in snap["workers"]} == {"w0": 1, "w1": 2}
    assert snap["versions"] == {"3": ["w0"], "2": ["w1"]}
    assert snap["reward_mean_60s"] == 0.5 and snap["rewards_60s"] == 2
    assert snap["turns_per_s"] == pytest.approx(2.0) and snap["tokens_per_s"] == pytest.approx(40.0)
    assert snap["trainer"]["state"] == "computing" and snap["trainer"]["alive"]
    assert snap["worker_timeline"]["w0"] == [["rollout", 100, 100]]
    assert [p["t"] for p in snap["series"]] == [100, 105]


def test_ui_token_is_not_the_key_and_changes_with_it():
    assert ui_token("k1") != ui_token("k2")
    assert "k1" not in ui_token("k1") and len(ui_token("k1")) == 64


def test_trainer_metrics_from_the_trainers_own_exposition():
    from prometheus_client import generate_latest

    from services.trainer.metrics import Metrics

    m = Metrics()
    m.step(2, 2, {"reward_mean": 0.5, "loss": 0.1}, {0: 3, 1: 1})
    got = parse_trainer_metrics(generate_latest(m.registry).decode())
    assert got["reward_mean"] == 0.5 and got["loss"] == pytest.approx(0.1) and got["version"] == 2
    assert got["staleness_mean"] == pytest.approx(0.25) and got["staleness_max"] == 1
    assert got["staleness_tokens"]["1"] == 1


def test_scheduler_hosts_become_timeline_rows():
    from services.gateway.ui import _hosts
    from shared.messages.scheduler import HostInfo, Interval, SchedulerReply

    info = HostInfo(host="host-0", tags=["train", "rollout", "cpu"], capacity=1.0, mode="rollout", target="rollout",
                    epoch=3, healthy=True, cordoned=False, last_seen=10.0, worker_id="host-0-rollout",
                    activity="rollout", timeline=[Interval("train", 0.0, 4.0), Interval("switch", 4.0, 5.0)])
    got = _hosts(SchedulerReply(True, "seamless", [info], counts={"lends": 1}))
    assert got["policy"] == "seamless" and got["counts"] == {"lends": 1}
    (h,) = got["hosts"]
    assert h["host"] == "host-0" and h["worker_id"] == "host-0-rollout"
    assert h["timeline"] == [["train", 0.0, 4.0], ["switch", 4.0, 5.0]]
    assert _hosts(None) is None and _hosts(SchedulerReply(False, error="x")) is None
