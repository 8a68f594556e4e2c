"""The whole system under faults: one stack (gateway, 2 trajectory replicas, 2 SIMULATED rollout
workers, the SIMULATED trainer, NATS with the JetStream file store, Redis with AOF; harness.py),
16 openai-SDK agents in flight, one fault injected mid-run per case, and the three invariants of
invariants.py checked at the end. Each case leaves the stack whole (what it killed is running
again), so the cases share it, in order. docs/reliability.md lists what each case proves.

    .venv/bin/python -m pytest tests/faults
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from tests.faults.agents import FaultAgents
from tests.faults.harness import Fault, FaultStack, wait_for
from tests.faults.invariants import check

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

AGENTS = 16
# the gateway re-sends a silent turn after 5 s, twice (SF_GATEWAY_SILENCE_TIMEOUT, _RESEND_ATTEMPTS):
# a turn caught by a fault ends within 3 x 5 s of silence, plus its own generation
HANG_LIMIT = 25.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = FaultStack(tmp_path_factory.mktemp("faults"), tiny_model).start()
    try:
        yield s
    finally:
        s.stop()


def run_case(stack: FaultStack, inject: Callable[[], Fault], seed: int, before: float = 2.0,
             after: float = 3.0, hang_limit: float = HANG_LIMIT) -> tuple[FaultAgents, dict]:
    """Agents in flight; `inject` once they have made progress; more turns after it; the invariants."""
    agents = FaultAgents(stack.gateway_url, stack.api_key, agents=AGENTS, seed=seed).start()
    try:
        start = agents.succeeded()
        wait_for(lambda: agents.succeeded() >= start + AGENTS, 30, "agents under way")
        time.sleep(before)
        fault = inject()
        done = agents.succeeded()
        wait_for(lambda: agents.succeeded() >= done + AGENTS, 40, "agents making progress after the fault")
        time.sleep(after)
    finally:
        agents.stop()
    summary = check(stack, agents, [fault], hang_limit)
    print(f"{fault.name}: { {k: v for k, v in summary.items() if k != 'trajectories'} }")
    return agents, summary


def test_rollout_worker_sigkill_mid_generation(stack):
    _, summary = run_case(stack, lambda: stack.kill_and_restart("rollout-0"), seed=1)
    # it was mid-generation: some turn has tokens from the killed worker, then from another one
    workers = [[s["worker_id"] for s in turn["segments"]] for t in summary["trajectories"].values()
               for turn in t["turns"]]
    assert [w for w in workers if w[0] == "rollout-0" and len(w) > 1], workers


def test_trajectory_replica_sigkill_mid_request(stack):
    run_case(stack, lambda: stack.kill_and_restart("trajectory-0"), seed=2)
    assert "re-sending" in stack.log("gateway")


def test_gateway_restart_sessions_continue_with_the_same_key(stack):
    agents, _ = run_case(stack, lambda: stack.kill_and_restart("gateway", signal.SIGKILL, unreachable=True), seed=3)
    fault = stack.faults[-1]
    across = [s for s in agents.finished if s.turns[0].t1 < fault.t0 and s.turns[-1].t0 > fault.t1]
    assert across, "no session had a turn before the restart and one after it, with the same key"
