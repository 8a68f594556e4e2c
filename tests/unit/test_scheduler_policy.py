"""The placement policies (services/scheduler/policy.py): examples, then hypothesis properties."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.policy import (
    POLICIES,
    Costs,
    Host,
    Snapshot,
    Trainer,
    apply,
    activity,
    decide,
    gate_open,
    lend_verdict,
    predicted_wait,
    train_pool,
    transition_steps,
)

BOTH = frozenset({"train", "rollout", "cpu"})
ROLL = frozenset({"rollout", "cpu"})


def two_hosts(mode0="train", mode1="rollout") -> tuple[Host, ...]:
    return (Host("host-0", BOTH, mode=mode0, target=mode0, epoch=1),
            Host("host-1", ROLL, mode=mode1, target=mode1, epoch=1))


def modes(decisions) -> dict[str, str]:
    return {d.host: d.mode for d in decisions}


# -- examples ---------------------------------------------------------------------------------

def test_disaggregated_is_a_static_split_by_tags():
    hosts = (Host("host-0", BOTH), Host("host-1", ROLL))
    for state in ("waiting", "ready", "absent"):
        s = Snapshot("disaggregated", 0.0, hosts, Trainer(state, 32), completion_rate=1.0)
        assert modes(decide(s)) == {"host-0": "train", "host-1": "rollout"}


def test_seamless_lends_a_waiting_trainers_host_and_reclaims_it_when_the_batch_is_ready():
    s = Snapshot("seamless", 100.0, two_hosts(), Trainer("waiting", 32), completion_rate=2.0)
    (d,) = decide(s)
    assert (d.host, d.mode, d.epoch, d.hold) == ("host-0", "rollout", 2, False)
    assert d.lent_until == 100.0 + 16.0 - 1.0  # predicted wait 32/2 s, minus the reclaim
    lent = two_hosts("rollout", "rollout")
    # while the trainer waits, a lent host stays lent, whatever the prediction
    assert decide(Snapshot("seamless", 0, lent, Trainer("waiting", 1), completion_rate=100.0)) == []
    (d,) = decide(Snapshot("seamless", 0, lent, Trainer("ready", 0)))
    assert (d.host, d.mode, d.hold) == ("host-0", "train", False)  # vacate: requests migrate


def test_seamless_does_not_lend_when_the_wait_is_shorter_than_the_switch():
    costs = Costs(lend_s=2.0, reclaim_s=3.0)
    s = Snapshot("seamless", 0, two_hosts(), Trainer("waiting", 10), completion_rate=2.0, costs=costs,
                 lend_margin=1.5)
    assert predicted_wait(s.trainer, s.completion_rate) == 5.0
    assert decide(s) == []
    assert lend_verdict(s)[0] is False
    s = Snapshot("seamless", 0, two_hosts(), Trainer("waiting", 40), completion_rate=2.0, costs=costs)
    assert modes(decide(s)) == {"host-0": "rollout"}


def test_seamless_lends_whatever_the_prediction_when_no_other_host_rolls_out():
    # live: host-1's worker killed right after a reclaim; the trainer 1 trajectory short (its buffer counts
    # members of groups the kill left incomplete) and a 30 s rate predicting a short wait: host-0 sat idle
    # 21 s while the cut requests waited for host-1 to restart
    costs = Costs(lend_s=0.4, reclaim_s=0.4)
    dead = (Host("host-0", BOTH, mode="train", target="train", epoch=1),
            Host("host-1", ROLL, mode="rollout", target="rollout", epoch=1, healthy=False))
    s = Snapshot("seamless", 0, dead, Trainer("waiting", 1), completion_rate=2.0, costs=costs)
    assert predicted_wait(s.trainer, s.completion_rate) < s.lend_margin * 0.8
    assert lend_verdict(s) == (True, "no host outside the train pool can roll out")
    (d,) = decide(s)
    # lent until the batch is ready, with no prediction (lent_until 0): a router sends it every turn, the long
    # ones the kill cut too (CI: lent until a predicted 1 s, host-0 took none of them; they waited for host-1)
    assert (d.host, d.mode, d.lent_until) == ("host-0", "rollout", 0.0)
    cordoned = (dead[0], replace(dead[1], healthy=True, cordoned=True, mode="idle", target="idle"))
    assert lend_verdict(replace(s, hosts=cordoned))[0] is True
    # host-1 serving, or healthy and on its way to serving: the prediction decides, as before
    s = replace(s, hosts=two_hosts())
    assert lend_verdict(s)[0] is False and decide(s) == []
    assert lend_verdict(replace(s, hosts=two_hosts(mode1="idle")))[0] is False
    # a trainer that computes keeps its hosts, rollout or not
    assert decide(replace(s, hosts=dead, trainer=Trainer("computing", 0))) == []


def test_colocated_alternates_every_host_and_holds_requests():
    rolling = two_hosts("rollout", "rollout")
    ds = decide(Snapshot("colocated", 0, rolling, Trainer("ready", 0)))
    assert {(d.host, d.mode, d.hold) for d in ds} == {("host-0", "train", True), ("host-1", "idle", True)}
    training = (Host("host-0", BOTH, mode="train", target="train"), Host("host-1", ROLL))
    assert modes(decide(Snapshot("colocated", 0, training, Trainer("waiting", 8)))) == {
        "host-0": "rollout", "host-1": "rollout"}


def test_switching_unhealthy_and_cordoned_hosts():
    hosts = (Host("host-0", BOTH, mode="train", target="rollout", epoch=4),  # switching
             Host("host-1", ROLL, healthy=False),
             Host("host-2", ROLL, mode="rollout", target="rollout", cordoned=True, epoch=7))
    (d,) = decide(Snapshot("seamless", 0, hosts, Trainer("ready", 0)))
    assert (d.host, d.mode, d.epoch, d.reason) == ("host-2", "idle", 8, "cordoned")


def test_train_pool_size_and_gate():
    hosts = tuple(Host(f"h{i}", BOTH, mode="train", target="train") for i in range(4))
    s = Snapshot("disaggregated", 0, hosts, train_hosts=2)
    assert train_pool(s) == {"h0", "h1"}
    assert modes(decide(s)) == {"h2": "rollout", "h3": "rollout"}
    assert gate_open(s)
    lent = Snapshot("seamless", 0, (Host("h0", BOTH, mode="rollout", target="train"),))
    assert not gate_open(lent)


def test_no_trainer_lends_everything_under_seamless():
    s = Snapshot("seamless", 0, two_hosts(), Trainer("absent"))
    assert modes(decide(s)) == {"host-0": "rollout"}
    assert decide(s)[0].lent_until == 0.0  # nobody will reclaim it


def test_activity():
    assert activity("rollout", "train", "ready", 3) == "switch"
    assert activity("train", "train", "computing", 0) == "train"
    assert activity("train", "train", "waiting", 0) == "idle"
    assert activity("rollout", "rollout", "waiting", 2) == "rollout"
    assert activity("rollout", "rollout", "waiting", 0) == "idle"


def test_transition_steps():
    assert transition_steps("rollout", False, True, True) == ["offload_trainer", "wake", "load", "resume"]
    assert transition_steps("train", False, True, True) == ["vacate", "sleep", "reload_trainer"]
    assert transition_steps("train", True, True, True) == ["hold", "reload_trainer"]
    assert transition_steps("idle", False, True, False) == ["vacate", "sleep"]
    assert transition_steps("train", False, False, True) == ["reload_trainer"]


# -- properties -------------------------------------------------------------------------------

TAGS = st.sampled_from([BOTH, ROLL, frozenset({"train", "cpu"}), frozenset({"cpu"})])
MODES = st.sampled_from(["rollout", "train", "idle"])


@st.composite
def snapshots(draw) -> Snapshot:
    n = draw(st.integers(1, 8))
    hosts = []
    for i in range(n):
        mode = draw(MODES)
        target = draw(st.one_of(st.just(mode), MODES))
        hosts.append(Host(f"h{i}", draw(TAGS), draw(st.floats(0.5, 4)), mode, target,
                          draw(st.integers(0, 50)), draw(st.booleans()), draw(st.booleans())))
    state = draw(st.sampled_from(["waiting", "ready", "computing", "publishing", "stopped", "absent"]))
    trainer = Trainer(state, 0 if state in ("ready", "computing") else draw(st.integers(0, 512)))
    return Snapshot(draw(st.sampled_from(POLICIES)), draw(st.floats(0, 1e6)), tuple(hosts), trainer,
                    draw(st.floats(0, 100)), Costs(draw(st.floats(0.01, 20)), draw(st.floats(0.01, 20))),
                    draw(st.floats(1, 3)), draw(st.integers(0, 4)))


@given(snapshots())
@settings(max_examples=400, deadline=None)
def test_property_one_decision_per_settled_healthy_host_with_the_next_epoch(s: Snapshot):
    ds = decide(s)
    by_id = {h.id: h for h in s.hosts}
    assert len({d.host for d in ds}) == len(ds)  # one mode per host at a time
    for d in ds:
        h = by_id[d.host]
        assert h.healthy and not h.switching
        assert d.epoch == h.epoch + 1 and d.mode != h.target


@given(snapshots())
@settings(max_examples=400, deadline=None)
def test_property_train_roles_only_on_train_hosts_and_rollout_only_on_rollout_hosts(s: Snapshot):
    by_id = {h.id: h for h in s.hosts}
    for d in decide(s):
        if d.mode == "train":
            assert by_id[d.host].can_train
        if d.mode == "rollout":
            assert by_id[d.host].can_rollout


@given(snapshots())
@settings(max_examples=400, deadline=None)
def test_property_no_lend_when_the_predicted_wait_is_below_the_switch_cost(s: Snapshot):
    if s.policy != "seamless" or s.trainer.state in ("absent", "stopped"):
        return
    wait = predicted_wait(s.trainer, s.completion_rate)
    pool = train_pool(s)
    others_roll_out = any(h.healthy and not h.cordoned and h.can_rollout and h.id not in pool for h in s.hosts)
    for d in decide(s):
        if d.mode == "rollout" and d.host in pool:
            # the exception: nothing else rolls out, so the data can only come from the pool
            assert wait > s.lend_margin * (s.costs.lend_s + s.costs.reclaim_s) or not others_roll_out
            assert not s.trainer.wants_hosts


@given(snapshots(), st.sampled_from(["waiting", "ready", "computing", "publishing"]), st.floats(0, 1e3),
       st.floats(1e-4, 1.0))
@settings(max_examples=400, deadline=None)
def test_property_a_trainer_that_never_waits_for_data_is_never_lent_from(s: Snapshot, state, rate, switch_s):
    """Where the trainer never waits, seamless lends nothing: while it computes or publishes, is at the
    gate, or reports waiting with its next batch already buffered (samples_needed 0: it takes the batch
    at once), no train-pool host is sent to rollout, whatever the completion rate, however cheap the
    switch. (The one exception, kept: no host outside the pool can roll out.)"""
    s = replace(s, policy="seamless", trainer=Trainer(state, 0), completion_rate=rate,
                costs=Costs(switch_s, switch_s))
    pool = train_pool(s)
    if not any(h.healthy and not h.cordoned and h.can_rollout and h.id not in pool for h in s.hosts):
        return
    assert not lend_verdict(s)[0]
    by_id = {h.id: h for h in s.hosts}
    for d in decide(s):
        assert not (d.mode == "rollout" and d.host in pool and by_id[d.host].target != "rollout"), d


@given(snapshots(), st.lists(st.tuples(st.sampled_from(["waiting", "ready", "computing"]),
                                       st.integers(0, 64), st.booleans()), min_size=1, max_size=30))
@settings(max_examples=200, deadline=None)
def test_property_epochs_are_monotone_and_a_reclaim_vacates_before_training(s: Snapshot, script):
    """Drive decide() through a run: each tick the trainer changes and some hosts finish
    switching. Epochs only grow, and every step plan into train vacates or holds first."""
    last_epoch = {h.id: h.epoch for h in s.hosts}
    for state, needed, settle in script:
        s = Snapshot(s.policy, s.now + 1, s.hosts, Trainer(state, 0 if state != "waiting" else needed),
                     s.completion_rate, s.costs, s.lend_margin, s.train_hosts)
        ds = decide(s)
        for d in ds:
            assert d.epoch > last_epoch[d.host]
            last_epoch[d.host] = d.epoch
            steps = transition_steps(d.mode, d.hold, True, True)
            if d.mode == "train":
                first = steps.index("reload_trainer")
                assert {"vacate", "hold"} & set(steps[:first]), steps
            if d.mode == "rollout":
                assert steps.index("load") < steps.index("resume")
        s = apply(s, ds)
        if settle:  # the host agents report: modes catch up with targets
            s = Snapshot(s.policy, s.now, tuple(
                Host(h.id, h.tags, h.capacity, h.target, h.target, h.epoch, h.healthy, h.cordoned)
                for h in s.hosts), s.trainer, s.completion_rate, s.costs, s.lend_margin, s.train_hosts)
    assert all(math.isfinite(e) for e in last_epoch.values())


# -- the drain trade-off: re-prefill against trainer time ---------------------------------------

def lent_host(running=0, lent_until=300.0, epoch=3) -> Host:
    return Host("host-0", BOTH, mode="rollout", target="rollout", epoch=epoch, running=running, lent_until=lent_until)


def test_without_a_grace_a_ready_batch_reclaims_a_busy_lent_host_at_once():
    s = Snapshot("seamless", 200.0, (lent_host(running=40),), Trainer("ready", 0, wants_since=199.0))
    (d,) = decide(s)
    assert (d.mode, d.hold) == ("train", False)  # vacate: its 40 sequences migrate and prefill again


def test_the_grace_drains_a_lent_host_then_reclaims_it_when_empty_or_out_of_time():
    def snap(now, host):
        return Snapshot("seamless", now, (host,), Trainer("ready", 0, wants_since=200.0), reclaim_grace_s=30.0)

    # 1. the batch is ready: the lent host is closed to new turns (lent_until = now), not reclaimed
    s = snap(201.0, lent_host(running=40))
    (d,) = decide(s)
    assert (d.mode, d.epoch, d.lent_until) == ("rollout", 4, 201.0) and d.reason.startswith("drain")
    assert not gate_open(s)
    # 2. once closed, nothing more is issued while it drains
    s = apply(s, [d])
    assert s.hosts[0].lent_until == 201.0 and s.hosts[0].target == "rollout"
    assert decide(replace(s, now=210.0)) == []
    # 3. it runs nothing any more: reclaimed before the grace is out
    (d,) = decide(replace(s, now=215.0, hosts=(replace(s.hosts[0], running=0),)))
    assert (d.mode, d.epoch) == ("train", 5)
    # 4. still running when the grace since the trainer became ready is out: reclaimed anyway
    (d,) = decide(replace(s, now=230.0))
    assert d.mode == "train"


def test_a_host_already_closed_by_its_prediction_drains_without_a_new_assignment():
    s = Snapshot("seamless", 201.0, (lent_host(running=40, lent_until=180.0),), Trainer("ready", 0, wants_since=200.0),
                 reclaim_grace_s=30.0)
    assert decide(s) == []  # lent_until 180 < now: routers already send it nothing


def test_with_a_grace_lending_waits_for_the_settle_and_counts_the_grace_as_switch():
    costs = Costs(lend_s=2.0, reclaim_s=3.0)  # switch 5 s; lend_margin 1.5: a wait over 7.5 s lends
    waiting = Trainer("waiting", 200, waiting_since=100.0)  # predicted wait 200 / 2 = 100 s
    s = Snapshot("seamless", 110.0, two_hosts(), waiting, completion_rate=2.0, costs=costs, reclaim_grace_s=20.0,
                 lend_settle_s=30.0)
    ok, why = lend_verdict(s)
    assert not ok and why.startswith("settling") and decide(s) == []  # waited 10 s of 30
    assert modes(decide(replace(s, now=130.0))) == {"host-0": "rollout"}  # 100 s > 1.5 x (5 + 20)
    assert modes(decide(replace(s, reclaim_grace_s=0.0))) == {"host-0": "rollout"}  # no grace: no settle
    # the grace is part of the switch: 30 s of predicted wait lends without a grace, not with 20 s of it
    short = replace(s, now=130.0, trainer=replace(waiting, samples_needed=60))
    assert decide(short) == [] and "switch 25.00s" in lend_verdict(short)[1]
    assert modes(decide(replace(short, reclaim_grace_s=0.0))) == {"host-0": "rollout"}


def test_until_a_lend_is_measured_the_margin_is_at_most_one():
    """A margin of 4 on a 1 s prior asks for 8 s of predicted wait; a real lend may take 0.3 s. With
    the prior the margin is 1, so one lend measures it; measured, the configured margin applies."""
    waiting = Trainer("waiting", 10)  # predicted wait 10 / 2 = 5 s: over 1 x 2 s, under 4 x 2 s
    prior = Snapshot("seamless", 100.0, two_hosts(), waiting, completion_rate=2.0,
                     costs=Costs(1.0, 1.0, measured=False), lend_margin=4.0)
    ok, why = lend_verdict(prior)
    assert ok and "until a lend is measured" in why and modes(decide(prior)) == {"host-0": "rollout"}
    measured = replace(prior, costs=Costs(1.0, 1.0))
    ok, why = lend_verdict(measured)
    assert not ok and "4 x switch 2.00s" in why and decide(measured) == []
    # the prior never lowers a margin already at or below 1: a wait under the switch lends nothing
    assert not lend_verdict(replace(prior, trainer=Trainer("waiting", 3)))[0]  # 1.5 s <= 1 x 2 s
    assert lend_verdict(replace(prior, lend_margin=0.5, trainer=Trainer("waiting", 3)))[0]  # 1.5 s > 0.5 x 2 s


def test_the_drain_margin_closes_lent_hosts_before_the_predicted_reclaim():
    s = Snapshot("seamless", 100.0, two_hosts(), Trainer("waiting", 64), completion_rate=2.0, drain_margin_s=10.0)
    (d,) = decide(s)
    assert d.mode == "rollout" and d.lent_until == 100.0 + 32.0 - 1.0 - 10.0
    # the margin comes off the lend window: a wait that no longer beats lend_margin x switch lends nothing
    short = Snapshot("seamless", 100.0, two_hosts(), Trainer("waiting", 16), completion_rate=2.0,
                     costs=Costs(2.0, 2.0), lend_margin=1.0, drain_margin_s=5.0)
    assert decide(replace(short, drain_margin_s=0.0))[0].mode == "rollout"  # 8 s > 4 s
    assert decide(short) == []  # 8 - 5 = 3 s < 4 s
    # lent, and the reclaim is now predicted well before its lent_until: lent_until moves earlier
    serving = Host("host-1", ROLL, mode="rollout", target="rollout", epoch=1)  # rollout outside the pool
    lent = Snapshot("seamless", 110.0, (lent_host(lent_until=121.0), serving), Trainer("waiting", 30),
                    completion_rate=2.0, drain_margin_s=10.0)
    (d,) = decide(lent)
    assert (d.mode, d.epoch, d.lent_until) == ("rollout", 4, 110.0 + 15.0 - 1.0 - 10.0)
    assert decide(replace(lent, drain_margin_s=0.0)) == []  # without a margin a lent host is left alone
    assert decide(replace(lent, hosts=(lent_host(lent_until=114.5), serving))) == []  # moved less than 1 s
    # the pool the only rollout there is: no prediction, so no margin either
    assert decide(replace(lent, hosts=(lent_host(lent_until=121.0),))) == []


def test_rollout_to_rollout_leaves_the_trainer_rank_alone():
    assert transition_steps("rollout", False, True, True, current="rollout") == ["wake", "load", "resume"]
    assert transition_steps("rollout", False, True, True, current="train") == ["offload_trainer", "wake", "load",
                                                                              "resume"]


def test_renew_keeps_a_lent_host_open_while_the_trainer_outwaits_the_prediction():
    serving = Host("host-1", ROLL, mode="rollout", target="rollout", epoch=1)
    waiting = Trainer("waiting", 4)  # predicted wait 4 / 2 = 2 s: reclaim predicted 1 s from now
    s = Snapshot("seamless", 100.0, (lent_host(lent_until=100.5), serving), waiting, completion_rate=2.0,
                 renew_s=2.0)
    (d,) = decide(s)
    assert (d.host, d.mode, d.epoch) == ("host-0", "rollout", 4) and d.lent_until == 102.0  # now + renew_s
    assert decide(replace(s, renew_s=0.0)) == []  # off: the host stays lent and closed until the batch
    assert decide(replace(s, hosts=(lent_host(lent_until=101.5), serving))) == []  # still open > renew_s / 2
    (d,) = decide(replace(s, hosts=(lent_host(lent_until=99.0), serving)))  # already closed: reopened
    assert d.lent_until == 102.0
    # the batch is ready: a drain, not a renewal
    (d,) = decide(replace(s, trainer=Trainer("ready", 0)))
    assert d.mode == "train"
    # a fresh lend is open at least renew_s too
    (d,) = decide(replace(s, hosts=(Host("host-0", BOTH, mode="train", target="train", epoch=1), serving),
                          costs=Costs(0.1, 0.1)))
    assert d.mode == "rollout" and d.lent_until == 102.0


def test_a_host_lent_because_no_trainer_runs_is_open_to_every_turn():
    (d,) = decide(Snapshot("seamless", 100.0, two_hosts("idle", "rollout")))
    assert (d.mode, d.lent_until) == ("rollout", 0.0)
