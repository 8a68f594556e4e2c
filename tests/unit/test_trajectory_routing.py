"""services/trajectory/routing.py: the worker table and the picker (pure; time is passed in)."""

from __future__ import annotations

import msgspec

from services.trajectory.routing import PREFER_OTHER_WORKER_S, Picker, WorkerTable
from shared.messages import WorkerStatus


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


def test_picker_prefers_sticky_then_waits_for_another_worker_after_a_preemption():
    t = WorkerTable(stale_after=5)
    t.update(_status("a", ts=100.0))
    t.update(_status("b", ts=100.0, state="vacated"))  # alive, not serving yet
    assert Picker.start(t, 100.0, "a", frozenset(), worker_wait=30).choose(100.0) == "a"
    # a preempted us; b is alive, so wait for it a while before going back to a
    p = Picker.start(t, 100.0, None, frozenset({"a"}), worker_wait=30)
    assert p.choose(100.0) is None and not p.expired(100.0)
    assert p.choose(100.0 + PREFER_OTHER_WORKER_S) == "a"
    t.update(_status("b", ts=100.5))  # b serves now
    assert p.choose(100.6) == "b"


def test_picker_goes_straight_back_when_no_other_worker_is_alive_and_gives_up_after_worker_wait():
    t = WorkerTable(stale_after=5)
    t.update(_status("a", ts=100.0))
    assert Picker.start(t, 100.0, None, frozenset({"a"}), worker_wait=30).choose(100.0) == "a"
    t.update(_status("a", ts=100.0, state="vacated"))
    p = Picker.start(t, 100.0, None, frozenset(), worker_wait=3)
    assert p.choose(101.0) is None and not p.expired(103.0) and p.expired(103.1)


def test_inflight_requests_count_towards_load():
    t = WorkerTable(stale_after=5)
    t.update(_status("a", running=0, cap=2))
    t.update(_status("b", running=1, cap=2))
    t.inflight["a"] += 2  # this replica sent two since a's heartbeat
    assert t.choose(100.5) == "b" and t.max_model_len(100.5, 99) == 2048 and t.max_model_len(300, 99) == 99


def _ws(wid, version=0, running=0, cap=4, ts=100.0, tokens=0, lent_until=0.0):
    return WorkerStatus(wid, "serving", version, running, cap, "m", 2048, ts, generated_tokens=tokens,
                        lent_until=lent_until)


def test_routing_prefers_the_newest_version_then_capacity():
    t = WorkerTable(stale_after=5)
    t.update(_ws("old", version=3))
    t.update(_ws("new", version=4, running=2))
    assert t.choose(101) == "new"  # newer, though busier
    assert t.choose(101, sticky="old") == "new"  # a sticky worker one version behind yields
    t.update(_ws("new", version=4, running=4))
    assert t.choose(101) == "old"  # the newest is full
    t = WorkerTable(stale_after=5)
    t.update(_ws("small", cap=4))
    t.update(_ws("big", cap=16))
    assert t.choose(101) == "big"  # equally idle: the one with more room


def test_a_lent_worker_gets_only_requests_predicted_to_end_before_its_reclaim():
    """Rule "fit" (shared/lending.py): the option; "migrate" is the default (next test)."""
    from services.trajectory.routing import LengthHistory

    t = WorkerTable(stale_after=5, rule="fit")
    t.update(_ws("lent", ts=100.0, tokens=0, lent_until=110.0))
    t.update(_ws("lent", ts=101.0, tokens=400, lent_until=110.0))  # 400 tok/s, idle: 400 tok/s per request
    t.update(_ws("home", running=3))
    assert t.choose(101.0, expected_tokens=1000) == "lent"  # 2.5 s < 9 s left
    assert t.choose(101.0, expected_tokens=8000) == "home"  # 20 s: it would be vacated mid-way
    assert t.choose(101.0) == "lent"  # nothing to predict from: least loaded
    # the scheduler drains it (reclaim grace): lent_until = now closes it even with nothing to predict from
    t.update(_ws("lent", ts=102.0, tokens=800, lent_until=102.0))
    assert t.choose(102.0) == "home" and t.choose(102.0, expected_tokens=10) == "home"
    h = LengthHistory(keep=2, per_group=4)
    assert h.expected("g1") is None
    for n in (100, 400, 120, 110):
        h.record("g1", n)
    assert h.expected("g1") == 400  # the 90th percentile: the long reply a reclaim would catch
    h.record("g1", 90)  # the oldest (100) leaves the group's window
    assert h.expected("g1") == 400
    h.record("g2", 50)
    h.record("g3", 10)
    assert h.expected("g1") == h.expected(None) == 400  # g1 forgotten (bounded): all recent replies


def test_by_default_a_lent_worker_takes_any_request_a_reclaim_would_move_for_less_than_it_adds():
    """Rule "migrate": the 8,000-token request that "fit" sends home goes to the idle lent worker,
    which decodes 3,600 tokens of it before the reclaim moves it (re-prefilled at 0.25x: 900 < 3,600)."""
    t = WorkerTable(stale_after=5)
    t.update(_ws("lent", ts=100.0, tokens=0, lent_until=110.0))
    t.update(_ws("lent", ts=101.0, tokens=400, lent_until=110.0))
    t.update(_ws("home", running=3))
    assert t.choose(101.0, expected_tokens=8000) == "lent"
    t.update(_ws("lent", ts=102.0, tokens=800, lent_until=102.0))  # drained: closed all the same
    assert t.choose(102.0, expected_tokens=10) == "home"


def test_the_live_router_and_the_simulator_call_the_same_routing_function(monkeypatch):
    """One rule, live and simulated: both reach shared.lending.takes_turn (patched here to refuse
    every turn to a lent worker: the router then sends nothing to a lent worker, and the simulator, whose lend verdict
    asks it too, lends only before any length is known)."""
    import shared.lending
    from services.scheduler.sim import Cluster, simulate
    from services.scheduler.sim.workload import CALIBRATIONS, Workload

    wl = Workload(group_size=4, groups_per_step=48, prompt_tokens=64, length_median=200, length_cap=2000)
    cal = CALIBRATIONS["live-mini"]
    before = simulate(Cluster.uniform(4, 2), cal, wl, "seamless", steps=6, seed=1)
    calls = []

    def refuse(now, lent_until, *args, **kw):
        calls.append(lent_until)
        return lent_until <= 0  # a worker that is not lent takes every turn, as before

    monkeypatch.setattr(shared.lending, "takes_turn", refuse)
    t = WorkerTable(stale_after=5)
    t.update(_ws("lent", ts=100.0, tokens=0, lent_until=110.0))
    t.update(_ws("lent", ts=101.0, tokens=400, lent_until=110.0))
    t.update(_ws("home", running=3))
    assert t.choose(101.0, expected_tokens=10) == "home" and calls  # the router asked it
    n = len(calls)
    after = simulate(Cluster.uniform(4, 2), cal, wl, "seamless", steps=6, seed=1)
    assert len(calls) > n  # the simulator asked it
    # lent only while no turn had ended (nothing to predict a length from: every turn is taken)
    assert before.lent_idle_s < 0.05 * before.lent_s and after.lends < before.lends / 4


def test_a_worker_restarted_under_the_same_id_is_another_process():
    # found by tests/faults: a supervisor restarts a SIGKILLed worker with the same id within a second,
    # its fresh heartbeats kept the dead process's streams "alive" until the 60 s token timeout
    t = WorkerTable(stale_after=5.0)
    t.update(msgspec.structs.replace(_status("w0", ts=100.0), instance="a"))
    assert t.instance("w0") == "a" and t.same_process("w0", "a", 101.0)
    t.update(msgspec.structs.replace(_status("w0", ts=102.0), instance="b"))  # restarted: a new process
    assert not t.same_process("w0", "a", 102.5) and t.same_process("w0", "b", 102.5)
    assert not t.same_process("w0", "b", 108.0)  # and a stale heartbeat is still a dead worker
    assert t.same_process("w0", "", 102.5) and t.instance("w9") == ""  # unknown: by heartbeat age only


def test_a_sticky_session_yields_to_a_much_less_loaded_worker():
    """A worker lent a moment ago serves nothing: sessions stuck to the busy worker move to it once
    the busy one is more than REBALANCE (a quarter of its slots) more loaded."""
    t = WorkerTable(stale_after=5)
    t.update(_status("home", running=2, cap=8))
    t.update(_status("lent", running=0, cap=8))
    assert t.choose(101, sticky="home") == "home"  # 2 of 8 more: the prefix cache is worth more
    t.update(_status("home", running=3, cap=8))
    assert t.choose(101, sticky="home") == "lent"  # 3 of 8 more: the idle worker takes the turn
    t.update(_status("lent", running=2, cap=8))
    assert t.choose(101, sticky="home") == "home"


def test_a_worker_keeps_the_speed_it_served_at_while_it_sleeps():
    """Rates come only from heartbeats where the worker generated: a lent worker that slept between
    lends is not taken for a slow one."""
    t = WorkerTable(stale_after=5)
    t.update(_ws("w", ts=100.0, tokens=0))
    t.update(_ws("w", ts=101.0, tokens=400))
    assert t.rates["w"] == 400.0
    for ts in (102.0, 110.0, 130.0):  # asleep (lent out of rollout): no token
        t.update(_ws("w", ts=ts, tokens=400))
    assert t.rates["w"] == 400.0


def _lent(wid, running=0, cap=4, version=0, lent_until=150.0, ts=100.0):
    return WorkerStatus(wid, "serving", version, running, cap, "m", 2048, ts, lent_until=lent_until)


def test_a_worker_that_begins_serving_takes_its_share_of_the_busier_workers_requests():
    t = WorkerTable(stale_after=5)
    t.update(_status("busy", running=8, cap=8))
    t.update(_lent("new", cap=8))
    mine = {"busy": [f"r{i}" for i in range(8)]}  # oldest first
    moved = t.moves(101, "new", mine)
    # 8 on 8 slots against 0 on 8: 4 move, the youngest (least context to prefill again)
    assert moved == [("busy", "r4"), ("busy", "r5"), ("busy", "r6"), ("busy", "r7")]
    # a replica with half of the busy worker's requests moves half as many (the other replica the rest)
    assert len(t.moves(101, "new", {"busy": mine["busy"][:4]})) == 2
    # within REBALANCE of each other (or nothing of ours there): nothing moves
    t.update(_status("busy", running=2, cap=8))
    assert t.moves(101, "new", {"busy": ["r0", "r1"]}) == []
    t.update(_status("busy", running=8, cap=8))
    assert t.moves(101, "new", {}) == []
    # a busy worker at an older version keeps its requests (the newest serves them next anyway);
    # a worker that is not serving takes none
    t.update(_status("busy", running=8, cap=8))
    t.update(_lent("new", cap=8, version=1))
    assert t.moves(101, "new", mine) == []
    t.update(WorkerStatus("new", "vacated", 0, 0, 8, "m", 2048, 100.0))
    assert t.moves(101, "new", mine) == []
    assert t.moves(101, "nobody", mine) == []


def _measured(t, wid, running, cap, rate, lent_until=0.0):
    """Two heartbeats 1 s apart at `rate` tokens/s (what WorkerTable.rates reads), the second at ts 100."""
    t.update(WorkerStatus(wid, "serving", 0, running, cap, "m", 2048, 99.0, lent_until=lent_until))
    t.update(WorkerStatus(wid, "serving", 0, running, cap, "m", 2048, 100.0, generated_tokens=int(rate),
                          lent_until=lent_until))


def test_the_worth_test_moves_short_turns_to_a_lent_worker_and_keeps_long_ones_that_outlast_the_lend():
    """routing.WorkerTable.moves with what each request has done (SF_TRAJECTORY_REBALANCE_WORTH): the
    share `rebalanced` allows is an upper bound; a request moves only where shared/lending.py's
    `move_worth` approves (without the test, the whole share moves whatever the requests are)."""
    from services.trajectory.routing import Running
    t = WorkerTable(stale_after=5)
    _measured(t, "busy", 8, 8, 800.0)  # 10 ms a token for each of 8
    t.update(_lent("new", cap=8, lent_until=110.0))
    ids = [f"r{i}" for i in range(8)]
    t.lengths.record_recent([96.0] * 20)
    # 88 tokens to go: 0.88 s here, 0.12-0.49 s there (its batch 1-4, the earlier moves' prefill first):
    # the whole share is worth it, as without the test
    short = {rid: Running(context=32, generated=8, budget=96) for rid in ids}
    assert t.moves(101, "new", {"busy": ids}, short) == [("busy", f"r{i}") for i in range(4, 8)]
    assert t.moves(101, "new", {"busy": ids}) == [("busy", f"r{i}") for i in range(4, 8)]
    # replies of 4,000 tokens, a lend of 3 s more: 3,992 tokens take 40 s here and 5.3 s there at the
    # least; neither finishes before the reclaim, which would move it again with its context re-prefilled
    t.lengths.record_recent([4000.0] * 256)
    t.update(_lent("new", cap=8, lent_until=104.0))
    long = {rid: Running(context=1024, generated=8, budget=8000) for rid in ids}
    assert t.moves(101, "new", {"busy": ids}, long) == []
    assert len(t.moves(101, "new", {"busy": ids})) == 4  # without the test: the share, whatever it costs
    # the same requests with a lend that lasts: worth it
    t.update(_lent("new", cap=8, lent_until=200.0))
    assert len(t.moves(101, "new", {"busy": ids}, long)) > 0


def test_a_lend_is_measured_from_heartbeats_and_shortens_the_window():
    t = WorkerTable(stale_after=50)
    t.update(_lent("new", lent_until=200.0, ts=100.0))  # serving, lent
    t.update(_lent("new", lent_until=200.0, ts=101.0))
    t.update(WorkerStatus("new", "vacated", 0, 0, 4, "m", 2048, 112.0))  # reclaimed: 12 s lent
    assert list(t.lends.recent) == [12.0]
    t.update(_lent("new", lent_until=300.0, ts=120.0))  # lent again at 120, predicted until 300
    assert t.lends.window(125.0, 300.0, t.serving_since["new"]) == 7.0
