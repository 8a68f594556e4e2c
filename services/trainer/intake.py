"""From deliveries to global batches, and from checkpoints to acks: pure, no I/O.

Owns the rank-0 bookkeeping between the JetStream consumer and the steps:
- checking a decoded trajectory before it can reach a step (a bad one would crash
  every rank mid-step, so it is refused at the door and terminated instead);
- the exactly-once verdict of each delivery (`ledger.Ledger`) and what to do with
  the message: train it, hold it, or ack it now;
- the messages held unacked until a checkpoint covers them, including
  redeliveries and duplicate publishes of a trajectory already held;
- group completeness (`batching.GroupCollector`) and the timeout that drops a
  group whose missing members never come.

Messages are opaque handles here: the caller (service.py) acks, naks, terminates
and keeps them alive. It does not know NATS, DeepSpeed or tensors.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

from services.trainer.batching import Group, GroupCollector, trajectory_id, validate_sample
from services.trainer.ledger import Ledger, Verdict
from shared.adapters import role_of
from shared.messages.trajectory import TrajectoryCompleted

Msg = Any  # a delivery handle (nats Msg in the service, anything in tests)


class Action(enum.Enum):
    TRAIN = "train"  # new: buffered towards a group; held until a checkpoint covers it
    HOLD = "hold"  # a redelivery or duplicate of something held: acked together with it
    ACK = "ack"  # already covered by a checkpoint: ack now, do not train


def check_trajectory(traj: TrajectoryCompleted, vocab_size: int, roles: tuple[str, ...] = ()) -> None:
    """Raise ValueError if a step could not train `traj` (the message is then terminated).
    With multi-LoRA `roles`, its session must have named one of them (metadata "role")."""
    if not traj.session_id or not traj.group_id:
        raise ValueError("empty session_id or group_id")
    if roles and role_of(traj.metadata) not in roles:
        raise ValueError(f"session role {role_of(traj.metadata)!r} has no adapter (SF_TRAINER_LORA_ROLES="
                         f"{','.join(roles)}; a session names its role in its metadata, key \"role\")")
    if not traj.samples:
        raise ValueError("no samples")
    if traj.reward != traj.reward or traj.reward in (float("inf"), float("-inf")):
        raise ValueError(f"reward is not finite: {traj.reward}")
    for s in traj.samples:
        validate_sample(s)
        bad = [t for t in s.token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary of {vocab_size}: {bad[:5]}")


class Intake:
    def __init__(self, group_size: int, ledger: Ledger | None = None):
        self.ledger = ledger or Ledger()
        self.collector = GroupCollector(group_size)
        self._held: dict[str, list[Msg]] = {}  # trajectory id -> its deliveries not acked yet
        self._group_of: dict[str, str] = {}  # buffered (not yet taken) trajectory id -> group id
        self._first_seen: dict[str, float] = {}  # open group id -> when its first member arrived
        self.duplicates = 0  # deliveries held or acked without training (redeliveries, re-publishes)

    # 1. deliveries in
    def offer(self, traj: TrajectoryCompleted, msg: Msg, now: float) -> Action:
        tid = trajectory_id(traj)
        match self.ledger.admit(tid):
            case Verdict.DONE:
                self.duplicates += 1
                return Action.ACK
            case Verdict.IN_FLIGHT:
                self.duplicates += 1
                self._held.setdefault(tid, []).append(msg)
                return Action.HOLD
            case Verdict.NEW:
                self._held.setdefault(tid, []).append(msg)
                self._group_of[tid] = traj.group_id
                self._first_seen.setdefault(traj.group_id, now)
                self.collector.add(traj)
                if traj.group_id not in self.collector.pending():  # the group just completed
                    self._first_seen.pop(traj.group_id, None)
                return Action.TRAIN
        raise AssertionError("unreachable")

    def ready_groups(self) -> int:
        return self.collector.ready_groups()

    def open_groups(self) -> int:
        """Groups with some but not all of their trajectories."""
        return len(self.collector.pending())

    def buffered_samples(self) -> int:
        """Trajectories buffered and not yet taken into a batch, complete groups or not."""
        return len(self._group_of)

    def take(self, n: int) -> list[Group] | None:
        """The next global batch of `n` complete groups, or None while fewer are ready."""
        groups = self.collector.take(n)
        for g in groups or []:
            for t in g:
                self._group_of.pop(trajectory_id(t), None)
        return groups

    # 2. steps and checkpoints
    def trained(self, ids: Iterable[str], step: int) -> None:
        self.ledger.trained(ids, step)

    def snapshot(self, step: int) -> dict:
        return self.ledger.snapshot(step)

    def committed(self, step: int) -> list[Msg]:
        """The checkpoint of `step` is durable: every delivery of the ids it covers may be acked now."""
        out: list[Msg] = []
        for tid in self.ledger.commit(step):
            out.extend(self._held.pop(tid, []))
        return out

    # 3. housekeeping
    def held(self) -> list[Msg]:
        """Every delivery not acked yet (to keep alive with in_progress)."""
        return [m for msgs in self._held.values() for m in msgs]

    def expire(self, now: float, timeout: float) -> tuple[list[str], list[Msg]]:
        """Drop groups that stayed incomplete for `timeout` seconds: (their group ids, messages to terminate)."""
        if timeout <= 0:
            return [], []
        old = [gid for gid, t in self._first_seen.items() if now - t >= timeout]
        msgs: list[Msg] = []
        for gid in old:
            del self._first_seen[gid]
            ids = [trajectory_id(t) for t in self.collector.evict(gid)]
            self.ledger.release(ids)
            for tid in ids:
                self._group_of.pop(tid, None)
                msgs.extend(self._held.pop(tid, []))
        return old, msgs

    def untrained(self) -> list[Msg]:
        """On shutdown: deliveries of trajectories no step trained (to nak, so they come back at once)."""
        return [m for tid, msgs in self._held.items() if tid in self._group_of for m in msgs]

    def counts(self) -> dict[str, int]:
        return {**self.ledger.counts(), "held_msgs": sum(len(v) for v in self._held.values()),
                "open_groups": self.open_groups(), "ready_groups": self.ready_groups(),
                "duplicates": self.duplicates}
