"""The scheduler: capability-tagged hosts, placement policies, lending and reclaiming.

    python -m services.scheduler                  # one per cluster (SF_SCHEDULER_*)
    python -m services.scheduler.host             # one host agent per host (SF_HOST_*)

Modules, from the wire inwards:
    service.py    the scheduler's NATS wiring (the only module touching NATS): heartbeats in,
                  HostAssignment out on the HOSTS stream, the trainer's gate, operator control
    host.py       the host agent: keeps the host's rollout worker resident (restarts it if it
                  crashes), applies assignments step by step, reports HostModeChanged
    registry.py   the cluster as the scheduler sees it: hosts, health, switch costs, timelines (pure)
    policy.py     colocated / disaggregated / seamless as one pure function, Snapshot -> Decisions;
                  predicted lending; the gate; the steps of a host transition
    store.py      the registry in Redis (the only module touching Redis)
    config.py     SF_SCHEDULER_* and SF_HOST_* settings
    sim/          a SIMULATED cluster driving policy.py, for benchmarks and planning (never run here)

It knows nothing about tokens or trajectories: it moves hosts between modes, and the
partial rollout of the data plane makes those moves invisible to agents.
"""
