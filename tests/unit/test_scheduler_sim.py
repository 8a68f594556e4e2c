"""The SIMULATED cluster (services/scheduler/sim/simulator.py): conservation, a case computed by hand,
determinism, and that it runs the real policy module (a policy change changes the outcome)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from services.scheduler import policy
from services.scheduler.sim import ACTS, Cluster, Options, Simulator, simulate
from services.scheduler.sim.workload import CALIBRATIONS, WORKLOADS, Calibration, Workload

SMALL = Workload(group_size=4, groups_per_step=48, prompt_tokens=64, length_median=200, length_sigma=1.0,
                 length_cap=2000, max_staleness=1)
CAL = CALIBRATIONS["live-mini"]


def test_tokens_and_time_are_conserved():
    for pol in ("colocated", "disaggregated", "seamless"):
        r = simulate(Cluster.uniform(4, 1), CAL, SMALL, pol, steps=6, seed=3)
        assert r.steps == 6
        # every generated token is trained or still in flight (in a session, group or batch)
        assert abs(r.unaccounted_generated) < 1e-6 * r.generated, (pol, r.unaccounted_generated)
        # each host's activity (train/rollout/switch/idle) adds up to the wall time
        assert np.allclose(r.host_time.sum(axis=1), r.wall_s), pol
        assert r.trained_tokens_per_s > 0


def test_a_case_computed_by_hand():
    """1 train + 1 rollout host, disaggregated, staleness 0 (synchronous): 4 sequences of 100
    tokens decode together at 10 ms a step (1.0 s), then 400 tokens train at 2.5 ms each
    (1.0 s). A step is 2.0 s and trains 400 tokens: 200 tokens/s."""
    cal = Calibration("hand", decode_a_s=0.010, decode_b_s=0.0, max_seqs=4, prefill_s_per_token=0.0,
                      train_s_per_token=0.0025, weight_sync_s=0.0, lend_s=1.0, reclaim_s=1.0)
    wl = Workload(group_size=4, groups_per_step=1, prompt_tokens=0, length="fixed", length_median=100,
                  length_cap=100, max_staleness=0)
    r = simulate(Cluster.uniform(2, 1), cal, wl, "disaggregated", steps=5, dt=0.5)
    assert r.wall_s == pytest.approx(10.0, rel=1e-6)
    assert r.trained_tokens_per_s == pytest.approx(200.0, rel=1e-6)
    # the train host computes half the time, the rollout host decodes half the time
    assert r.idle_per_host == pytest.approx([0.5, 0.5], abs=1e-6)
    assert r.staleness_max == 0
    # the physical limit: per step 1.0 host-s of decode + 1.0 of training on 2 hosts: 400 tok/s
    assert r.limit_tokens_per_s == pytest.approx(400.0, rel=1e-6)



def test_the_trainers_bookkeeping_overlaps_the_wait_and_its_gate_and_start_delay_the_compute():
    """Calibration.bookkeeping_s, gate_s and start_s (the live trainer's time per step outside compute
    and publish, bench/pipeline_live.py `trainer_overhead`), on the case computed by hand. The version is
    out as the publish ends; the trainer then stays publishing 0.3 s (train, on its host's timeline)
    while the next wave decodes (1.0 s): that costs the step nothing. Each compute starts 0.2 s after
    its batch is in hand and its gate open (the train host idle), and 0.1 s of hand-off comes before
    the 1.0 s of compute (train): a step is 2.3 s."""
    cal = Calibration("hand", decode_a_s=0.010, decode_b_s=0.0, max_seqs=4, prefill_s_per_token=0.0,
                      train_s_per_token=0.0025, weight_sync_s=0.0, lend_s=1.0, reclaim_s=1.0)
    wl = Workload(group_size=4, groups_per_step=1, prompt_tokens=0, length="fixed", length_median=100,
                  length_cap=100, max_staleness=0)
    kw = {"steps": 5, "dt": 0.05}
    base = simulate(Cluster.uniform(2, 1), cal, wl, "disaggregated", **kw)
    r = simulate(Cluster.uniform(2, 1), replace(cal, bookkeeping_s=0.3, gate_s=0.2, start_s=0.1), wl,
                 "disaggregated", **kw)
    assert base.wall_s == pytest.approx(10.0, rel=1e-6)
    assert r.wall_s == pytest.approx(11.5, rel=1e-6)  # the run ends as the 5th version is out
    train = ACTS.index("train")
    assert r.host_time[0, train] == pytest.approx(5 * 1.1 + 4 * 0.3, rel=1e-6)  # computes, then 4 bookkeepings
    assert r.idle_per_host == pytest.approx([1 - 6.7 / 11.5, 1 - 5.0 / 11.5], abs=1e-6)
    # bookkeeping longer than the wave: now it holds up the next step (the trainer is not waiting yet)
    slow = simulate(Cluster.uniform(2, 1), replace(cal, bookkeeping_s=1.5), wl, "disaggregated", **kw)
    assert slow.wall_s == pytest.approx(5 * 2.0 + 4 * 0.5, rel=1e-6)


def test_same_seed_same_run_other_seed_other_run():
    a = simulate(Cluster.uniform(4, 1), CAL, SMALL, "seamless", steps=5, seed=7).row()
    b = simulate(Cluster.uniform(4, 1), CAL, SMALL, "seamless", steps=5, seed=7).row()
    c = simulate(Cluster.uniform(4, 1), CAL, SMALL, "seamless", steps=5, seed=8).row()
    assert a == b
    assert a != c


def test_the_simulator_runs_the_real_policy(monkeypatch):
    """Patch the policy module's lend rule: the simulated outcome changes with it."""
    base = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", steps=6, seed=1)
    assert base.lends > 0
    monkeypatch.setattr(policy, "lend_verdict", lambda s, *_: (False, "patched: never lend"))
    never = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", steps=6, seed=1)
    assert never.lends == 0
    disagg = simulate(Cluster.uniform(4, 2), CAL, SMALL, "disaggregated", steps=6, seed=1)
    assert never.trained_tokens_per_s == pytest.approx(disagg.trained_tokens_per_s, rel=1e-9)
    assert never.trained_tokens_per_s != pytest.approx(base.trained_tokens_per_s, rel=1e-3)


def test_staleness_is_bounded_by_admission_and_colocated_sync_is_fresh():
    sync = Workload(**{**{f: getattr(SMALL, f) for f in SMALL.__dataclass_fields__}, "max_staleness": 0})
    r = simulate(Cluster.uniform(4, 0), CAL, sync, "colocated", steps=5)
    assert r.staleness_max == 0 and r.staleness_mean == 0
    r = simulate(Cluster.uniform(4, 1), CAL, SMALL, "disaggregated", steps=8)
    assert 0 < r.staleness_mean <= 2 and math.isfinite(r.staleness_mean)


def test_replicas_and_host_groups_approximate_the_exact_run():
    wl = Workload(group_size=4, groups_per_step=16, prompt_tokens=64, length_median=200, length_sigma=0.5,
                  length_cap=1000, max_staleness=1)
    exact = simulate(Cluster.uniform(8, 2), CAL, wl, "seamless", steps=12, seed=2)
    coarse = simulate(Cluster.uniform(8, 2), CAL, wl, "seamless", steps=12, seed=2, replicas=2, host_group=2)
    assert coarse.hosts == 8 and coarse.train_hosts == 2
    assert coarse.trained_tokens_per_s == pytest.approx(exact.trained_tokens_per_s, rel=0.1)
    with pytest.raises(ValueError):
        simulate(Cluster.uniform(8, 3), CAL, wl, "seamless", steps=1, host_group=2)


def test_undelivered_backlog_admits_more_than_untrained():
    """Options.backlog="undelivered" (the live trajectory manager's count: the trainer's fetched
    samples and its batch in training do not count) opens more sessions, so staleness rises."""
    cal, wl = CALIBRATIONS["live-mini"], WORKLOADS["live-mini"]
    tight = simulate(Cluster.uniform(4, 1), cal, wl, "seamless", steps=12, dt=0.05)
    loose = simulate(Cluster.uniform(4, 1), cal, wl, "seamless", steps=12, dt=0.05, backlog="undelivered")
    assert abs(loose.unaccounted_generated) < 1e-6 * max(loose.generated, 1)
    assert loose.staleness_mean >= tight.staleness_mean
    assert loose.trained_tokens_per_s >= 0.99 * tight.trained_tokens_per_s


def test_a_reclaim_grace_trades_trainer_time_for_re_prefill():
    """seamless with reclaim_grace_s: lent hosts drain (take no new turn) before the reclaim, so
    fewer sequences migrate and prefill again; the trainer waits for them meanwhile, so a lend
    must promise more to be worth it. (Steps
    here last seconds: the lend settle, made for minutes-long waits, is off.)"""
    kw = dict(steps=8, seed=1)
    now = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", **kw)
    short = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", reclaim_grace_s=1.0, lend_settle_s=0.0, **kw)
    long = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", reclaim_grace_s=30.0, lend_settle_s=0.0, **kw)
    assert now.reprefilled > 0 and now.drains == 0
    assert 0 < short.reprefilled < now.reprefilled and short.drains > 0
    assert long.reprefilled == 0  # every lent host ran dry within the grace
    # the grace counts as part of a lend's switch cost (policy.lend_verdict): the longer it is, the fewer lends
    assert long.lends < short.lends < now.lends
    for r in (short, long):
        assert abs(r.unaccounted_generated) < 1e-6 * r.generated
        assert np.allclose(r.host_time.sum(axis=1), r.wall_s)
    # a grace changes nothing for the policies that do not lend
    for pol in ("disaggregated", "colocated"):
        a = simulate(Cluster.uniform(4, 2), CAL, SMALL, pol, **kw).row()
        b = simulate(Cluster.uniform(4, 2), CAL, SMALL, pol, reclaim_grace_s=30.0, drain_margin_s=5.0, **kw).row()
        assert a == b, pol


def test_a_drain_margin_moves_lent_until_earlier_in_the_simulator_too():
    kw = dict(steps=8, seed=1)
    now = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", **kw)
    margin = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", drain_margin_s=3.0, **kw)
    assert now.drains == 0 and margin.drains > 0  # lent_until re-sent as the predicted reclaim moved
    assert margin.generated != now.generated
    assert abs(margin.unaccounted_generated) < 1e-6 * margin.generated


@pytest.mark.parametrize("grace", [0.0, 30.0])
def test_the_simulator_asks_the_policy_every_tick_as_the_live_control_loop_does(grace, monkeypatch):
    """policy.decide runs on every tick (and once at the start), whatever the simulator thinks
    changed: it once asked only when its own checks said the inputs had, and those checks read
    the lend verdict without the hosts, so a verdict that turned to "lend" mid-wait went unseen."""
    ticks = []
    advance = Simulator._advance

    def counted(self, t0, t1):
        ticks.append(t0)
        return advance(self, t0, t1)

    monkeypatch.setattr(Simulator, "_advance", counted)
    r = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", steps=8, seed=1, reclaim_grace_s=grace,
                 lend_settle_s=0.0)
    assert r.lends > 0 and r.decide_calls == len(ticks) + 1


def test_with_a_grace_the_simulator_lends_only_after_the_settle():
    """policy.Snapshot.lend_settle_s reaches the policy through the simulator (Options and the
    trainer's waiting_since): with a grace, no lend before the trainer has waited that long."""
    kw = {"steps": 6, "seed": 1, "reclaim_grace_s": 1.0}
    eager = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", lend_settle_s=0.0, **kw)
    never = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", lend_settle_s=1e9, **kw)
    assert eager.lends > 0 and never.lends == 0 and never.reprefilled == 0
    no_grace = {**kw, "reclaim_grace_s": 0.0}  # without a grace the settle is not read
    assert (simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", lend_settle_s=1e9, **no_grace).row()
            == simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", lend_settle_s=0.0, **no_grace).row())


def test_a_control_plane_cost_caps_turns_per_second_and_adds_its_latency():
    """Options.control_s_per_turn: a turn is dispatched only once a FIFO server of
    `control_cores` cores has spent that much CPU on it. Saturated, the pipeline finishes at
    most cores / cost turns per second (here 1.5 / 0.1 = 15; the engine alone does
    ~50 with the trainer's steps); unsaturated, each turn still waits its own cost. 0 is the run without it."""
    cal, wl = CALIBRATIONS["live-mini"], WORKLOADS["live-mini"]
    kw = dict(steps=10, dt=0.05, backlog="undelivered")
    free = simulate(Cluster.uniform(4, 1), cal, wl, "seamless", **kw)
    assert simulate(Cluster.uniform(4, 1), cal, wl, "seamless", control_s_per_turn=0.0, **kw).row() == free.row()
    bound = simulate(Cluster.uniform(4, 1), cal, wl, "seamless", control_s_per_turn=0.1, control_cores=1.5, **kw)
    turns_per_s = bound.steps * wl.batch_samples / bound.wall_s
    assert 0.85 * 15 < turns_per_s <= 15 * 1.01, turns_per_s
    assert free.steps * wl.batch_samples / free.wall_s > 40  # the engine was not the bound
    assert bound.idle_fraction > free.idle_fraction + 0.3  # hosts wait for turns to arrive
    light = simulate(Cluster.uniform(4, 1), cal, wl, "seamless", control_s_per_turn=0.01, control_cores=64, **kw)
    assert 0.01 <= light.control_wait_s < 0.02  # its own cost, and a short queue at admission
    assert bound.control_wait_s > 0.1  # a queue


def test_least_loaded_routing_spreads_turns_over_the_rolling_hosts():
    """Options.route="least_loaded" (the live trajectory manager's routing): each queued turn
    goes to the host running the fewest. With a step cost mostly per sequence (b*k), fixed
    turn lengths and 64 sessions over 4 hosts, the default refilling keeps some hosts far
    busier than others; least-loaded keeps every rolling host busy and finishes sooner."""
    cal = replace(CALIBRATIONS["live-mini"], decode_a_s=0.02, decode_b_s=0.0025, prefill_s_per_token=0.02 / 15,
                  weight_sync_s=0.0065, lend_s=0.005, reclaim_s=0.0055)  # bench/pipeline_live.py, 10x slower engine
    wl = replace(WORKLOADS["live-mini"], prompt_tokens=15)
    kw = {"steps": 14, "dt": 0.05, "backlog": "undelivered"}
    refill = simulate(Cluster.uniform(4, 1), cal, wl, "seamless", **kw)
    spread = simulate(Cluster.uniform(4, 1), cal, wl, "seamless", route="least_loaded", **kw)
    assert max(refill.idle_per_host[1:]) > 0.2  # some rollout host waits while another is packed
    assert max(spread.idle_per_host[1:]) < 0.1
    assert spread.trained_tokens_per_s > 1.2 * refill.trained_tokens_per_s
    assert abs(spread.unaccounted_generated) < 1e-6 * spread.generated


def test_a_latency_per_turn_lengthens_sessions_by_that_much_and_lowers_throughput_by_littles_law():
    """Options.turn_latency_s: each turn waits that long outside the engine, its session open
    meanwhile. With admission holding N = 64 sessions open and an engine step that does not
    depend on the batch (b = 0), the time per session N / (turns/s) (Little's law) grows by the
    latency, less at most a tenth of it and a tick (a turn that arrived mid-tick waited for the
    next one anyway): 1.08 s without it, 1.53 s at 0.5 s, 1.99 s at 1.0 s (0.90x the latency
    at 20, 40 and 80 steps alike; the host lent here, given no turn, once made it look like
    1.0x); throughput falls in proportion. 0 is the run without it, to the last figure."""
    cal = replace(CALIBRATIONS["live-mini"], decode_b_s=0.0, decode_a_s=0.009)
    wl = WORKLOADS["live-mini"]
    kw = dict(steps=20, dt=0.05, backlog="undelivered", route="least_loaded")
    free = simulate(Cluster.uniform(4, 1), cal, wl, "seamless", **kw)
    assert simulate(Cluster.uniform(4, 1), cal, wl, "seamless", turn_latency_s=0.0, **kw).row() == free.row()
    n_open = 2 * wl.batch_samples  # Admission(max_staleness 1).capacity

    def session_s(r):
        return n_open / (r.steps * wl.batch_samples / r.wall_s)

    for lat in (0.5, 1.0):
        slow = simulate(Cluster.uniform(4, 1), cal, wl, "seamless", turn_latency_s=lat, **kw)
        grew = session_s(slow) - session_s(free)
        assert 0.9 * lat - kw["dt"] - 1e-6 <= grew <= lat + 1e-6, (lat, grew)
        ratio = slow.trained_tokens_per_s / free.trained_tokens_per_s
        assert abs(ratio / (session_s(free) / session_s(slow)) - 1) < 0.01, ratio
        assert slow.idle_fraction > free.idle_fraction + 0.25  # hosts wait for turns to come back


def test_latency_after_the_engine_delays_the_step_but_holds_no_slot():
    """Options.turn_latency_after_s, on the case computed by hand above (1 train + 1 rollout
    host, synchronous: 1.0 s of decode, then 1.0 s of training per step): each session
    completes 0.5 s after its last token, so a step takes 2.5 s, but the rollout host decodes
    exactly as long as before (5 x 1.0 s) and idles the rest: the slot was free meanwhile.
    With two turns per session the reply's latency comes after each turn (the tool call starts
    then): 2 x 0.5 s more per step. 0 is the run without it, to the last figure."""
    cal = Calibration("hand", decode_a_s=0.010, decode_b_s=0.0, max_seqs=4, prefill_s_per_token=0.0,
                      train_s_per_token=0.0025, weight_sync_s=0.0, lend_s=1.0, reclaim_s=1.0)
    wl = Workload(group_size=4, groups_per_step=1, prompt_tokens=0, length="fixed", length_median=100,
                  length_cap=100, max_staleness=0)
    kw = dict(steps=5, dt=0.5, timeline=True)
    base = simulate(Cluster.uniform(2, 1), cal, wl, "disaggregated", **kw)
    assert simulate(Cluster.uniform(2, 1), cal, wl, "disaggregated", turn_latency_after_s=0.0, **kw).row() == base.row()
    after = simulate(Cluster.uniform(2, 1), cal, wl, "disaggregated", turn_latency_after_s=0.5, **kw)
    rollout = ACTS.index("rollout")
    assert base.wall_s == pytest.approx(10.0, rel=1e-6)
    assert after.wall_s == pytest.approx(12.5, rel=1e-6)  # the step waits for the sessions
    assert after.host_time[1, rollout] == pytest.approx(base.host_time[1, rollout], rel=1e-6)  # 5.0 s
    assert after.host_time[1, rollout] == pytest.approx(5.0, rel=1e-6)
    assert after.idle_per_host[1] == pytest.approx(1 - 5.0 / 12.5, abs=1e-6)
    assert after.trained_tokens_per_s == pytest.approx(base.trained_tokens_per_s * 10.0 / 12.5, rel=1e-6)
    # the same latency before the engine holds no slot either, but the host waits at the start
    before = simulate(Cluster.uniform(2, 1), cal, wl, "disaggregated", turn_latency_s=0.5, **kw)
    assert before.host_time[1, rollout] == pytest.approx(5.0, rel=1e-6)
    two = replace(wl, turns=2, tool_latency_s=0.0, tool_tokens=0)
    base2 = simulate(Cluster.uniform(2, 1), cal, two, "disaggregated", **kw)
    after2 = simulate(Cluster.uniform(2, 1), cal, two, "disaggregated", turn_latency_after_s=0.5, **kw)
    assert after2.wall_s == pytest.approx(base2.wall_s + 5 * 2 * 0.5, rel=1e-6)
    assert after2.host_time[1, rollout] == pytest.approx(base2.host_time[1, rollout], rel=1e-6)


def test_the_policy_sees_the_turns_admission_opens_at_a_publish(monkeypatch):
    """When policy.decide runs, admission has caught up with the trainer: a publish frees the
    staleness bound and the sessions it admits are in the offer the lend verdict weighs. (They
    were admitted only after decide: at every publish the verdict saw 0 turns waiting, refused,
    and lent a tick later; fixed split, 30 steps: 480 lends instead of 512, 1.1961x instead of 1.1998x.)"""
    from shared.admission import Backlog

    behind = []
    decide = policy.decide

    def checked(s):
        sim = checked.sim
        pending = sim.untrained if sim.opt.backlog == "untrained" else max(0, sim.available - 2 * sim.B)
        if sim.free_slots and sim.adm.admit(sim.open, Backlog(pending, sim.B)):
            behind.append(s.now)
        return decide(s)

    init = Simulator.__init__

    def remember(self, *a, **kw):
        init(self, *a, **kw)
        checked.sim = self

    monkeypatch.setattr(Simulator, "__init__", remember)
    monkeypatch.setattr(policy, "decide", checked)
    r = simulate(Cluster.uniform(4, 2), CAL, SMALL, "seamless", steps=8, seed=1)
    assert r.lends > 0 and behind == []


def test_a_latency_that_varies_from_turn_to_turn_spreads_sessions_admitted_together():
    """Fixed-length turns behind a latency of one fixed value stay in step for the whole run: the
    sessions a publish admits together reach the engines together, end together, and the rollout
    hosts idle between the bursts (bench/pipeline_live.py's idle gap: 51-69% simulated against
    16-37% live). Drawn around the same mean (Options.turn_latency_cv), they spread."""
    wl, kw = WORKLOADS["live-mini"], {"steps": 12, "seed": 0, "turn_latency_s": 0.68, "turn_latency_after_s": 0.49,
                                      "backlog": "undelivered", "route": "least_loaded", "dt": 0.05}  # as the bench runs it
    fixed = simulate(Cluster.uniform(4, 1), CAL, wl, "disaggregated", **kw)
    assert simulate(Cluster.uniform(4, 1), CAL, wl, "disaggregated", turn_latency_cv=0.0, **kw).row() == fixed.row()
    spread = simulate(Cluster.uniform(4, 1), CAL, wl, "disaggregated", turn_latency_cv=0.3, **kw)
    roll = [ACTS.index("idle")]
    idle = lambda r: float(r.host_time[1:, roll].sum() / r.host_time[1:].sum())  # noqa: E731  (rollout hosts)
    assert idle(fixed) > 0.4 and idle(spread) < idle(fixed) / 2
    assert spread.trained_tokens_per_s > fixed.trained_tokens_per_s


def test_without_the_offer_the_simulator_lends_as_the_live_scheduler_does_by_default():
    """Options.offer=False: the lend verdict on the predicted wait alone, as the live scheduler decides
    without SF_SCHEDULER_LIVE_OFFER (its default). bench/pipeline_live.py's 2-host run (64 sessions in
    flight, one rollout host of 64 slots): no turn ever waits for a slot, so the offer is empty and the
    simulator never lent, while the live run lent every step."""
    cal = replace(CAL, decode_a_s=0.002, decode_b_s=0.00025, prefill_s_per_token=0.002 / 15,
                  weight_sync_s=0.007, lend_s=0.004, reclaim_s=0.01, train_s_per_token=5.87e-5)
    wl = replace(WORKLOADS["live-mini"], prompt_tokens=15)
    kw = {"steps": 12, "dt": 0.05, "backlog": "undelivered", "route": "least_loaded"}
    offered = simulate(Cluster.uniform(2, 1), cal, wl, "seamless", **kw)
    live = simulate(Cluster.uniform(2, 1), cal, wl, "seamless", offer=False, renew_s=2.0, **kw)
    assert offered.lends == 0
    assert live.lends > 0


def test_a_lent_host_takes_its_share_of_the_running_turns_with_rebalance():
    """Options.rebalance (the live router's SF_TRAJECTORY_REBALANCE): 64 sessions in flight fit the one
    rollout host, so a lent host gets a turn only as one ends there; moving half of them to it at the
    lend keeps it busy (the moved turns' context prefilled again) and trains more per second."""
    cal = replace(CAL, decode_a_s=0.002, decode_b_s=0.00025, prefill_s_per_token=0.002 / 15,
                  weight_sync_s=0.007, lend_s=0.004, reclaim_s=0.01, train_s_per_token=5.87e-5)
    wl = replace(WORKLOADS["live-mini"], prompt_tokens=15)
    kw = {"steps": 12, "dt": 0.05, "backlog": "undelivered", "route": "least_loaded", "offer": False, "renew_s": 2.0}
    plain = simulate(Cluster.uniform(2, 1), cal, wl, "seamless", **kw)
    moved = simulate(Cluster.uniform(2, 1), cal, wl, "seamless", rebalance=True, **kw)
    assert plain.lends > 0 and moved.lends > 0
    assert plain.reprefilled < moved.reprefilled
    assert moved.lent_idle_s < 0.5 * plain.lent_idle_s  # lent and given no work
    assert moved.idle_per_host[0] < 0.5 * plain.idle_per_host[0]
    assert moved.trained_tokens_per_s > 1.05 * plain.trained_tokens_per_s
    assert abs(moved.unaccounted_generated) < 1e-6 * moved.generated


def test_the_worth_test_keeps_rebalance_from_moving_long_requests_that_outlast_the_lend():
    """The one-gpu calibration's long tail on 16 hosts, 15 of them the train pool: a lend finds the
    rollout host full of long requests. Moving its share of them (Options.rebalance_worth False, as
    before) re-prefills three times the tokens for nothing; shared/lending.py `move_worth` moves only
    those that finish sooner by more than their re-prefill, and stays at the re-prefill and the
    trained tok/s of no rebalance."""
    wl = replace(WORKLOADS["one-gpu-reasoning"], groups_per_step=128)
    kw = {"steps": 8}
    off = simulate(Cluster.uniform(16, 15), CALIBRATIONS["one-gpu"], wl, "seamless", **kw)
    share = simulate(Cluster.uniform(16, 15), CALIBRATIONS["one-gpu"], wl, "seamless", rebalance=True,
                     rebalance_worth=False, **kw)
    worth = simulate(Cluster.uniform(16, 15), CALIBRATIONS["one-gpu"], wl, "seamless", rebalance=True, **kw)
    assert share.reprefilled > 2.5 * off.reprefilled  # measured 1.04 against 0.32 of generated
    assert worth.reprefilled < 1.1 * off.reprefilled  # measured 0.317
    assert worth.trained_tokens_per_s > 0.98 * off.trained_tokens_per_s  # measured 0.997
    assert abs(worth.unaccounted_generated) < 1e-6 * worth.generated


def test_with_turns_waiting_for_a_slot_rebalance_moves_nothing():
    """A lent host that the queue fills takes nothing from the others: moving a running turn there
    would prefill its context again for a slot a waiting turn takes anyway. (Before, the one-gpu
    calibration at split 60 re-prefilled 103.5% of its generated tokens with rebalance, 29.7%
    without, for +0.2% trained tok/s.)"""
    cal = replace(CAL, decode_a_s=0.002, decode_b_s=0.00025, prefill_s_per_token=0.002 / 15,
                  weight_sync_s=0.007, lend_s=0.004, reclaim_s=0.01, train_s_per_token=5.87e-5, max_seqs=8)
    wl = replace(WORKLOADS["live-mini"], prompt_tokens=15)  # 64 sessions in flight for 8 slots a host
    kw = {"steps": 12, "dt": 0.05, "backlog": "undelivered", "route": "least_loaded", "offer": False, "renew_s": 2.0}
    plain = simulate(Cluster.uniform(2, 1), cal, wl, "seamless", **kw)
    moved = simulate(Cluster.uniform(2, 1), cal, wl, "seamless", rebalance=True, **kw)
    assert plain.lends > 0 and moved.lends == plain.lends
    assert moved.reprefilled == plain.reprefilled and moved.trained_tokens_per_s == plain.trained_tokens_per_s


def test_the_stand_in_engines_prefill_is_one_step_of_the_turns_own():
    """Calibration.prefill_one_step (services/rollout/simulated.py, the engine of bench/pipeline_live.py's
    live side): a request admitted to a step decodes its first token a step later, whatever its context,
    and the others decode on meanwhile. Before, the simulator charged its context x prefill_s_per_token
    as a stall of the whole host: at 2 ms / 15 tokens a 64-turn wave cost the host 128 ms (live: one
    step, 18 ms), and a request moved with 80 tokens done stalled it 13 ms more."""
    cal = replace(CAL, prefill_s_per_token=0.002 / 15, weight_sync_s=0.0)
    wl = replace(WORKLOADS["live-mini"], prompt_tokens=15, max_staleness=0)
    kw = {"steps": 3, "dt": 0.001}  # a fine tick: the trainer sees a wave end when it ends
    one = Simulator(Cluster.uniform(2, 1), replace(cal, prefill_one_step=True), wl, "disaggregated",
                    Options(**kw))
    r = one.run()
    # staleness 0: each step is one wave of 32 turns on the rollout host: 97 steps (a prefill's and 96
    # tokens') of 2 + 0.25 x 32 ms, and no stall; the train step 32 x 111 tokens
    wave = 97 * (0.002 + 0.00025 * 32)
    train = 32 * (15 + 96) * cal.train_s_per_token
    assert r.wall_s == pytest.approx(3 * (wave + train), rel=1e-6)
    assert not one.stall.any()
    stalled = simulate(Cluster.uniform(2, 1), cal, wl, "disaggregated", **kw)  # 32 x 2 ms, then 96 steps
    assert stalled.wall_s == pytest.approx(3 * (32 * 0.002 + 96 * (0.002 + 0.00025 * 32) + train), rel=1e-6)


def test_a_rollout_host_loads_a_version_in_weight_load_s():
    """Calibration.weight_load_s: the stand-in engine's load is a version number (0 s), while the
    trainer's publish (weight_sync_s) takes what it measured; before, every rolling host stalled the
    publish's time at every version."""
    cal = replace(CAL, weight_sync_s=0.2)
    wl = replace(WORKLOADS["live-mini"], max_staleness=0)
    slow = simulate(Cluster.uniform(2, 1), cal, wl, "disaggregated", steps=4, dt=0.05)
    fast = simulate(Cluster.uniform(2, 1), replace(cal, weight_load_s=0.0), wl, "disaggregated", steps=4, dt=0.05)
    # staleness 0: a rollout host loads each version while the next wave waits: 0.2 s a step less
    assert slow.wall_s - fast.wall_s == pytest.approx(3 * 0.2, rel=0.05)


def test_the_heartbeat_backlog_counts_what_the_trajectory_manager_reads():
    """Options.backlog "heartbeat": the live trajectory manager admits on the consumer's pending plus
    what the trainer's last TrainerStatus says it holds (complete groups, the batch in hand). The
    trainer fetches at once, so the finished members of an incomplete group count for nothing, and a
    group completed since the last status neither. "untrained" counted both, and admitted fewer than
    live (bench/pipeline_live.py, 2 hosts: the live rollout host never emptied; the simulated one idled
    26% of the window)."""
    wl = WORKLOADS["live-mini"]  # groups of 8, 4 a step, max_staleness 1: 64 sessions
    sims = {b: Simulator(Cluster.uniform(2, 1), CAL, wl, "disaggregated", Options(steps=2, backlog=b))
            for b in ("untrained", "heartbeat")}
    for sim in sims.values():
        sim.rate_count = 0.0  # as run() starts
        sim._admit()
        assert sim.open == 64
        g0 = int(sim.s_group[np.nonzero(sim.s_state != 0)[0][0]])
        sim._complete(np.nonzero((sim.s_group == g0) & (sim.s_state != 0))[0][:3])  # 3 members of the first group
        sim._admit()
    assert sims["untrained"].open == 61  # 61 open + 3 untrained reach the bound
    assert sims["heartbeat"].open == 64  # the 3 were fetched: the trainer's status holds no complete group
    sim = sims["heartbeat"]
    sim._complete(np.nonzero((sim.s_group == g0) & (sim.s_state != 0))[0])  # the group completes
    sim._admit()  # held by the trainer, not in its status yet: 5 more admitted
    assert sim.available == 8 and sim.open == 64
    sim._trainer_status()  # its next status says so: now they count
    assert sim.status_held == 8
    sim._complete(np.nonzero(sim.s_state != 0)[0][-1:])  # one more member of a later group ends
    sim._admit()
    assert sim.open == 63  # 63 open + 8 held: nothing admitted until the trainer takes its batch
