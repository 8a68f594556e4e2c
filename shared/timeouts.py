"""Timing contract between services: heartbeat cadence and the timeouts that must nest.

Each service's config takes its default from here, so the values that depend on one another
are written once. The nesting rule: an outer component waits longer than the inner one it
calls, so the inner one times out first and reports the real cause (no worker, a worker that
went silent and was replaced) instead of the outer one answering a bare 504.

    agent ── gateway ──────────► trajectory manager ──────────────────────────► rollout worker
             AGENT_FIRST_TOKEN   WORKER_WAIT + WORKER_RECEIPT + WORKER_FIRST_REPLY
             AGENT_IDLE          WORKER_IDLE

WORKER_RECEIPT is the one wait that is short: a worker answers a Generate at once, before any
token (a receipt, `Generate.receipt`), so a Generate that core NATS dropped (at most once, as while
the worker's subscription moves between cluster members) is re-dispatched after seconds, not after
WORKER_FIRST_REPLY, which stays sized for vLLM's warm-up and counts from the receipt.

tests/unit/test_shared_timeouts.py asserts the nesting on the configs' defaults.
"""

from __future__ import annotations

# A rollout worker publishes its WorkerStatus this often ...
HEARTBEAT_INTERVAL = 1.0
# ... and a listener counts it gone after this long without one (a few missed beats).
HEARTBEAT_STALE_AFTER = 5.0

# trajectory manager -> rollout worker
WORKER_WAIT = 30.0  # a request waits this long for any serving worker
# a worker's receipt of a Generate (its first reply, sent before any token): as long as a worker's silence
# takes to mean death (HEARTBEAT_STALE_AFTER), so a lost Generate is noticed as soon as a dead worker is;
# far above a receipt's round trip (milliseconds) even on a loaded box
WORKER_RECEIPT = 5.0
WORKER_FIRST_REPLY = 120.0  # a worker's first token after its receipt (vLLM warms up on first use)
WORKER_IDLE = 60.0  # between two replies of one generation

# gateway -> trajectory manager (generated text, not keepalives)
AGENT_FIRST_TOKEN = 180.0  # > WORKER_WAIT + WORKER_RECEIPT + WORKER_FIRST_REPLY
AGENT_IDLE = 90.0  # > WORKER_IDLE
