"""The live offer (services/scheduler/registry.py `Registry.offer`): the work a lent pool host would be
given, from the workers' heartbeats, fills policy.Snapshot.offer as the simulator's does. Properties:
nothing is lent when no work would fit; a host that is lent is offered work."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler import policy
from services.scheduler.registry import Registry
from shared.lending import lent_offer
from shared.messages.scheduler import HostHeartbeat, TrainerStatus


def _cluster(running: int, capacity: int, tokens: int, finished_every: float) -> Registry:
    """host-0 (train, rollout) trains; host-1 (rollout) serves `running` of `capacity` slots; the trainer
    waits for 2 groups of 4."""
    reg = Registry(stale_after=5.0)
    reg.on_heartbeat(HostHeartbeat("host-0", ["train", "rollout"], 1.0, "train", 0, 0.0, worker_id="w0"), 100.0)
    reg.on_heartbeat(HostHeartbeat("host-1", ["rollout"], 1.0, "rollout", 0, 0.0, worker_id="w1"), 100.0)
    reg.on_trainer(TrainerStatus("waiting", 3, 3, 0, 0, 0, 2, 4, 1.0, 0.5, 0.0), 100.0)
    reg.on_worker("w0", 0, 100.0, 0, capacity, serving=False)  # asleep: it trains
    reg.on_worker("w1", running, 100.0, 0, capacity)
    for i in range(3):
        reg.on_finished(100.0 + i * finished_every)
    now = 100.0 + 2 * finished_every + 0.5
    reg.on_worker("w1", running, now, tokens, capacity)
    reg.on_trainer(TrainerStatus("waiting", 3, 3, 0, 0, 0, 2, 4, 1.0, 0.5, 0.0), now)
    reg.on_heartbeat(HostHeartbeat("host-0", ["train", "rollout"], 1.0, "train", 0, 0.0, worker_id="w0"), now)
    reg.on_heartbeat(HostHeartbeat("host-1", ["rollout"], 1.0, "rollout", 0, 0.0, worker_id="w1"), now)
    return reg


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 16), extra=st.integers(-16, 32), tokens=st.integers(1, 20_000),
       every=st.floats(0.5, 10.0))
def test_nothing_is_lent_without_work_and_a_lent_host_is_offered_work(capacity, extra, tokens, every):
    running = max(0, capacity + extra)
    reg = _cluster(running, capacity, tokens, every)
    now = reg.beat_at["w1"]
    snap = reg.snapshot("seamless", now, 1.5, 0)
    o = snap.offer
    assert o is not None and o.hosts == 1 and o.slots == capacity and o.refill
    assert o.turns == max(0, running - capacity)  # the turns queued beyond the serving worker's slots
    lent = [d for d in policy.decide(snap) if d.host == "host-0" and d.mode == "rollout"]
    if o.turns == 0:
        assert not lent, policy.lend_verdict(snap)  # no work would fit: nothing is lent
    for d in lent:  # a lent host is offered work
        assert lent_offer(o, now, d.lent_until or float("inf"), 0, o.slots) > 0


def test_a_queue_beyond_the_slots_and_a_long_wait_lend_the_pool():
    reg = _cluster(running=24, capacity=8, tokens=4000, finished_every=10.0)
    snap = reg.snapshot("seamless", reg.beat_at["w1"], 1.5, 0)
    assert snap.offer.turns == 16
    assert [d.host for d in policy.decide(snap) if d.mode == "rollout"] == ["host-0"]


def test_no_offer_before_anything_is_measured_and_none_for_other_policies():
    reg = Registry()
    reg.on_heartbeat(HostHeartbeat("host-0", ["train", "rollout"], 1.0, "train", 0, 0.0, worker_id="w0"), 1.0)
    assert reg.snapshot("seamless", 1.0, 1.5, 0).offer is None  # no worker heard: the wait alone decides
    reg = _cluster(running=24, capacity=8, tokens=4000, finished_every=10.0)
    assert reg.snapshot("disaggregated", reg.beat_at["w1"], 1.5, 0).offer is None
