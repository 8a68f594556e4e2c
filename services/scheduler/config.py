"""Scheduler and host-agent settings, from SF_SCHEDULER_* and SF_HOST_* (connections from SF_NATS_*/SF_REDIS_*).

    SF_SCHEDULER_POLICY=seamless python -m services.scheduler
    SF_HOST_ID=host-0 SF_HOST_TAGS=train,rollout,cpu SF_HOST_MODEL=var/model python -m services.scheduler.host

Defaults run on one laptop: a 0.2 s decision tick, hosts dead after HEARTBEAT_STALE_AFTER (5 s)
without a heartbeat, the staleness every heartbeat listener applies (shared/timeouts.py).
"""

from __future__ import annotations

import re

import msgspec

from shared.config import ConfigError, load
from shared.messages.scheduler import PolicyName
from shared.timeouts import HEARTBEAT_INTERVAL, HEARTBEAT_STALE_AFTER

_ID = re.compile(r"^[A-Za-z0-9_-]+$")


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    policy: PolicyName = "seamless"
    tick: float = 0.2  # seconds between decisions
    host_stale_after: float = HEARTBEAT_STALE_AFTER  # a host (or its serving worker) silent this long is dead
    switch_timeout: float = 60.0  # an assignment not applied within this is a failed switch
    lend_margin: float = 1.5  # lend only if the predicted wait > lend_margin x (lend + reclaim seconds)
    train_hosts: int = 0  # train pool size: the first N train-tagged hosts by id (0 = all)
    # re-prefill against trainer time (seamless; docs/capacity-planning.md, `seamlessflow plan` sweeps them):
    drain_margin_s: float = 0.0  # a lent host stops taking turns this long before its predicted reclaim
    reclaim_grace_s: float = 0.0  # batch ready: a lent host finishes its running turns for up to this long
    lend_settle_s: float = 30.0  # with a grace: lend only once the trainer has waited this long for data
    renew_s: float = 2.0  # while the trainer waits, a lent host stays open to turns at least this far ahead (0 = off)
    # lend only for work (registry.Registry.offer, as the simulator): off by default until a live A/B measures it.
    # On, a workload whose serving workers never queue beyond their slots lends nothing (the trainer waits on
    # the agents' pace, not on rollout capacity): tests/integration/test_scheduler_live.py's 4 sessions on 8 slots
    live_offer: bool = False
    # leader election (issue 30, leader.py): the lease a leading instance renews; a standby leads within
    # about this + 0.5 s of the leader's death
    lease_s: float = 3.0
    instance: str = ""  # this instance's name in the lease (default: host name and pid)
    lend_s: float = 1.0  # initial switch-cost estimates; measured switches replace them (running mean)
    reclaim_s: float = 1.0
    metrics_port: int = 0  # Prometheus /metrics (sf_bus_malformed_total); 0 = off
    metrics_host: str = "127.0.0.1"


class HostConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str = ""  # one NATS subject token
    tags: str = "rollout,cpu"  # comma-separated: roles (train, rollout) and hardware (cpu, gpu:h100, ...)
    capacity: float = 1.0
    cores: str = ""  # CPU cores for its rollout worker (VLLM_CPU_OMP_THREADS_BIND), e.g. "0" or "2-3"
    # the host's own CPU set ("0-1,4"): the agent pins itself there (os.sched_setaffinity), so its
    # worker and anything it starts run only there ("" = not pinned); `seamlessflow up --pin` sets it
    cpus: str = ""
    model: str = ""  # the checkpoint its resident rollout worker loads ("" = no worker even if tagged rollout)
    worker_id: str = ""  # "" = "<id>-rollout"
    trainer: bool = False  # a trainer rank runs on this host: offload/reload it around lends
    heartbeat: float = HEARTBEAT_INTERVAL  # seconds between HostHeartbeats
    step_timeout: float = 30.0  # seconds one control step (vacate, load, ...) may take
    worker_ready_timeout: float = 300.0  # seconds a (re)started worker has to send its first heartbeat
    restart_backoff_max: float = 30.0  # a crashed worker is restarted after 0.5 s, doubling up to this
    log_dir: str = ""  # where the worker's log goes ("" = inherit the agent's stdout)
    # benchmarks only: a command line run as the resident worker instead of `python -m services.rollout`
    # (e.g. `python -m services.rollout.simulated`); `--model MODEL --worker-id ID` are appended. "" = the real worker
    worker_cmd: str = ""
    metrics_port: int = 0  # Prometheus /metrics (sf_bus_malformed_total); 0 = off
    metrics_host: str = "127.0.0.1"

    def tag_list(self) -> list[str]:
        return [t.strip() for t in self.tags.split(",") if t.strip()]


def load_scheduler(**overrides) -> SchedulerConfig:
    return load(SchedulerConfig, "SF_SCHEDULER_", **overrides)


def load_host(**overrides) -> HostConfig:
    cfg = load(HostConfig, "SF_HOST_", **overrides)
    if not cfg.id or not _ID.match(cfg.id):
        raise ConfigError(f"SF_HOST_ID={cfg.id!r}: set one NATS subject token, [A-Za-z0-9_-]+")
    tags = cfg.tag_list()
    if not {"train", "rollout"} & set(tags):
        raise ConfigError(f"SF_HOST_TAGS={cfg.tags!r}: a host needs a role tag, train and/or rollout")
    if cfg.capacity <= 0:
        raise ConfigError("SF_HOST_CAPACITY must be > 0")
    try:
        parse_cpu_list(cfg.cpus)
    except ValueError as e:
        raise ConfigError(f"SF_HOST_CPUS={cfg.cpus!r}: {e} (write it as Linux does, e.g. 0-3,6)") from None
    if not cfg.worker_id:
        cfg = msgspec.structs.replace(cfg, worker_id=f"{cfg.id}-rollout")
    return cfg


def parse_cpu_list(text: str) -> set[int]:
    """"0-3,6" -> {0, 1, 2, 3, 6}; "" -> set(). ValueError on anything else."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(range(first, last + 1))
    return out
