"""Trajectory manager settings, from SF_TRAJECTORY_* (connections from SF_NATS_*/SF_REDIS_*)."""

from __future__ import annotations

import msgspec

from shared import subjects, timeouts


class TrajectoryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str = ""  # HF dir with the tokenizer and chat template (the one the workers serve)
    max_model_len: int = 2048
    worker_wait: float = timeouts.WORKER_WAIT  # how long a request waits for any serving rollout worker
    # a worker that begins serving (a lend) takes a share of the requests running on busier workers
    # (routing.WorkerTable.moves): they move with their partial tokens
    rebalance: bool = True
    # ... but only the requests that shared/lending.py `move_worth` says finish sooner, within the rest of the
    # lend, by more than their re-prefill costs (routing.WorkerTable.moves); False: the whole share, youngest first
    rebalance_worth: bool = True
    # a worker's receipt of a Generate, before any token (shared/messages/rollout.py): without one, the Generate
    # was lost (core NATS is at most once) and is re-dispatched; 0 = ask for none (wait first_token_timeout)
    receipt_timeout: float = timeouts.WORKER_RECEIPT
    first_token_timeout: float = timeouts.WORKER_FIRST_REPLY  # a worker's first token (vLLM warms up on first use)
    token_timeout: float = timeouts.WORKER_IDLE  # between replies of one generation
    resume_wait: float = 600.0  # a re-sent request waits this long for the replica still serving it
    max_redispatch: int = 8  # re-dispatches of one request after preemptions
    worker_stale_after: float = timeouts.HEARTBEAT_STALE_AFTER  # heartbeats older than this mark a worker gone
    session_ttl: int = 7 * 24 * 3600  # seconds a session's keys live in Redis
    max_staleness: int = -1  # policy versions; -1 = no admission control
    open_session_timeout: float = 3600.0  # an open session older than this no longer counts
    # the trainer's durable consumer: its backlog counts as untrained, and its metadata says how many
    # sessions the trainer consumes per policy version (admission control)
    trainer_consumer: str = subjects.TRAINER_DURABLE
    # a finish retries publishing this long while the stream is full, then answers 503 + Retry-After
    # (the publication goes on in the background); below the gateway's session timeout
    publish_wait: float = 5.0
    fill_poll: float = 1.0  # seconds between readings of the stream's fill, trims and sweeps of pending finishes
    # render the whole history through the chat template at every turn too, and use it (the default
    # checks each shape of conversation once, then renders only the end of the history)
    full_render_check: bool = False
    # a turn whose agent does not stream: its worker sends tokens at most this often (seconds), merged, so a
    # long reply costs a message per hold instead of one per token at each end (shared/deltas.Held). The price:
    # a stop string is seen up to this much later (the worker generates on meanwhile; the extra is cut)
    plain_hold_s: float = 0.1
    # Redis replication (issue 30, docs/reliability.md): a turn's save and a finish's stored event WAIT for
    # this many replicas, up to redis_wait_ms, before the turn or finish is acknowledged; 0 = no WAIT
    redis_wait_replicas: int = 0
    redis_wait_ms: int = 100
    # Prometheus /metrics (sf_bus_malformed_total); 0 = off (replicas on one machine need a port each)
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
