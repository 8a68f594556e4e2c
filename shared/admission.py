"""Staleness admission control (pure): the trajectory manager enforces it on session
creation, and the scheduler's simulator (services/scheduler/sim/simulator.py) applies the same rule
in virtual time, so both import it from here.

With `max_staleness = k`, a sample may be trained at most k policy versions after the
oldest token in it was generated. The trainer trains `per_version` sessions (one
TrajectoryCompleted each) per published version, and says how many in its consumer's
metadata (shared/subjects.py: trainer_consumer). Anything admitted now is trained within k
versions only if fewer than (k + 1) * per_version sessions are ahead of it: open sessions
plus completed ones the trainer has not trained yet (not delivered to it, or delivered and held
in complete groups or in the batch it is training: `held_by_trainer`). New sessions wait (HTTP 429) beyond
that. k < 0 turns admission control off. When the backlog cannot be read, nothing is
admitted (HTTP 503): failing open would break the bound exactly when the trainer is in
trouble.
"""

from __future__ import annotations

from dataclasses import dataclass


class BacklogUnknown(RuntimeError):
    """The trainer's backlog or batch size could not be read; admission refuses (503)."""


@dataclass(frozen=True)
class Backlog:
    untrained: int  # completed sessions the trainer has not taken yet
    per_version: int  # sessions the trainer trains per published version


@dataclass(frozen=True)
class Admission:
    max_staleness: int

    @property
    def enabled(self) -> bool:
        return self.max_staleness >= 0

    def capacity(self, per_version: int) -> int:
        return (self.max_staleness + 1) * per_version

    def admit(self, open_sessions: int, backlog: Backlog) -> bool:
        return not self.enabled or open_sessions + backlog.untrained < self.capacity(backlog.per_version)

    def refusal(self, open_sessions: int, backlog: Backlog) -> str:
        return (f"admission paused: {open_sessions} open sessions + {backlog.untrained} untrained ones reach "
                f"the staleness bound ({self.capacity(backlog.per_version)} = (max_staleness "
                f"{self.max_staleness} + 1) x {backlog.per_version} sessions per version); retry after the "
                f"trainer catches up")


# trainer states in which it holds a batch it has taken but not trained yet (shared/messages/scheduler.py)
BATCH_IN_HAND = ("ready", "computing", "publishing")


def held_by_trainer(ready_groups: int, group_size: int, groups_per_step: int, state: str) -> int:
    """Completed sessions the trainer has fetched but not trained (its TrainerStatus heartbeat): its
    complete groups waiting (it prefetches up to two steps' worth) and the batch in hand while it
    steps. The consumer's backlog no longer counts them, yet everything admitted now is trained
    after them; left out, they let rollout run a whole prefetch ahead of the bound (issue 26: at the
    demo's fast rounds, max_staleness 1 trained tokens 3-5 versions old). The finished members of
    incomplete groups are not counted: those groups complete only through sessions not admitted
    yet, so counting them could close admission for good."""
    in_hand = groups_per_step * group_size if state in BATCH_IN_HAND else 0
    return ready_groups * group_size + in_hand


def staleness(current_version: int, token_versions: list[int]) -> int:
    """Versions between the oldest generated token and the current policy (0 if fresh)."""
    generated = [v for v in token_versions if v >= 0]
    if not generated or current_version < 0:
        return 0
    return max(0, current_version - min(generated))
