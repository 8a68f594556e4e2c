"""The tag scheduler under faults: its own stack (harness.py) where two host agents, under the
scheduler (policy disaggregated), each keep a resident SIMULATED rollout worker; the gateway,
two trajectory replicas and the SIMULATED trainer as in test_faults.py. 16 openai-SDK agents
in flight while the scheduler and host-1's agent are SIGKILLed together, then restarted: the
agent first (the scheduler still down), then the scheduler. The same three invariants, and:

- the hosts keep their last assignment: host-0 serves throughout, and the restarted host-1
  agent applies its assignment (the HOSTS stream's last value) with no scheduler running;
- both re-register (heartbeats), and the restarted scheduler rebuilds its registry from Redis:
  it knows both hosts at once, host-0's epoch is the one it had, and nothing is idle.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from seamlessflow import hosts as hostops
from shared.config import connections
from tests.faults.harness import ENGINE, ROOT, FaultStack, wait_for
from tests.faults.test_faults import run_case

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    engine = " ".join([sys.executable, str(ROOT / "bench" / "simulated_engine.py"), *ENGINE])
    s = FaultStack(tmp_path_factory.mktemp("sched-faults"), tiny_model, policy="disaggregated",
                   hosts=["rollout", "rollout"], worker_cmd=engine)
    s.start(workers=0)
    s.conn = connections({"SF_NATS_URL": s.stack.nats_url, "SF_REDIS_URL": s.stack.redis_url})
    try:
        wait_for(lambda: serving(s) == {"host-0", "host-1"}, 60, "both hosts serving", every=0.3)
        yield s
    finally:
        s.stop()


def hosts(s: FaultStack) -> dict:
    try:
        return {h.host: h for h in asyncio.run(hostops.ask(s.conn, "status", timeout=2.0)).hosts}
    except SystemExit:  # no scheduler (yet)
        return {}


def serving(s: FaultStack) -> set[str]:
    return {h for h, i in hosts(s).items() if i.mode == i.target == "rollout" and i.healthy}


def test_scheduler_and_host_agent_killed_and_restarted(cluster):
    before = hosts(cluster)

    def inject():
        fault = cluster.begin("SIGKILL scheduler + host-1 agent")
        scheduler, agent = cluster.kill("scheduler"), cluster.kill("host-1")
        time.sleep(1.0)
        cluster.restart(agent)  # with no scheduler: it must apply its last assignment by itself
        wait_for(lambda: "host-1-rollout serving" in _worker_states(cluster), 30,
                 "host-1's worker serving again with no scheduler running")
        cluster.restart(scheduler)
        fault.t1 = time.time()
        return fault

    run_case(cluster, inject, seed=11)
    log = cluster.log("scheduler")
    assert "2 host(s) known" in log.rsplit("scheduler ready", 1)[1][:200], "the registry was not rebuilt from Redis"
    wait_for(lambda: serving(cluster) == {"host-0", "host-1"}, 30, "both hosts serving under the new scheduler")
    after = hosts(cluster)
    assert after["host-0"].epoch == before["host-0"].epoch, (before["host-0"], after["host-0"])


def _worker_states(s: FaultStack) -> str:
    from seamlessflow import ops

    try:
        return " ".join(f"{w.worker_id} {w.state}" for w in asyncio.run(ops.worker_statuses(s.conn)))
    except Exception:
        return ""
