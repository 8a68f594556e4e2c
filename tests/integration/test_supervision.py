"""`seamlessflow up` as a user runs it (a real subprocess, its own NATS and Redis on free
ports), supervising a stack while openai-SDK agents are in flight:

- `scale rollout=2` brings a second worker into routing; a second scale meanwhile is refused;
- SIGKILL one of two trajectory replicas, then one of two rollout workers: no agent request
  fails, each is restarted at once and serves again, `seamlessflow status` shows one
  restart for each, and nothing of the killed worker's process group is left;
- `scale rollout=1` vacates a worker (its requests migrate with their partial tokens) and
  stops it; no request fails;
- a second `up` whose gateway has a bad setting gives the gateway up after the crash-loop
  limit, says why with the last lines of its log, and keeps NATS, Redis and the trajectory
  manager running;
- Ctrl-C stops everything in order (gateway, replicas, workers, Redis/NATS) and the process
  table holds nothing of either stack afterwards.

One main stack serves every test, in order; the crash-looping stack has no workers and runs
alongside it while the main one starts. The main stack's workers are the real rollout service
around the SIMULATED engine (`up --worker-cmd "python -m services.rollout.simulated"`): supervision is the
subject, not vLLM, and a worker starts in about a second instead of vLLM-CPU's 20 s to minutes.
A killed vLLM worker's engine process is cleared by the same `Stack.clear_group`, which
test_scheduler_live's host-loss test runs against vLLM.
"""

from __future__ import annotations

import asyncio
import json
import re
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from seamlessflow.stack import control, servers
from seamlessflow.demo.workload import GroupAgents, Load
from tests.integration.stack_fixture import simulated_worker_cmd

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]  # slow: ~55 s, pyproject.toml

CLI = [sys.executable, "-m", "seamlessflow"]


class Up:
    """One `seamlessflow up` subprocess on free ports, its output in DATA/up.out."""

    def __init__(self, data: Path, model: Path, *args: str, env: dict[str, str] | None = None):
        self.data = data
        self.nats_port = servers.free_port()
        ports = ["--gateway-port", str(servers.free_port()), "--admin-port", str(servers.free_port()),
                 "--nats-port", str(self.nats_port), "--redis-port", str(servers.free_port())]
        data.mkdir(parents=True, exist_ok=True)
        self.out = data / "up.out"
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen([*CLI, "up", "--model", str(model), "--data-dir", str(data),
                                          "--max-model-len", "512", "--ready-timeout", "600", *ports, *args],
                                         stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def status(self) -> dict:
        try:
            return control.ask(self.data, {"op": "status"})
        except (control.NotRunning, OSError, ValueError):
            assert self.proc.poll() is None, f"up exited with {self.proc.returncode}:\n{self.output()[-3000:]}"
            return {"services": [], "workers": []}

    def service(self, name: str) -> dict:
        return next((s for s in self.status()["services"] if s["name"] == name), {})

    def worker(self, wid: str) -> dict:
        return next((w for w in self.status()["workers"] if w["worker_id"] == wid), {})

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args, "--data-dir", str(self.data)], capture_output=True, text=True,
                              timeout=timeout)

    @property
    def api_key(self) -> str:
        return json.loads((self.data / "credentials.json").read_text())["api_key"]

    @property
    def gateway_url(self) -> str:
        return self.status()["gateway_url"]

    def interrupt(self, timeout: float = 120) -> int:
        """Ctrl-C, as a terminal sends it; returns up's exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def leftovers(self) -> list[str]:
        """Processes of this stack still in the process table: every service gets the stack's
        NATS URL in its environment (vLLM's engine processes inherit it), with the stack's
        login in it: nats://USER:PASSWORD@127.0.0.1:PORT."""
        def ours(var: bytes) -> bool:
            return var.startswith(b"SF_NATS_URL=nats://") and var.endswith(f"127.0.0.1:{self.nats_port}".encode())
        return [f"{pid}: {_cmdline(pid)}" for pid in _pids()
                if any(ours(v) for v in _read(f"/proc/{pid}/environ").split(b"\0"))]


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")[:120]


def _group(pgid: int) -> list[int]:
    """Live members of process group `pgid`."""
    out = []
    for pid in _pids():
        stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(pid)
    return out


def wait_for(cond, timeout: float, what: str, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Agents:
    """GroupAgents (openai SDK) in flight on a thread of their own until stop()."""

    def __init__(self, up: Up, seed: int, min_tokens: int = 16, max_tokens: int = 64, lanes: int = 2):
        self.agents = GroupAgents(up.gateway_url, up.api_key, Load(group_size=2, lanes=lanes, seed=seed,
                                                                   min_tokens=min_tokens, max_tokens=max_tokens))
        self.done = threading.Event()
        self.crash: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self.agents.run(until=self.done.is_set, timeout=600))
        except BaseException as e:  # an HTTP error outside the SDK (sessions API) is a failure too
            self.crash = e

    def healthy(self) -> bool:
        """For wait conditions: fail at once, not at the timeout, when an agent has failed."""
        assert self.crash is None and not self.agents.failures, (self.crash, self.agents.failures[:3])
        return True

    def stop(self) -> GroupAgents:
        self.done.set()
        self.thread.join(300)
        assert not self.thread.is_alive(), "agents did not finish their turns"
        assert self.crash is None, f"an agent failed outside the SDK: {self.crash!r}"
        assert not self.agents.failures, f"{len(self.agents.failures)} agent requests failed: {self.agents.failures[:3]}"
        return self.agents


@pytest.fixture(scope="module")
def crashing(tmp_path_factory, tiny_model):
    """A stack without workers whose gateway cannot start: an unknown SF_GATEWAY_ setting."""
    env = dict(os.environ) | {"SF_GATEWAY_BOGUS_SETTING": "1"}
    up = Up(tmp_path_factory.mktemp("crashing"), tiny_model, "--workers", "0", "--restart-limit", "2", env=env)
    yield up
    up.interrupt()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model, crashing):
    up = Up(tmp_path_factory.mktemp("up"), tiny_model, "--workers", "1", "--trajectory-replicas", "2",
            "--worker-cmd", simulated_worker_cmd(start_s=12.0))  # a scale lasts long enough to be seen
    try:
        wait_for(lambda: "SeamlessFlow is up" in up.output() or up.proc.poll() is not None, 300, "the stack")
        assert up.proc.poll() is None, up.output()[-3000:]
        wait_for(lambda: up.worker("rollout-0").get("state") == "serving", 30, "rollout-0 heartbeats")
        yield up
    finally:
        up.interrupt()


def test_scale_up_brings_a_worker_into_routing(stack):
    agents = Agents(stack, seed=1)
    scale = subprocess.Popen([*CLI, "scale", "rollout=2", "--data-dir", str(stack.data)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # one scale at a time: a second one is refused, with the reason
    wait_for(lambda: stack.status().get("scaling"), 30, "the scale to begin")
    second = stack.cli("scale", "trajectory=3")
    assert second.returncode != 0 and "a scale is already running (rollout=2" in second.stderr, second.stderr
    out, err = scale.communicate(timeout=660)  # the ready timeout is 600 s (a starved CPU)
    assert scale.returncode == 0, err
    assert out.strip() == "rollout=2" and "rollout-1 ready" in err, (out, err)
    # in routing: the new worker generates tokens for the agents
    wait_for(lambda: stack.worker("rollout-1").get("tokens", 0) > 0, 60, "rollout-1 to generate")
    assert agents.stop().ok > 0


def test_killed_replica_and_worker_come_back_and_no_request_fails(stack):
    agents = Agents(stack, seed=2)
    wait_for(lambda: agents.agents.ok >= 4, 120, "agents under way")

    # 1. SIGKILL one of two trajectory replicas: the gateway re-sends, the other resumes
    old = stack.service("trajectory-0")["pid"]
    os.kill(old, signal.SIGKILL)
    t0 = time.monotonic()
    back = wait_for(lambda: (s := stack.service("trajectory-0")).get("state") == "running" and s["pid"] != old and s,
                    60, "trajectory-0 back")
    replica_back = time.monotonic() - t0
    assert back["restarts"] == 1

    # 2. SIGKILL one of two rollout workers (only its main process, as a crash would):
    #    requests re-dispatch to the other; it is restarted at once, then serves again
    old = stack.service("rollout-1")["pid"]
    group = _group(old)
    assert old in group
    os.kill(old, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: stack.service("rollout-1").get("pid") not in (None, 0, old), 10, "rollout-1 restarted")
    worker_restarted = time.monotonic() - t0
    wait_for(lambda: not (set(_group(old)) & set(group)), 10, "the killed worker's engine process gone")
    wait_for(lambda: agents.healthy() and stack.service("rollout-1").get("state") == "running", 300,
             "rollout-1 serving again")
    ok = agents.agents.ok
    wait_for(lambda: agents.healthy() and stack.worker("rollout-1").get("state") == "serving"
             and agents.agents.ok >= ok + 4, 180, "more turns after the restart")
    agents.stop()
    assert "trajectory-0 exited with code -9 (SIGKILL); restart 1 in 0.5s (log: " in stack.output()
    assert "rollout-1 exited with code -9 (SIGKILL); restart 1 in 0.5s (log: " in stack.output()

    # 3. what `seamlessflow status` says
    res = stack.cli("status", "--json", timeout=60)
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    restarts = {s["name"]: s["restarts"] for s in st["services"]}
    assert restarts == {"nats": 0, "redis": 0, "trajectory-0": 1, "trajectory-1": 0, "rollout-0": 0,
                        "rollout-1": 1, "gateway": 0}, restarts
    assert all(s["state"] == "running" and s["pid"] > 0 and s["uptime"] > 0 for s in st["services"]), st
    assert {w["worker_id"] for w in st["workers"]} == {"rollout-0", "rollout-1"}
    assert all("version" in w and "load" in w for w in st["workers"])
    text = stack.cli("status", timeout=60).stdout
    assert "trajectory-0" in text and "gateway: http://127.0.0.1:" in text and "RESTARTS" in text
    print(f"trajectory-0 back in {replica_back:.1f}s; rollout-1 restarted after {worker_restarted:.1f}s")


def test_scale_down_vacates_a_worker_and_its_requests_migrate(stack):
    agents = Agents(stack, seed=3, min_tokens=128, max_tokens=256, lanes=3)
    wait_for(lambda: agents.healthy() and stack.worker("rollout-1").get("running", 0) > 0, 180,
             "requests on rollout-1")
    # asked in-process, as `seamlessflow scale rollout=1` asks (the CLI's start-up would let them finish)
    said: list[str] = []
    reply = control.ask(stack.data, {"op": "scale", "counts": {"rollout": 1}}, timeout=120, on_progress=said.append)
    assert reply == {"ok": True, "counts": {"rollout": 1}}, (reply, said)
    vacated = next(m for m in said if m.startswith("rollout-1 vacated ("))
    assert int(vacated.split("(")[1].split()[0]) > 0, said  # it had requests, and they migrate
    assert said[-1] == "rollout-1 stopped", said
    assert [s["name"] for s in stack.status()["services"] if s["name"].startswith("rollout")] == ["rollout-0"]
    ok = agents.agents.ok
    wait_for(lambda: agents.healthy() and agents.agents.ok >= ok + 2, 180, "turns after the scale down")
    done = agents.stop()
    # a request that was on rollout-1 went on, with its partial tokens, on rollout-0
    migrated = [t for tr in done.trajectories() for t in tr["turns"]
                if [s["worker_id"] for s in t["segments"]][:1] == ["rollout-1"]
                and "rollout-0" in [s["worker_id"] for s in t["segments"]]]
    assert migrated, "no turn moved from rollout-1 to rollout-0"


def test_a_crash_looping_service_is_given_up_and_the_rest_keeps_running(crashing):
    wait_for(lambda: "giving up on gateway" in crashing.output(), 180, "the gateway to be given up")
    out = crashing.output()
    assert "gateway exited with code 1; restart 1 in 0.5s" in out
    assert "gateway exited with code 1; restart 2 in 1.0s" in out
    assert "giving up on gateway: exited with code 1 after 2 restarts within 60s (crash loop)" in out
    assert "SF_GATEWAY_BOGUS_SETTING" in out.split("giving up on gateway")[1]  # why: the log's last lines
    st = {s["name"]: s for s in crashing.status()["services"]}
    assert st["gateway"]["state"] == "given up" and st["gateway"]["restarts"] == 2
    assert all(st[n]["state"] == "running" for n in ("nats", "redis", "trajectory-0")), st
    assert crashing.interrupt() == 0
    assert not crashing.leftovers()


def test_ctrl_c_stops_everything_in_order_without_orphans(stack):
    assert stack.leftovers(), "the check sees the running stack"
    assert stack.interrupt() == 0, stack.output()[-3000:]
    out = stack.output()
    # the replicas stop together, in whatever order their processes are listed (a restarted one moves)
    replicas = re.search(r"stopping (trajectory-[01]), (trajectory-[01]) \.\.\.", out)
    assert replicas and {replicas[1], replicas[2]} == {"trajectory-0", "trajectory-1"}, out[-2000:]
    order = [out.index("stopping gateway ..."), replicas.start(), out.index("stopping rollout-0 ...")]
    assert order == sorted(order), out[-2000:]
    assert out.index("stopping rollout-0 ...") < out.index("stopping nats, redis ...")
    assert not stack.leftovers()
    assert not (stack.data / "control.sock").exists() and not (stack.data / "stack.pid").exists()
