"""The scheduler's registry (services/scheduler/registry.py): health, switches, backlog, timelines."""

from __future__ import annotations

from services.scheduler.policy import Costs, decide
from services.scheduler.registry import Registry
from shared.messages.scheduler import HostHeartbeat, HostModeChanged, Interval, TrainerStatus, fractions


def hb(host="host-1", mode="idle", epoch=0, restarts=0, tags=("rollout", "cpu")) -> HostHeartbeat:
    return HostHeartbeat(host, list(tags), 1.0, mode, epoch, 0.0, worker_id=f"{host}-rollout", restarts=restarts)


def trainer(state="waiting", buffered=0, ready=0, open_=0) -> TrainerStatus:
    return TrainerStatus(state, 3, 3, ready, open_, buffered, 2, 4, 1.0, 0.5, 0.0)


def test_a_host_registers_and_dies_by_heartbeat_age():
    reg = Registry(stale_after=3.0)
    assert "registered" in reg.on_heartbeat(hb(), now=100.0)[0]
    assert reg.check_health(102.9) == []
    (note,) = reg.check_health(103.5)
    assert "host-1 dead" in note and not reg.hosts["host-1"].healthy
    assert "is back" in reg.on_heartbeat(hb(), now=104.0)[0]
    assert reg.hosts["host-1"].healthy


def test_a_serving_host_dies_with_its_worker():
    reg = Registry(stale_after=3.0)
    reg.on_heartbeat(hb(), 100.0)
    reg.issued("host-1", "rollout", 1, 100.0)
    reg.on_changed(HostModeChanged("host-1", "rollout", 1, 100.0, 100.5), 100.5)
    reg.on_worker("host-1-rollout", 2, 100.5)
    reg.on_heartbeat(hb(mode="rollout", epoch=1), 104.0)  # the agent is alive ...
    (note,) = reg.check_health(104.0)  # ... but its worker went silent 3.5 s ago
    assert "dead" in note


def test_a_host_whose_worker_exits_is_dead_until_the_restarted_worker_is_up():
    reg = Registry()
    reg.on_heartbeat(hb(), 100.0)
    reg.issued("host-1", "rollout", 4, 100.0)
    reg.on_changed(HostModeChanged("host-1", "rollout", 4, 100.0, 100.2), 100.2)
    reg.on_worker("host-1-rollout", 1, 100.5)
    starting = HostHeartbeat("host-1", ["rollout"], 1.0, "idle", 4, 0.0, "host-1-rollout", restarts=1, ready=False)
    notes = reg.on_heartbeat(starting, 101.0)
    assert any("host-1 dead: its worker exited" in n for n in notes)
    assert not reg.hosts["host-1"].healthy
    assert reg.on_heartbeat(starting, 110.0) == []  # still starting: still dead
    reg.on_worker("host-1-rollout", 0, 111.0)
    notes = reg.on_heartbeat(hb(mode="idle", epoch=4, restarts=1), 111.5)
    assert any("is back" in n for n in notes)
    rec = reg.hosts["host-1"]
    assert (rec.mode, rec.target, rec.epoch, rec.healthy) == ("idle", "idle", 4, True)


def test_a_serving_worker_not_heard_yet_gets_a_heartbeat_period_from_its_switch():
    reg = Registry(stale_after=3.0)
    reg.on_heartbeat(hb(), 100.0)
    reg.issued("host-1", "rollout", 1, 100.0)
    reg.on_changed(HostModeChanged("host-1", "rollout", 1, 100.0, 100.1), 100.1)
    reg.on_heartbeat(hb(mode="rollout", epoch=1), 102.0)
    assert reg.check_health(102.0) == []
    reg.on_heartbeat(hb(mode="rollout", epoch=1), 103.5)
    assert "dead" in reg.check_health(103.5)[0]


def test_switch_reports_move_modes_costs_and_counts_only_for_the_current_epoch():
    reg = Registry()
    reg.on_heartbeat(hb("host-0", "train", tags=("train", "rollout")), 100.0)
    reg.issued("host-0", "rollout", 1, 100.0)
    assert reg.on_changed(HostModeChanged("host-0", "rollout", 0, 100.0, 100.1), 100.1) is None  # old epoch
    assert reg.hosts["host-0"].mode == "train"
    reg.on_changed(HostModeChanged("host-0", "rollout", 1, 100.0, 102.0), 102.0)
    assert reg.hosts["host-0"].mode == "rollout" and reg.counts["lends"] == 1
    assert reg.costs.lend_s == 2.0  # the first measurement replaces the 1 s prior
    reg.issued("host-0", "train", 2, 103.0)
    msg = reg.on_changed(HostModeChanged("host-0", "train", 2, 103.0, 103.1, ok=False, error="boom"), 103.1)
    assert "failed" in msg and not reg.hosts["host-0"].healthy and reg.counts["failed_switches"] == 1


def test_a_switch_that_never_reports_times_out():
    reg = Registry(switch_timeout=10.0)
    reg.on_heartbeat(hb(), 100.0)
    reg.issued("host-1", "rollout", 1, 100.0)
    reg.on_heartbeat(hb(), 109.0)
    assert reg.check_health(109.0) == []
    reg.on_heartbeat(hb(), 111.0)
    (note,) = reg.check_health(111.0)
    assert "did not apply" in note


def test_trainer_view_and_completion_rate():
    reg = Registry(stale_after=3.0)
    assert reg.trainer_view(0.0).state == "absent"
    reg.on_trainer(trainer("waiting", buffered=3, open_=1), 10.0)
    t = reg.trainer_view(11.0)
    assert (t.state, t.samples_needed) == ("waiting", 2 * 4)  # 3 members of an open group: no whole group
    reg.gate_pending = True
    assert reg.trainer_view(11.0).state == "ready"
    assert reg.trainer_view(20.0).state == "ready"  # a gate request without heartbeats still counts
    for t in range(10):
        reg.on_finished(100.0 + t)
    assert abs(reg.completion_rate(110.0) - 10 / 10.0) < 1e-9
    assert reg.completion_rate(200.0) == 0.0  # all older than the window


def test_the_snapshot_says_since_when_the_trainer_waits():
    reg = Registry(stale_after=3.0)
    assert reg.on_trainer(trainer("waiting", buffered=3), 10.0)  # the first status: a decision is due
    assert reg.snapshot("seamless", 11.0, 1.5, 0).trainer.waiting_since == 11.0
    assert not reg.on_trainer(trainer("waiting", buffered=5), 12.0)  # same state: the tick decides
    s = reg.snapshot("seamless", 12.5, 1.5, 0, reclaim_grace_s=20.0, lend_settle_s=7.0)
    assert (s.trainer.waiting_since, s.reclaim_grace_s, s.lend_settle_s) == (11.0, 20.0, 7.0)  # still the first
    assert reg.on_trainer(trainer("computing"), 13.0)  # a state change: the scheduler decides at once
    assert reg.snapshot("seamless", 13.5, 1.5, 0).trainer.waiting_since == 0.0
    reg.on_trainer(trainer("waiting"), 20.0)
    assert reg.snapshot("seamless", 20.5, 1.5, 0).trainer.waiting_since == 20.5  # a new wait


def test_timeline_intervals_follow_activity():
    reg = Registry()
    reg.on_heartbeat(hb("host-0", "train", tags=("train", "rollout")), 100.0)
    reg.on_trainer(trainer("computing"), 100.0)
    closed = reg.record_activity(101.0)
    assert [(h, iv.activity) for h, iv in closed] == [("host-0", "idle")]
    reg.on_trainer(trainer("waiting"), 103.0)
    closed = reg.record_activity(103.0)
    assert closed[0][1] == Interval("train", 101.0, 103.0)
    tl = reg.timeline("host-0", 104.0)
    assert [iv.activity for iv in tl] == ["idle", "train", "idle"]
    f = fractions(tl, 101.0, 104.0)
    assert abs(f["train"] - 2 / 3) < 1e-9 and abs(f["idle"] - 1 / 3) < 1e-9


def test_a_stale_waiting_heartbeat_after_a_granted_gate_still_counts_as_computing():
    """The race seen live: the trainer's 'waiting' heartbeat of step 3 arrives after the gate of
    step 4 was granted; lending host-0 then would take it from under a running step."""
    reg = Registry()
    reg.on_trainer(trainer("waiting"), 10.0)  # TrainerStatus.step == 3
    reg.granted(4)
    assert reg.trainer_view(10.5).state == "computing"
    done = TrainerStatus("waiting", 4, 4, 0, 0, 0, 2, 4, 1.0, 0.5, 0.0)
    reg.on_trainer(done, 11.0)
    assert reg.trainer_view(11.0).state == "waiting"


def test_the_first_measured_switch_replaces_the_configured_prior():
    reg = Registry()
    reg.on_heartbeat(hb("host-0", "train", tags=("train", "rollout")), 100.0)
    reg.issued("host-0", "rollout", 1, 100.0)
    reg.on_changed(HostModeChanged("host-0", "rollout", 1, 100.0, 100.02), 100.1)
    assert abs(reg.costs.lend_s - 0.02) < 1e-6 and reg.costs.reclaim_s == 1.0


def test_a_host_whose_worker_is_starting_is_not_placed():
    reg = Registry()
    reg.on_heartbeat(HostHeartbeat("host-1", ["rollout"], 1.0, "idle", 0, 0.0, "host-1-rollout", ready=False), 1.0)
    assert reg.hosts["host-1"].view().healthy is False and reg.hosts["host-1"].healthy
    notes = reg.on_heartbeat(HostHeartbeat("host-1", ["rollout"], 1.0, "idle", 0, 0.0, "host-1-rollout"), 2.0)
    assert "worker up" in notes[0] and reg.hosts["host-1"].view().healthy


def test_the_snapshot_carries_what_the_reclaim_grace_reads():
    """running (from the worker's status), lent_until (from the last assignment) and the time
    the trainer began to want its hosts."""
    reg = Registry()
    reg.on_heartbeat(hb("host-0", "rollout", tags=("train", "rollout")), 100.0)
    reg.issued("host-0", "rollout", 1, 100.0, lent_until=160.0)
    reg.on_worker("host-0-rollout", 12, 100.5)
    reg.on_trainer(trainer("waiting"), 100.0)
    s = reg.snapshot("seamless", 101.0, 1.5, 0, drain_margin_s=5.0, reclaim_grace_s=30.0)
    (h,) = s.hosts
    assert (h.running, h.lent_until) == (12, 160.0)
    assert (s.drain_margin_s, s.reclaim_grace_s, s.trainer.wants_since) == (5.0, 30.0, 0.0)
    reg.gate_pending = True  # the batch is ready
    assert reg.snapshot("seamless", 102.0, 1.5, 0).trainer.wants_since == 102.0
    assert reg.snapshot("seamless", 104.0, 1.5, 0).trainer.wants_since == 102.0  # kept while it wants them
    reg.gate_pending = False
    reg.on_trainer(trainer("computing"), 105.0)
    reg.granted(3)
    reg.on_trainer(trainer("waiting"), 110.0)
    assert reg.snapshot("seamless", 110.0, 1.5, 0).trainer.wants_since == 0.0
    reg.issued("host-0", "train", 2, 111.0, lent_until=160.0)
    assert reg.hosts["host-0"].lent_until == 0.0  # only a rollout assignment is lent


def test_the_predicted_wait_counts_whole_groups_only():
    """2 groups of 4 a step; 3 groups filling at once hold 6 members, none complete. The trainer
    waits for 8 samples that complete whole groups, not for 8 - 6 = 2."""
    reg = Registry()
    reg.on_trainer(trainer("waiting", buffered=6, open_=3), 10.0)
    assert reg.trainer_view(10.0).samples_needed == 8
    reg.on_trainer(trainer("waiting", buffered=7, ready=1, open_=1), 11.0)  # one group complete, 3 open
    assert reg.trainer_view(11.0).samples_needed == 4
    reg.on_trainer(trainer("waiting", buffered=12, ready=3), 12.0)  # more than a step buffered (prefetch)
    assert reg.trainer_view(12.0).samples_needed == 0
    # the wait: whole-group samples at the rate whole groups come (1 group of 4 every 2 s = 2 samples/s)
    reg.on_trainer(trainer("waiting", buffered=6, open_=3), 20.0)
    for i in range(16):
        reg.on_finished(20.0 + i * 0.5, f"g{i // 4}")
    reg.on_trainer(trainer("waiting", buffered=6, open_=3), 28.0)  # its groups went to the last step
    s = reg.snapshot("seamless", 28.0, 1.5, 0)
    assert s.trainer.samples_needed == 8 and abs(s.completion_rate - 4 * 4 / (28.0 - 21.5)) < 1e-9
    rates = reg.rates(28.0)
    assert abs(rates["predicted_wait_s"] - 8 / s.completion_rate) < 1e-9
    assert abs(rates["sessions_per_s"] - 16 / 8.0) < 1e-9 and abs(rates["groups_per_s"] - 4 / 6.5) < 1e-9


def test_groups_complete_with_their_last_member_and_both_rates_are_measured():
    reg = Registry()
    reg.on_finished(1.0, "a")  # no trainer heard yet: its group size is unknown, members are counted
    reg.on_trainer(trainer("waiting"), 1.0)  # group_size 4
    for t, g in [(2.0, "a"), (2.5, "b"), (3.0, "a"), (4.0, "b"), (5.0, "a"), (6.0, "b"), (7.0, "b")]:
        reg.on_finished(t, g)
    assert list(reg.groups_done) == [5.0, 7.0] and reg.open_groups == {}
    assert abs(reg.group_rate(7.0) - 2 / 2.0) < 1e-9
    assert abs(reg.completion_rate(7.0) - 8 / 6.0) < 1e-9
    assert abs(reg.whole_group_rate(7.0) - 4 * 1.0) < 1e-9
    reg.on_finished(8.0, "c")
    assert reg.whole_group_rate(100.0) == 0.0 and reg.open_groups == {"c": 1}  # the window passed


def test_a_trainer_that_never_waits_for_data_is_never_lent_from():
    """bench/pipeline_live.py with a slow trainer step (--s-per-token 0.001: a step of 3.5 s, a batch
    rolled out in ~2 s): the trainer reports waiting after each publish, but with its next batch
    already buffered, so it takes it at once. At every status the scheduler sees, seamless lends
    nothing, although switches are measured at 10 ms and groups complete at a steady rate."""
    reg = Registry(costs=Costs(0.01, 0.01))
    reg.on_heartbeat(hb("host-0", "train", tags=("train", "rollout")), 0.0)
    reg.on_heartbeat(hb("host-1", "rollout"), 0.0)
    t, lends = 0.0, []
    for step in range(1, 11):  # 2 groups of 4 a step (trainer()): each step's batch finishes mid-compute
        for state, ready in (("waiting", 2), ("ready", 0), ("computing", 0)):
            reg.on_trainer(TrainerStatus(state, step - 1, step - 1, ready, 0, 4 * ready, 2, 4, 0.0, 3.5, t), t)
            lends += [d for d in decide(reg.snapshot("seamless", t, 1.5, 0)) if d.mode == "rollout"]
            t += 0.005
        for i in range(8):
            reg.on_finished(t + 1.0 + i * 0.1, f"s{step}g{i // 4}")
        t += 3.5
        reg.on_trainer(TrainerStatus("publishing", step, step, 2, 0, 8, 2, 4, 0.0, 3.5, t), t)
        lends += [d for d in decide(reg.snapshot("seamless", t, 1.5, 0)) if d.mode == "rollout"]
    assert reg.whole_group_rate(t) > 0 and lends == []


def test_without_completed_groups_the_session_rate_stands_in():
    reg = Registry()
    reg.on_trainer(trainer("waiting"), 0.0)
    for t in range(5):
        reg.on_finished(float(t), f"g{t}")  # five groups open, none complete
    assert reg.group_rate(4.0) == 0.0 and reg.whole_group_rate(4.0) == reg.completion_rate(4.0) > 0


def test_every_lend_is_a_measured_switch_the_start_up_lend_too():
    reg = Registry(costs=Costs(1.0, 1.0, measured=False))  # the configured priors, as the service starts
    reg.on_heartbeat(hb("host-0", "idle", tags=("train", "rollout")), 100.0)  # registers idle
    reg.on_heartbeat(hb("host-1", "idle"), 100.0)
    reg.issued("host-0", "rollout", 1, 100.0)
    reg.issued("host-1", "rollout", 1, 100.0)
    reg.on_changed(HostModeChanged("host-1", "rollout", 1, 100.0, 100.1), 100.1)  # a rollout host: no lend
    assert not reg.costs.measured and reg.counts["lends"] == 0  # its wake is no lend: the priors stand
    reg.on_changed(HostModeChanged("host-0", "rollout", 1, 100.0, 100.4), 100.4)  # idle -> rollout: a lend
    assert reg.counts["lends"] == 1 and abs(reg.costs.lend_s - 0.4) < 1e-9 and reg.costs.measured
    reg.issued("host-0", "train", 2, 101.0)
    reg.on_changed(HostModeChanged("host-0", "train", 2, 101.0, 101.5), 101.5)
    assert reg.counts["reclaims"] == 1 and abs(reg.costs.reclaim_s - 0.5) < 1e-9 and reg.costs.measured
    reg.issued("host-0", "rollout", 3, 102.0)
    reg.on_changed(HostModeChanged("host-0", "rollout", 3, 102.0, 102.2), 102.2)  # train -> rollout
    assert reg.counts["lends"] == 2 and abs(reg.costs.lend_s - (0.7 * 0.4 + 0.3 * 0.2)) < 1e-9
    reg.issued("host-0", "rollout", 4, 103.0, lent_until=103.0)  # a drain: rollout -> rollout, no switch
    reg.on_changed(HostModeChanged("host-0", "rollout", 4, 103.0, 103.01), 103.01)
    assert reg.counts["lends"] == 2


def lent_host(reg: Registry) -> None:
    reg.on_heartbeat(hb("host-0", "train", tags=("train", "rollout")), 100.0)
    reg.on_trainer(trainer("waiting"), 100.0)
    reg.issued("host-0", "rollout", 1, 100.0, lent_until=130.0)
    reg.on_changed(HostModeChanged("host-0", "rollout", 1, 100.0, 100.5), 100.5)


def test_a_lent_host_whose_turns_end_between_heartbeats_shows_rollout():
    """The demo's short turns start and end between two worker heartbeats: every beat reports
    running 0, but the worker's generated tokens grew, so the host served."""
    reg = Registry()
    lent_host(reg)
    reg.on_worker("host-0-rollout", 0, 100.6, generated_tokens=500)
    reg.record_activity(100.6)
    reg.on_worker("host-0-rollout", 0, 101.6, generated_tokens=540)  # 40 tokens since, none running now
    reg.record_activity(101.6)
    assert reg.hosts["host-0"].activity == "rollout" and reg.lent_idle() == []
    reg.on_worker("host-0-rollout", 0, 102.6, generated_tokens=540)  # nothing since
    reg.record_activity(102.6)
    assert [iv.activity for iv in reg.timeline("host-0", 103.0)] == ["idle", "rollout", "idle"]


def test_a_lent_host_that_receives_nothing_shows_idle_and_is_named():
    reg = Registry()
    lent_host(reg)
    for i in range(3):
        reg.on_worker("host-0-rollout", 0, 101.0 + i, generated_tokens=500)
        reg.record_activity(101.0 + i)
    assert reg.hosts["host-0"].activity == "idle" and reg.lent_idle() == ["host-0"]
    assert reg.rates(104.0)["lent_idle_hosts"] == 1.0
    reg.on_worker("host-0-rollout", 0, 104.0, generated_tokens=3)  # a restarted worker counts from 0
    assert reg.lent_idle() == ["host-0"]


def test_lent_idle_host_seconds_add_up_while_a_lent_host_serves_nothing():
    reg = Registry()
    lent_host(reg)
    reg.on_worker("host-0-rollout", 0, 101.0, generated_tokens=500)
    reg.record_activity(101.0)
    for i in range(1, 4):  # 3 s lent and idle: nothing generated
        reg.on_worker("host-0-rollout", 0, 101.0 + i, generated_tokens=500)
        reg.record_activity(101.0 + i)
    assert reg.hosts["host-0"].activity == "idle" and 2.0 <= reg.lent_idle_s <= 3.0
    idle = reg.lent_idle_s
    reg.on_worker("host-0-rollout", 1, 105.0, generated_tokens=600)  # serves again: no more idle seconds
    reg.record_activity(105.0)
    reg.on_worker("host-0-rollout", 1, 106.0, generated_tokens=700)
    reg.record_activity(106.0)
    assert reg.lent_idle_s == idle + 1.0  # the second before it was seen serving
    assert reg.rates(106.0)["lent_idle_host_s"] == reg.lent_idle_s


def test_a_host_that_trains_from_the_start_has_its_switch_into_train_measured():
    """disaggregated first, then seamless: host-0 went idle -> train and was never lent. That switch
    runs a reclaim's steps, so it replaces the 1 s reclaim prior (not counted as a reclaim cycle)."""
    reg = Registry()
    reg.on_heartbeat(hb("host-0", "idle", tags=("train", "rollout")), 100.0)
    reg.issued("host-0", "train", 1, 100.0)
    reg.on_changed(HostModeChanged("host-0", "train", 1, 100.0, 100.05), 100.05)
    assert abs(reg.costs.reclaim_s - 0.05) < 1e-9 and reg.counts["reclaims"] == 0 and reg.costs.lend_s == 1.0
    reg.issued("host-0", "rollout", 2, 101.0)
    reg.on_changed(HostModeChanged("host-0", "rollout", 2, 101.0, 101.2), 101.2)
    reg.issued("host-0", "train", 3, 102.0)
    reg.on_changed(HostModeChanged("host-0", "train", 3, 102.0, 102.15), 102.15)  # a reclaim: blended in
    assert reg.counts["reclaims"] == 1 and abs(reg.costs.reclaim_s - (0.7 * 0.05 + 0.3 * 0.15)) < 1e-9
