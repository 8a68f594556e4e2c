"""Lending that pays, as properties: the lend verdict (services/scheduler/policy.py) lends nothing
when no turn would fit a lent host, and the simulator (services/scheduler/sim/simulator.py) never
leaves a lent host without work while a turn it would take waits."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.policy import Costs, Host, Snapshot, Trainer, decide, train_pool
from services.scheduler.sim import Cluster, Simulator
from services.scheduler.sim.simulator import QUEUED, Options
from services.scheduler.sim.workload import CALIBRATIONS, Workload
from shared.lending import DecodeSpeed, Offer, lent_offer

BOTH = frozenset({"train", "rollout", "gpu"})


@settings(max_examples=200, deadline=None)
@given(n_pool=st.integers(1, 6), needed=st.integers(1, 2000), rate=st.floats(0.01, 50.0),
       lend_s=st.floats(0.1, 10.0), expected=st.floats(100.0, 16_000.0), turns=st.integers(0, 5000),
       a=st.floats(0.001, 0.05), b=st.floats(0.0, 0.001), rule=st.sampled_from([None, 0.17, 2.0]))
def test_nothing_is_lent_when_no_work_would_fit(n_pool, needed, rate, lend_s, expected, turns, a, b, rule):
    """Seamless, the trainer waiting, a host outside the pool serving: if a lent host would be
    given no turn (lent_offer over the window from the lend to the reclaim is 0), decide lends no
    pool host."""
    hosts = tuple(Host(f"h{i}", BOTH, mode="train", target="train", epoch=1) for i in range(n_pool))
    hosts += (Host("h9", BOTH, mode="rollout", target="rollout", epoch=1),)
    speed = DecodeSpeed(a, b)
    offer = Offer(turns, n_pool, expected, speed, 64, 0.0, rule)
    s = Snapshot("seamless", 1000.0, hosts, Trainer("waiting", needed), rate, Costs(lend_s, lend_s),
                 train_hosts=n_pool, offer=offer)
    window = needed / rate - 2 * lend_s
    share = min(64, -(-turns // n_pool))
    lent = {d.host for d in decide(s) if d.mode == "rollout"} & train_pool(s)
    if window <= 0 or turns == 0 or lent_offer(offer, 0.0, window, 0, share) == 0:
        assert not lent


class _Checked(Simulator):
    """The simulator, checking after every dispatch that no lent host with a free slot was left
    out while a queued turn it would take (shared/lending.py, as the dispatch asks it) waits."""

    def _dispatch(self, t0, freed_h, freed_t):
        super()._dispatch(t0, freed_h, freed_t)
        q = np.nonzero((self.s_state == QUEUED) & (self.s_ready <= self.t))[0]
        rolling = (self.mode == 1) & (self.target == 1)
        lent = rolling & (self.lent_until > 0) & (self.K - self.k_run > 0)
        if not len(q) or not lent.any():
            return
        free = np.where(lent, self.K - self.k_run, 0)
        offered = self._lent_free(free, lent, float(self.s_ctx[q].mean()))
        assert not offered[lent].any(), (self.t, offered[lent])
        self.checked += 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), split=st.integers(1, 3), groups=st.sampled_from([8, 24, 48]),
       rule=st.sampled_from(["fit", "migrate"]), sigma=st.floats(0.2, 1.5))
def test_a_lent_host_is_always_offered_work_when_any_fits(seed, split, groups, rule, sigma):
    wl = Workload(group_size=4, groups_per_step=groups, prompt_tokens=64, length_median=200, length_sigma=sigma,
                  length_cap=2000, max_staleness=1)
    sim = _Checked(Cluster.uniform(4, split), CALIBRATIONS["live-mini"], wl, "seamless",
                   Options(steps=5, seed=seed, lent_rule=rule))
    sim.checked = 0
    r = sim.run()
    assert abs(r.unaccounted_generated) < 1e-6 * max(r.generated, 1)
