"""shared/heartbeats.py: latest report per sender, alive while younger than stale_after."""

from shared.heartbeats import Heartbeats, WorkerHeartbeats
from shared.messages import WorkerStatus
from shared.timeouts import HEARTBEAT_INTERVAL, HEARTBEAT_STALE_AFTER


def status(wid: str, ts: float, state: str = "serving") -> WorkerStatus:
    return WorkerStatus(wid, state, 0, 0, 4, "m", 64, ts)


def test_latest_value_wins_and_ages_out_after_stale_after():
    hb: Heartbeats[int] = Heartbeats(stale_after=5)
    hb.beat("a", 1, at=100.0)
    hb.beat("a", 2, at=101.0)
    hb.beat("b", 7, at=90.0)
    assert hb.get("a") == 2 and hb.age("a", 103.0) == 2.0 and hb.age("zzz", 103.0) is None
    assert hb.alive(103.0) == {"a": 2}  # b reported 13 s ago
    assert hb.alive(106.0) == {"a": 2} and hb.alive(106.01) == {}  # exactly stale_after is still alive
    assert hb.is_alive("a", 106.0) and not hb.is_alive("b", 106.0) and not hb.is_alive("c", 0.0)
    assert hb.latest() == {"a": 2, "b": 7} and len(hb) == 2 and "b" in hb
    hb.forget("b")
    assert "b" not in hb and list(hb) == ["a"]


def test_fresh_is_ordered_by_key():
    hb: Heartbeats[str] = Heartbeats(stale_after=1)
    for k in ("c", "a", "b"):
        hb.beat(k, k.upper(), at=10.0)
    assert hb.fresh(10.5) == ["A", "B", "C"]


def test_worker_heartbeats_age_by_the_workers_timestamp_and_list_serving_ones():
    hb = WorkerHeartbeats(stale_after=5)
    hb.update(status("w1", 100.0))
    hb.update(status("w0", 100.0, state="vacated"))
    hb.update(status("w2", 90.0))  # gone
    assert [s.worker_id for s in hb.fresh(101.0)] == ["w0", "w1"]
    assert [s.worker_id for s in hb.serving(101.0)] == ["w1"]


def test_the_default_staleness_tolerates_several_missed_beats():
    assert Heartbeats().stale_after == HEARTBEAT_STALE_AFTER >= 3 * HEARTBEAT_INTERVAL
