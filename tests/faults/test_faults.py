"""The whole system under faults: one stack (harness.py), 16 openai-SDK agents in flight, one
fault injected mid-run per case, and the three invariants of invariants.py checked at the end.
Each case leaves the stack whole (what it killed is running again), so the cases share it, in
order. docs/reliability.md lists what each case proves.

The stack: NATS (JetStream file store), Redis (AOF), the gateway, 2 trajectory replicas, the tag
scheduler (policy disaggregated) with 2 host agents, each keeping a resident SIMULATED rollout
worker (restarted by its agent when it dies, as in production), and the DeepSpeed trainer.

    .venv/bin/python -m pytest tests/faults
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable

import httpx
import openai
import pytest
import redis

from seamlessflow.ops import hosts as hostops
from seamlessflow.ops import workers as ops
from services.scheduler import leader
from tests.faults.agents import FaultAgents
from tests.faults.harness import Fault, FaultStack, wait_for
from tests.faults.invariants import check

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed, pytest.mark.timeout(300)]  # the first case includes the stack's start

AGENTS = 16
# the gateway re-sends a silent turn after 5 s, twice (SF_GATEWAY_SILENCE_TIMEOUT, _RESEND_ATTEMPTS):
# a turn caught by a fault ends within 3 x 5 s of silence, plus its own generation
HANG_LIMIT = 25.0
HOSTS = set(FaultStack.HOSTS)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = FaultStack(tmp_path_factory.mktemp("faults"), tiny_model)
    try:
        s.start()
        wait_for(lambda: serving(s) == HOSTS, 60, "both hosts serving", every=0.3)
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
        stack.whole(fault)
    finally:
        agents.stop()
    summary = check(stack, agents, [fault], hang_limit)
    print(f"{fault.name}: { {k: v for k, v in summary.items() if k != 'trajectories'} }")
    return agents, summary


def test_rollout_worker_sigkill_mid_generation(stack):
    def inject() -> Fault:
        # mid-generation: the worker's latest heartbeat (they come every second) shows requests running
        seen = wait_for(lambda: (w := _workers(stack, listen=1.1).get("host-0-rollout")) and w.running >= 3 and w,
                        20, "requests running on host-0", every=0)
        before = seen.instance
        fault = stack.begin("SIGKILL host-0's rollout worker")
        os.kill(stack.child_pid("host-0"), signal.SIGKILL)  # its host agent restarts it
        wait_for(lambda: _instance(stack, "host-0-rollout") not in ("", before), 30, "the worker restarted")
        wait_for(lambda: serving(stack) == HOSTS, 30, "host-0 serving again")
        fault.t1 = time.time()
        return fault

    _, summary = run_case(stack, inject, seed=1)
    # it was mid-generation: streams from the killed process were open, and ended as preemptions
    # (re-dispatched with their partial tokens; the invariants checked those turns)
    logs = stack.log("trajectory-0") + stack.log("trajectory-1")
    cut = re.findall(r"worker host-0-rollout lost request (\w+)\.\w+\.\d+ \(the responder", logs)
    assert cut, "no request was generating on the worker when it was killed"


def _holds_a_request(r: redis.Redis, pid: int) -> bool:
    """Does the replica with this pid hold a request's lease (its owner names the pid: chat.py)?"""
    keys = list(r.scan_iter(match="sf:req:*:owner", count=500))
    return any(v is not None and f"-{pid}-" in v.decode() for v in (r.mget(keys) if keys else []))


def test_trajectory_replica_sigkill_mid_request(stack):
    def inject() -> Fault:
        # mid-request: killed while it holds a request's lease (CI once killed it between turns: the
        # invariants held, but no request was cut and the gateway re-sent none)
        r = redis.Redis.from_url(stack.conn.redis_url)
        try:
            pid = stack.proc("trajectory-0").popen.pid
            wait_for(lambda: _holds_a_request(r, pid), 20, "a request held by trajectory-0", every=0)
        finally:
            r.close()
        return stack.kill_and_restart("trajectory-0", wait=False)

    run_case(stack, inject, seed=2)
    assert "re-sending" in stack.log("gateway")


def test_gateway_restart_sessions_continue_with_the_same_key(stack):
    # one session of our own, opened before the restart and continued after it with the same key
    user = {"Authorization": f"Bearer {stack.api_key}"}
    session = httpx.post(f"{stack.gateway_url}/sessions", headers=user, timeout=30).json()
    sdk = openai.OpenAI(base_url=stack.gateway_url, api_key=session["api_key"], max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "before"}]
    first = sdk.chat.completions.create(model="seamlessflow-tiny", messages=messages, max_tokens=8)
    run_case(stack, lambda: stack.kill_and_restart("gateway", signal.SIGKILL, unreachable=True), seed=3)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "after"}]
    second = sdk.chat.completions.create(model="seamlessflow-tiny", messages=messages, max_tokens=8)
    r = httpx.post(f"{stack.gateway_url}/sessions/{session['id']}/finish", json={"reward": 1.0}, headers=user,
                   timeout=30)
    assert r.status_code == 200, r.text
    t = _get_session(stack, session["id"]).json()
    assert [x["request_id"] for x in t["turns"]] == [first.id.removeprefix("chatcmpl-"),
                                                     second.id.removeprefix("chatcmpl-")]
    assert t["turns"][1]["parent"] == t["turns"][0]["turn_id"]  # one conversation, across the restart


def test_redis_restart_with_aof_loses_nothing_acknowledged(stack):
    agents, _ = run_case(stack, lambda: stack.kill_and_restart("redis", down_s=0.5), seed=4)
    # every session whose creation was acknowledged is still there, with every acknowledged turn
    # (the invariants checked the finished ones turn by turn)
    lost = [s.id for s in agents.sessions if _get_session(stack, s.id).status_code != 200]
    assert not lost, f"sessions lost with the Redis restart: {lost[:5]}"


def test_nats_restart_keeps_streams_and_durable_consumers(stack):
    before = stack.stream_state()
    # down longer than one JetStream publish's 5 s timeout: the trainer's weight announcement meets the
    # outage and must retry, not stop the trainer (as it did until CI caught it)
    agents, _ = run_case(stack, lambda: stack.kill_and_restart("nats", signal.SIGTERM, down_s=7.0), seed=5)
    after = stack.stream_state()
    assert after["streams"] >= before["streams"], (before, after)
    assert after["last_seq"] >= before["last_seq"] and after["ack_floor"] >= before["ack_floor"], (before, after)
    assert after["consumer"] == before["consumer"] == "trainer"


def test_trainer_sigkill_between_checkpoint_and_publish(stack):
    def inject():
        checkpoints = _events(stack, "checkpoint")
        wait_for(lambda: _events(stack, "checkpoint") > checkpoints, 30, "the trainer's next checkpoint", every=0.01)
        return stack.kill_and_restart("trainer", wait=False)

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
    return httpx.get(f"{stack.gateway_url}/sessions/{sid}", headers={"Authorization": f"Bearer {stack.api_key}"},
                     timeout=10)


def _events(stack, event: str) -> int:
    return sum(r["event"] == event for r in stack.audit())


def test_scheduler_and_host_agent_killed_and_restarted(stack):
    """The scheduler and host-1's agent SIGKILLed together (the agent's worker goes with it), then
    restarted: the agent first, with no scheduler running, then the scheduler."""
    before = hosts(stack)

    def inject() -> Fault:
        fault = stack.begin("SIGKILL scheduler + host-1 agent")
        scheduler, agent = stack.kill("scheduler"), stack.kill("host-1")
        time.sleep(1.0)
        stack.restart(agent)  # with no scheduler: it applies its last assignment (the HOSTS stream's last value)
        wait_for(lambda: _state(stack, "host-1-rollout") == "serving", 30,
                 "host-1's worker serving again with no scheduler running")
        stack.restart(scheduler)
        fault.t1 = time.time()
        return fault

    run_case(stack, inject, seed=8)
    log = stack.log("scheduler")
    assert "2 host(s) known" in log.rsplit("scheduler ready", 1)[1][:200], "the registry was not rebuilt from Redis"
    wait_for(lambda: serving(stack) == HOSTS, 30, "both hosts serving under the new scheduler")
    # The new scheduler leads a new term, and fences every host's record at that term's first epoch
    # (scheduler/leader.py); an assignment issued to host-0 would be above it.
    after = hosts(stack)["host-0"].epoch
    fenced = leader.first_epoch(leader.term_of(after))
    assert after in (before["host-0"].epoch, fenced), f"host-0 was reassigned from scratch: epoch {after}"


def hosts(s: FaultStack) -> dict:
    try:
        return {h.host: h for h in asyncio.run(hostops.ask(s.conn, "status", timeout=2.0)).hosts}
    except SystemExit:  # no scheduler (yet)
        return {}


def serving(s: FaultStack) -> set[str]:
    return {h for h, i in hosts(s).items() if i.mode == i.target == "rollout" and i.healthy}


def _workers(s: FaultStack, listen: float = 1.2) -> dict:
    try:
        return {w.worker_id: w for w in asyncio.run(ops.worker_statuses(s.conn, listen=listen))}
    except Exception:
        return {}


def _instance(s: FaultStack, wid: str) -> str:
    w = _workers(s).get(wid)
    return w.instance if w is not None else ""


def _state(s: FaultStack, wid: str) -> str:
    w = _workers(s).get(wid)
    return w.state if w is not None else ""
