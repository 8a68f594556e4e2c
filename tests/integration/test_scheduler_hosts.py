"""`seamlessflow hosts` and `seamlessflow timeline` against a live scheduler, as an operator runs them:
the CLI in its own process, finding the stack through --data-dir (stack.json).

The stack: scheduler (seamless), host-0 {train, rollout} and host-1 {rollout}, each agent with a
resident rollout worker running the SIMULATED engine (services/rollout/simulated.py: the subject
is the control path, not generation), no trainer, hosts pinned (`--pin`). Its own NATS and Redis:
the scheduler persists its policy and hosts, which must not leak into another module's scheduler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from seamlessflow.stack import servers
from seamlessflow.stack.pinning import pin_plan
from tests.integration.stack_fixture import make_stack

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model, private_nats):
    tmp = tmp_path_factory.mktemp("hosts-cli")
    port = servers.free_port()
    redis = servers.start_redis(port, tmp / "redis")
    try:
        s = make_stack(tmp / "stack", tiny_model, private_nats, f"redis://127.0.0.1:{port}/0", simulated=True,
                       policy="seamless", hosts=["train+rollout", "rollout"], ready_timeout=120, pin=True)
        try:
            yield s
        finally:
            s.stop()
    finally:
        servers.stop(redis)


def sf(stack, *args: str) -> subprocess.CompletedProcess:
    """`python -m seamlessflow ARGS --data-dir DATA`, with no SF_NATS_URL of the test's own."""
    env = {k: v for k, v in os.environ.items() if k not in ("SF_NATS_URL", "SF_REDIS_URL")}
    return subprocess.run([sys.executable, "-m", "seamlessflow", *args, "--data-dir", str(stack.data)],
                          capture_output=True, text=True, env=env, timeout=60)


def rows(stack) -> dict[str, list[str]]:
    """`hosts list`'s host rows: id -> [tags, mode, target, epoch, health, now, ...]."""
    out = sf(stack, "hosts", "list")
    assert out.returncode == 0, out.stderr
    return {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if line.startswith("host-")}


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def test_hosts_list_shows_each_host_the_policy_and_the_rates(stack):
    wait_for(lambda: {h: r[1] for h, r in rows(stack).items()} == {"host-0": "rollout", "host-1": "rollout"}, 60,
             "both hosts serving (no trainer: seamless lends host-0)")
    out = sf(stack, "hosts", "list")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.startswith("policy seamless;") and "lends 1" in out.stdout
    assert "rates: " in out.stdout and "groups_per_s" in out.stdout and "sessions_per_s" in out.stdout
    assert rows(stack)["host-0"][0] == "train,rollout,cpu"


def test_cordon_and_uncordon_move_a_host_out_and_back(stack):
    out = sf(stack, "hosts", "cordon", "host-1")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: rows(stack)["host-1"][1:5:3] == ["idle", "cordoned"], 30, "host-1 cordoned and idle")
    out = sf(stack, "hosts", "uncordon", "host-1")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: rows(stack)["host-1"][1:5:3] == ["rollout", "ok"], 30, "host-1 serving again")


def test_hosts_policy_switches_the_running_cluster(stack):
    out = sf(stack, "hosts", "policy", "disaggregated")
    assert out.returncode == 0 and out.stdout.startswith("policy disaggregated"), out.stderr
    wait_for(lambda: rows(stack)["host-0"][1] == "train", 30, "host-0 back in the train pool")
    out = sf(stack, "hosts", "policy", "seamless")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: rows(stack)["host-0"][1] == "rollout", 30, "host-0 lent again")


def test_operator_mistakes_are_one_line_errors(stack):
    for args, error in [(("hosts", "cordon", "host-9"), "unknown host 'host-9'"),
                        (("hosts", "policy", "fastest"), "unknown policy 'fastest'"),
                        (("hosts", "cordon"), "needs a host id"),
                        (("hosts", "policy"), "needs a policy")]:
        out = sf(stack, *args)
        assert out.returncode == 1 and error in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_timeline_exports_every_hosts_activity(stack, tmp_path):
    out = sf(stack, "timeline", "--out", str(tmp_path / "timeline.json"))
    assert out.returncode == 0 and "host-0:" in out.stdout, out.stderr
    doc = json.loads((tmp_path / "timeline.json").read_text())
    assert set(doc["hosts"]) == {"host-0", "host-1"} and doc["policy"] == "seamless"
    assert {"sessions_per_s", "groups_per_s"} <= set(doc["rates"])
    for h in doc["hosts"].values():
        assert abs(sum(h["fractions"].values()) - 1.0) < 1e-6


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
        except OSError:
            continue
    return out


def test_pinned_hosts_run_their_agent_and_worker_on_their_own_cores(stack):
    plan = pin_plan(sorted(os.sched_getaffinity(0)), 2)
    procs = {p.name: p.popen.pid for p in stack.procs}
    for i, host in enumerate(("host-0", "host-1")):
        agent = procs[host]
        assert os.sched_getaffinity(agent) == set(plan.hosts[i])
        (worker,) = children(agent)  # its resident worker
        assert os.sched_getaffinity(worker) == set(plan.hosts[i])
    for name in ("scheduler", "gateway", "trajectory-0"):
        assert os.sched_getaffinity(procs[name]) == set(plan.control)
    doc = json.loads((stack.data / "stack.json").read_text())
    assert [h["cores"] for h in doc["hosts"]] == [",".join(map(str, s)) for s in plan.hosts]
