"""sf.sched.* and sf.trainer.*: tag scheduling of hosts between training and rollout.

A *host* is one machine or one accelerator group with capability tags (`train`,
`rollout`, hardware such as `cpu` or `gpu:h100`) and a capacity weight. One host agent
per host applies the scheduler's `HostAssignment`s to that host's resident rollout worker
and, on a `train` host, to the trainer rank placed there; it answers each with
`HostModeChanged`. Every assignment carries a per-host epoch: an agent ignores one whose
epoch is not newer than the last it applied, so a redelivered, older assignment is harmless.

The trainer reports `TrainerStatus` heartbeats and, once a batch is ready, asks the
scheduler's gate (`TrainGate`) whether its hosts are reclaimed before it computes.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# What a host is doing, as the scheduler assigns it:
#   rollout  its worker serves (lent, when the host is also tagged `train`)
#   train    its worker is vacated (or held, see HostAssignment.hold) and asleep; the trainer rank may compute
#   idle     its worker is vacated and asleep; nothing runs (cordoned, unhealthy, or a bubble by policy)
HostMode = Literal["rollout", "train", "idle"]
# What a host's time was spent on, for timelines (idle fraction is measured from these):
#   switch   between an assignment and its HostModeChanged
#   train    in train mode while the trainer computes or publishes
#   rollout  in rollout mode with at least one request running
#   idle     anything else: a bubble
Activity = Literal["train", "rollout", "switch", "idle"]
PolicyName = Literal["colocated", "disaggregated", "seamless"]
TrainerState = Literal["waiting", "ready", "computing", "publishing", "stopped"]


class HostHeartbeat(msgspec.Struct, tag=True, omit_defaults=True):
    """Event: a host agent is alive; published every `SF_HOST_HEARTBEAT` seconds."""

    host: str
    tags: list[str]
    capacity: float
    mode: HostMode  # the mode it last applied
    epoch: int  # the epoch of the assignment it last applied (0: none yet)
    ts: float
    worker_id: str = ""  # its resident rollout worker ("" on a train-only host)
    cores: str = ""  # the CPU cores (or devices) it owns, for display
    switching: bool = False  # applying an assignment right now
    restarts: int = 0  # times its rollout worker was restarted
    ready: bool = True  # its rollout worker is up (heartbeating); a host is not placed until it is


class HostAssignment(msgspec.Struct, tag=True, omit_defaults=True):
    """Command: put `host` in `mode`. Last value per host on the JetStream HOSTS stream.

    - to `rollout` (a lend): load weights `version` from `path` if the worker is older, then
      wake and resume; a lent host never serves an old version.
    - to `train`/`idle` (a reclaim): vacate the worker, so its requests migrate with their
      partial tokens, then put it to sleep; with `hold`, pause it in keep mode instead
      (colocated: in-flight requests wait on the host for the train phase to end).
    """

    host: str
    mode: HostMode
    epoch: int
    reason: str = ""
    version: int = -1  # the newest published weight version when issued; -1 = none yet
    path: str = ""
    hold: bool = False
    issued_at: float = 0.0
    lent_until: float = 0.0  # to rollout: when the scheduler expects to reclaim it (0 = not lent)


class HostModeChanged(msgspec.Struct, tag=True, omit_defaults=True):
    """Event: a host agent finished applying assignment `epoch` (or failed to)."""

    host: str
    mode: HostMode
    epoch: int
    t_start: float  # wall clock, when the agent began applying it
    t_end: float
    ok: bool = True
    error: str = ""
    migrated: int = 0  # requests the reclaim vacated (they continue on other workers)


class TrainerStatus(msgspec.Struct, tag=True, omit_defaults=True):
    """Event: the trainer's heartbeat (rank 0), every second and at each state change."""

    state: TrainerState
    step: int
    version: int
    ready_groups: int  # complete groups buffered
    open_groups: int  # groups with some but not all of their trajectories
    buffered_samples: int  # trajectories buffered, complete groups or not
    groups_per_step: int
    group_size: int
    last_wait_s: float
    last_compute_s: float
    ts: float
    hosts: list[str] = []  # hosts its ranks run on (each rank's SF_TRAINER_HOST / SF_HOST_ID), in rank order
    offloaded: list[str] = []  # hosts whose ranks are offloaded now (lent to rollout)


class TrainGate(msgspec.Struct, tag=True, omit_defaults=True):
    """Command (request/reply on sf.sched.gate): a batch is ready; reclaim the trainer's hosts.

    The scheduler answers `TrainGateReply` once every host the policy puts in train mode
    has applied it, or with `granted=False` after `timeout` seconds. The trainer logs a
    refusal or a missing scheduler and computes anyway: the gate never stalls training."""

    step: int
    timeout: float
    hosts: list[str] = []


class TrainGateReply(msgspec.Struct, tag=True, omit_defaults=True):
    granted: bool
    waited_s: float = 0.0
    reason: str = ""


SchedulerOp = Literal["status", "set_policy", "cordon", "uncordon", "timeline"]


class SchedulerControl(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    """Command (request/reply on sf.sched.ctl): the operator's handle on the scheduler."""

    op: SchedulerOp
    host: str = ""  # cordon / uncordon
    policy: str = ""  # set_policy


class Interval(msgspec.Struct, array_like=True):
    activity: Activity
    t_start: float
    t_end: float


def fractions(intervals: list[Interval], t0: float = 0.0, t1: float = float("inf")) -> dict[str, float]:
    """Share of [t0, t1] (clipped to the intervals) spent on each activity."""
    spent: dict[str, float] = {"train": 0.0, "rollout": 0.0, "switch": 0.0, "idle": 0.0}
    for iv in intervals:
        a, b = max(iv.t_start, t0), min(iv.t_end, t1)
        if b > a:
            spent[iv.activity] += b - a
    total = sum(spent.values())
    return {k: (v / total if total else 0.0) for k, v in spent.items()}


class HostInfo(msgspec.Struct, omit_defaults=True):
    host: str
    tags: list[str]
    capacity: float
    mode: HostMode
    target: HostMode  # == mode unless a switch is under way
    epoch: int
    healthy: bool
    cordoned: bool
    last_seen: float
    worker_id: str = ""
    activity: str = ""
    timeline: list[Interval] = []  # only for op "timeline"


class SchedulerReply(msgspec.Struct, omit_defaults=True):
    ok: bool
    policy: str = ""
    hosts: list[HostInfo] = []
    error: str = ""
    counts: dict[str, int] = {}  # lends, reclaims, gate waits, ...
    # sessions_per_s, groups_per_s (completion rates), samples_needed, predicted_wait_s, lend_s, reclaim_s, ...
    rates: dict[str, float] = {}


TrainerOp = Literal["offload", "reload"]


class TrainerControl(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    """Command (request/reply on sf.trainer.ctl): free or restore the trainer's device memory
    while its host is lent to rollout (DeepSpeed offload_states / reload_states on GPU; timed
    no-ops on CPU). The reply is a TrainerStatus."""

    op: TrainerOp
    host: str = ""


class SchedulerLeader(msgspec.Struct, tag=True, omit_defaults=True):
    """The leading scheduler's term, on `sf.sched.leader` when it takes the lead and every second after
    (services/scheduler/leader.py). A host agent ignores an assignment of an older term: a deposed
    leader's late assignment (an assignment's epoch carries its term in the bits above 32)."""

    term: int
    instance: str = ""
    at: float = 0.0
