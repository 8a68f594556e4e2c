"""Trajectory manager settings, from SF_TRAJECTORY_* (connections from SF_NATS_*/SF_REDIS_*)."""

from __future__ import annotations

import msgspec


class TrajectoryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str = ""  # HF dir with the tokenizer and chat template (the one the workers serve)
    max_model_len: int = 2048
    worker_wait: float = 30.0  # how long a request waits for any serving rollout worker
    first_token_timeout: float = 120.0  # a worker's first reply (vLLM warms up on first use)
    token_timeout: float = 60.0  # between replies of one generation
    resume_wait: float = 600.0  # a re-sent request waits this long for the replica still serving it
    max_redispatch: int = 8  # re-dispatches of one request after preemptions
    worker_stale_after: float = 5.0  # heartbeats older than this mark a worker gone
    session_ttl: int = 7 * 24 * 3600  # seconds a session's keys live in Redis
    max_staleness: int = -1  # policy versions; -1 = no admission control
    batch_samples: int = 32  # samples the trainer consumes per version (for admission)
    open_session_timeout: float = 3600.0  # an open session older than this no longer counts
    trainer_consumer: str = "trainer"  # durable JetStream consumer whose backlog counts as untrained
