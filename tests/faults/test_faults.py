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


def run_case(stack: FaultStack, inject: Callable[[], Fault], seed: int, before: float = 1.0,
             after: float = 1.0, hang_limit: float = HANG_LIMIT) -> tuple[FaultAgents, dict]:
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


def test_redis_restart_with_aof_loses_nothing_acknowledged(stack):
    agents, _ = run_case(stack, lambda: stack.kill_and_restart("redis", down_s=0.5), seed=4)
    # every session whose creation was acknowledged is still there, with every acknowledged turn
    # (the invariants checked the finished ones turn by turn)
    lost = [s.id for s in agents.sessions if _get_session(stack, s.id).status_code != 200]
    assert not lost, f"sessions lost with the Redis restart: {lost[:5]}"


def test_nats_restart_keeps_streams_and_durable_consumers(stack):
    before = stack.stream_state()
    agents, _ = run_case(stack, lambda: stack.kill_and_restart("nats", signal.SIGTERM, down_s=1.0), seed=5)
    after = stack.stream_state()
    assert after["streams"] >= before["streams"], (before, after)
    assert after["last_seq"] >= before["last_seq"] and after["ack_floor"] >= before["ack_floor"], (before, after)
    assert after["consumer"] == before["consumer"] == "trainer"


def test_trainer_sigkill_between_checkpoint_and_publish(stack):
    def inject():
        checkpoints = _events(stack, "checkpoint")
        wait_for(lambda: _events(stack, "checkpoint") > checkpoints, 30, "the trainer's next checkpoint", every=0.01)
        return stack.kill_and_restart("trainer")

    run_case(stack, inject, seed=6)
    records = stack.audit()
    resumes = [r for r in records if r["event"] == "resume"]
    assert len(resumes) >= 2  # the start, and the restart (from the checkpoint it was killed after)
    versions = [r["version"] for r in records if r["event"] == "step"]
    published = [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
    assert published == sorted(set(published)), f"a version was published twice: {published}"


def test_replica_paused_past_its_lease_never_writes_a_request_taken_over(stack):
    run_case(stack, lambda: stack.pause("trajectory-0", 8.0), seed=7)
    assert "re-sending" in stack.log("gateway")


def _get_session(stack, sid: str):
    import httpx

    return httpx.get(f"{stack.gateway_url}/sessions/{sid}", headers={"Authorization": f"Bearer {stack.api_key}"},
                     timeout=10)


def _events(stack, event: str) -> int:
    return sum(r["event"] == event for r in stack.audit())
