"""Staleness admission control (pure).

With `max_staleness = k`, a sample may be trained at most k policy versions after the
oldest token in it was generated. The trainer consumes `batch_samples` samples per
version, so anything admitted now is trained within k versions only if fewer than
(k + 1) * batch_samples samples are ahead of it: open sessions plus completed ones the
trainer has not consumed yet. New sessions wait (HTTP 429) beyond that. k < 0 turns
admission control off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    max_staleness: int
    batch_samples: int

    @property
    def capacity(self) -> int | None:
        if self.max_staleness < 0:
            return None
        return (self.max_staleness + 1) * self.batch_samples

    def admit(self, open_sessions: int, untrained: int) -> bool:
        cap = self.capacity
        return cap is None or open_sessions + untrained < cap

    def refusal(self, open_sessions: int, untrained: int) -> str:
        return (f"admission paused: {open_sessions} open sessions + {untrained} untrained samples reach the "
                f"staleness bound ({self.capacity} = (max_staleness {self.max_staleness} + 1) x "
                f"{self.batch_samples} samples per version); retry after the trainer catches up")


def staleness(current_version: int, token_versions: list[int]) -> int:
    """Versions between the oldest generated token and the current policy (0 if fresh)."""
    generated = [v for v in token_versions if v >= 0]
    if not generated or current_version < 0:
        return 0
    return max(0, current_version - min(generated))
