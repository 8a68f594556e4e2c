"""sf.traj.completed (JetStream TRAJECTORIES): finished, rewarded trajectories for the trainer."""

from __future__ import annotations

from typing import Any

import msgspec


class Sample(msgspec.Struct, array_like=True, omit_defaults=True):
    """One token-exact path through a session's turn tree.

    All per-token lists have the same length. `loss_mask[i]` is 1 exactly when
    the model sampled token i; `logprobs[i]` is its behaviour logprob (0.0 where
    the mask is 0); `versions[i]` is the policy version that sampled it (-1
    where the mask is 0).
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    messages: list[dict[str, Any]] = []  # the OpenAI messages this path renders, reply included
    turn_ids: list[int] = []  # the session turns along this path, root first


class TrajectoryCompleted(msgspec.Struct, tag=True, omit_defaults=True):
    session_id: str
    group_id: str
    reward: float
    samples: list[Sample]
    metadata: dict[str, Any] = {}
    finished_at: float = 0.0
    policy_version: int = -1  # the newest published version when the session finished
    staleness: int = 0  # policy_version minus the oldest version that generated a token here
