"""Exactly-once accounting of trained trajectories: pure, no I/O.

Owns the answer to "may this delivery be trained, or only acked?" and the part
of the checkpoint that makes the answer survive a crash.

A trajectory id moves through three states:

    admit() -> IN_FLIGHT --trained(ids, step)--> PENDING(step) --commit(step)--> DONE

- IN_FLIGHT: buffered or being trained; not acked. A redelivery of it (ack_wait
  ran out) is neither trained again nor acked yet: the caller acks it together
  with the first delivery.
- PENDING(step): trained in `step`, but no durable checkpoint covers it yet. A
  crash now loses that step's weights too, so after restart the id is unknown
  and its redelivery is trained again: the resumed run trains it exactly once.
- DONE: a durable checkpoint covers it. Ack it; every later delivery is acked
  and skipped.

The checkpoint saved after step S stores `snapshot(S)` (DONE plus PENDING up to
S); once that save is durable the caller calls `commit(S)` and acks the ids it
returns. `prune` bounds memory: ids whose acks were confirmed long ago can no
longer be redelivered by JetStream.

It does not know NATS messages, DeepSpeed or what is inside a trajectory.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class Verdict(enum.Enum):
    NEW = "new"  # train it
    IN_FLIGHT = "in_flight"  # a redelivery of something not yet committed: hold, ack with the original
    DONE = "done"  # covered by a checkpoint: ack and skip


class Ledger:
    def __init__(self) -> None:
        self._done: dict[str, int] = {}  # id -> step that trained it, covered by a durable checkpoint
        self._pending: dict[str, int] = {}  # id -> step that trained it, not yet checkpointed
        self._in_flight: set[str] = set()
        self.committed_step = -1
        self.skipped = 0  # redeliveries acked and skipped since start

    # 1. deliveries in
    def admit(self, tid: str) -> Verdict:
        if tid in self._done:
            self.skipped += 1
            return Verdict.DONE
        if tid in self._in_flight or tid in self._pending:
            return Verdict.IN_FLIGHT
        self._in_flight.add(tid)
        return Verdict.NEW

    def release(self, ids: Iterable[str]) -> None:
        """Give up on in-flight ids without training them (e.g. an evicted group); a redelivery is NEW again."""
        for tid in ids:
            self._in_flight.discard(tid)

    # 2. a step trained these ids
    def trained(self, ids: Iterable[str], step: int) -> None:
        if step <= self.committed_step:
            raise ValueError(f"step {step} is not after the committed step {self.committed_step}")
        ids = list(ids)
        missing = [t for t in ids if t not in self._in_flight]
        if missing:
            raise ValueError(f"trained ids that were not admitted (or trained twice): {missing[:5]}")
        for tid in ids:
            self._in_flight.discard(tid)
            self._pending[tid] = step

    # 3. checkpoints
    def snapshot(self, step: int) -> dict:
        """What a checkpoint taken after `step` must hold (JSON- and torch.save-friendly)."""
        by_step: dict[str, list[str]] = {}
        for source in (self._done, self._pending):
            for tid, s in source.items():
                if s <= step:
                    by_step.setdefault(str(s), []).append(tid)
        return {"committed_step": step, "trained": {k: sorted(v) for k, v in sorted(by_step.items(), key=_num)}}

    def commit(self, step: int) -> list[str]:
        """The checkpoint of `step` is durable: its ids become DONE. Returns the ids that may now be acked."""
        now_done = [tid for tid, s in self._pending.items() if s <= step]
        for tid in now_done:
            self._done[tid] = self._pending.pop(tid)
        self.committed_step = max(self.committed_step, step)
        return now_done

    @classmethod
    def restore(cls, state: dict | None) -> "Ledger":
        """The ledger as of a checkpoint; everything after it is forgotten, so its redeliveries train again."""
        ledger = cls()
        if not state:
            return ledger
        for step, ids in state.get("trained", {}).items():
            for tid in ids:
                ledger._done[tid] = int(step)
        ledger.committed_step = int(state.get("committed_step", -1))
        return ledger

    def prune(self, before_step: int) -> int:
        """Forget DONE ids trained before `before_step` (their acks are long confirmed); returns how many."""
        old = [tid for tid, s in self._done.items() if s < before_step]
        for tid in old:
            del self._done[tid]
        return len(old)

    # introspection
    def is_done(self, tid: str) -> bool:
        return tid in self._done

    def counts(self) -> dict[str, int]:
        return {"done": len(self._done), "pending": len(self._pending), "in_flight": len(self._in_flight),
                "skipped": self.skipped}


def _num(item: tuple[str, list[str]]) -> int:
    return int(item[0])
