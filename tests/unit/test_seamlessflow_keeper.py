"""keeper.py over a fake stack: the code under test stays real; only the processes are faked
(a Popen whose exit the test decides) and the control socket is a real one in tmp_path."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from seamlessflow.stack import control
from seamlessflow.stack.keeper import Keeper
from seamlessflow.stack import Proc
from seamlessflow.stack.supervisor import RestartPolicy


class FakePopen:
    pids = iter(range(1000, 100000))

    def __init__(self):
        self.pid = next(self.pids)
        self.returncode = None

    def poll(self):
        return self.returncode


class FakeStack:
    def __init__(self, tmp: Path, names: list[str], policy: str = ""):
        self.data = tmp
        self.o = SimpleNamespace(ready_timeout=100.0, policy=policy, workers=1, trajectory_replicas=1)
        self.gateway_url, self.admin_url = "http://127.0.0.1:1/v1", "http://127.0.0.1:2"
        self.nats_url, self.redis_url = "nats://127.0.0.1:1", "redis://127.0.0.1:1/0"
        self.procs = [self._proc(n) for n in names]
        self.ready: set[int] = set()
        self.cleared: list[int] = []

    def _proc(self, name: str) -> Proc:
        log = self.data / f"{name}.log"
        log.write_text(f"{name} starting\nValueError: bad setting SF_X\n")
        return Proc(name, FakePopen(), log)

    def is_ready(self, p: Proc) -> bool:
        return p.popen.pid in self.ready

    def respawn(self, p: Proc) -> Proc:
        self.procs.remove(p)
        new = self._proc(p.name)
        self.procs.append(new)
        return new

    def clear_group(self, p: Proc) -> None:
        self.cleared.append(p.popen.pid)

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)


@pytest.fixture
def fake(tmp_path):
    stack = FakeStack(tmp_path, ["nats", "redis", "trajectory-0", "rollout-0", "gateway"])
    lines: list[str] = []
    up: list[bool] = []
    keeper = Keeper(stack, RestartPolicy(loop_restarts=2), say=lines.append, on_up=lambda: up.append(True))
    stack.ready = {p.popen.pid for p in stack.procs}
    keeper.tick(0.0)
    assert up == [True] and all(s.state == "running" for s in keeper.services.values())
    return stack, keeper, lines


def test_an_exited_service_is_restarted_after_its_back_off_and_logged_once(fake):
    stack, keeper, lines = fake
    old = stack.proc("rollout-0")
    old.popen.returncode = -9
    keeper.tick(10.0)
    assert lines[-1].endswith(f"rollout-0 exited with code -9 (SIGKILL); restart 1 in 0.5s (log: {old.log})")
    assert stack.cleared == [old.popen.pid]  # what was left of its process group
    keeper.tick(10.3)
    assert stack.proc("rollout-0") is old and len(lines) == 1  # still backing off
    keeper.tick(10.6)
    new = stack.proc("rollout-0")
    assert new is not old and keeper.services["rollout-0"].state == "starting"
    stack.ready.add(new.popen.pid)
    keeper.tick(11.0)
    row = keeper.status()["services"][3]
    assert row["name"] == "rollout-0" and row["state"] == "running" and row["restarts"] == 1
    assert row["pid"] == new.popen.pid and row["last_exit"] == -9
    assert "rollout-0 is back" in lines[-1]


def test_a_crash_loop_is_given_up_with_its_log_and_the_rest_keeps_running(fake):
    stack, keeper, lines = fake
    t = 1.0
    for _ in range(3):
        stack.proc("gateway").popen.returncode = 1
        keeper.tick(t)
        keeper.tick(t + 5)  # restart due
        t += 10
    gateway = keeper.services["gateway"]
    assert gateway.state == "given up" and gateway.restarts == 2
    msg = lines[-1]
    assert "error: giving up on gateway: exited with code 1 after 2 restarts within 60s (crash loop)" in msg
    assert "the rest of the stack keeps running" in msg and "ValueError: bad setting SF_X" in msg
    assert not keeper.fatal
    assert all(s.state == "running" for n, s in keeper.services.items() if n != "gateway")
    keeper.tick(t + 100)
    assert gateway.state == "given up"  # never restarted again


def test_giving_up_redis_stops_the_stack(fake):
    stack, keeper, lines = fake
    for t in (1.0, 11.0, 21.0):
        stack.proc("redis").popen.returncode = 1
        keeper.tick(t)
        keeper.tick(t + 5)
    assert "redis exited with code 1 after 2 restarts" in keeper.fatal
    assert "nothing works without redis, so the stack stops" in keeper.fatal


def test_a_service_not_ready_in_time_is_killed_once(fake):
    stack, keeper, lines = fake
    stack.proc("trajectory-0").popen.returncode = 1
    keeper.tick(1.0)
    keeper.tick(2.0)  # respawned, never ready
    for t in (150.0, 150.2, 150.4):
        keeper.tick(t)
    assert [line for line in lines if "not ready after 100s: killing it" in line] and \
        stack.cleared.count(stack.proc("trajectory-0").popen.pid) == 1


async def test_one_scale_at_a_time_and_none_of_rollout_under_the_scheduler(tmp_path):
    stack = FakeStack(tmp_path, ["nats", "trajectory-0"], policy="seamless")
    keeper = Keeper(stack, RestartPolicy(), say=lambda m: None)

    async def progress(msg: str) -> None:
        pass

    reply = await keeper._scale_request({"rollout": 2}, progress)
    assert not reply["ok"] and "tag scheduler (--policy seamless)" in reply["error"]
    keeper.scaling, keeper.scaling_since = "trajectory=3", 0.0
    reply = await keeper._scale_request({"trajectory": 2}, progress)
    assert not reply["ok"] and reply["error"].startswith("a scale is already running (trajectory=3, for ")


async def test_control_socket_round_trip_with_progress(tmp_path):
    async def handle(request: dict, progress) -> dict:
        await progress("halfway")
        return {"ok": True, "echo": request}

    server = await control.serve(control.socket_path(tmp_path), handle)
    seen: list[str] = []
    try:
        reply = await asyncio.to_thread(control.ask, tmp_path, {"op": "x"}, 5.0, seen.append)
        bad = await asyncio.to_thread(control.ask, tmp_path, [1], 5.0)
    finally:
        server.close()
    assert reply == {"ok": True, "echo": {"op": "x"}} and seen == ["halfway"]
    assert not bad["ok"] and "bad request" in bad["error"]
    with pytest.raises(control.NotRunning, match="no `seamlessflow up` is running"):
        control.ask(tmp_path / "elsewhere", {"op": "status"})


def test_status_text_lists_services_workers_and_gateway(fake):
    stack, keeper, lines = fake
    st = keeper.status()
    st["workers"] = [{"worker_id": "rollout-0", "state": "serving", "version": 3, "running": 2, "capacity": 16,
                      "load": 0.125, "host": "", "age": 0.4, "tokens": 10}]
    text = control.format_status(st)
    assert "gateway: http://127.0.0.1:1/v1" in text
    assert "trajectory-0" in text and "RESTARTS" in text
    assert "rollout-0        serving         3   2/16" in text
