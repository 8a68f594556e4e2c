"""The scheduler's Prometheus gauges, beside the bus counters on the same registry (pure of NATS).

    sf_scheduler_rate{what="sessions_per_s"|"groups_per_s"|"samples_needed"|"predicted_wait_s"|
                      "lend_s"|"reclaim_s"|"lent_idle_hosts"|"lent_idle_host_s"}   Registry.rates()
    sf_scheduler_switches{what="lends"|"reclaims"|"failed_switches"|...}   Registry.counts
    sf_scheduler_host_activity{host, activity}   1 for what each host does now (train/rollout/switch/idle)

`lent_idle_hosts` is the defect a lend must not have: a train host lent to rollout whose
worker generated nothing since its previous heartbeat; `lent_idle_host_s` adds up the
host-seconds of it since the scheduler started. It knows nothing about how the
figures are made: registry.py computes them, service.py calls `update` every tick.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Gauge

ACTIVITIES = ("train", "rollout", "switch", "idle")


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.rate = Gauge("sf_scheduler_rate", "The scheduler's measured rates and predictions", ["what"],
                          registry=registry)
        self.switches = Gauge("sf_scheduler_switches", "Switches and gates since the scheduler started", ["what"],
                              registry=registry)
        self.activity = Gauge("sf_scheduler_host_activity", "1 for what each host does now", ["host", "activity"],
                              registry=registry)

    def update(self, rates: dict[str, float], counts: dict[str, int], activity: dict[str, str]) -> None:
        for what, v in rates.items():
            self.rate.labels(what).set(v if math.isfinite(v) else -1.0)  # an unbounded wait reads -1
        for what, n in counts.items():
            self.switches.labels(what).set(n)
        for host, now in activity.items():
            for a in ACTIVITIES:
                self.activity.labels(host, a).set(1.0 if a == now else 0.0)
