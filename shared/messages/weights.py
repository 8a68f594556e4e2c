"""sf.weights.published (JetStream WEIGHTS, last value): a new policy version is on disk."""

from __future__ import annotations

import msgspec


class WeightsPublished(msgspec.Struct, tag=True, omit_defaults=True):
    version: int
    path: str  # an HF safetensors directory every rollout host can read
    published_at: float
    step: int = 0
