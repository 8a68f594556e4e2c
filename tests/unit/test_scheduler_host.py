"""HostAgent construction: which resident worker it would run (no NATS, no process started)."""

from services.scheduler.config import load_host
from services.scheduler.host import HostAgent
from shared.config import connections


def _agent(**kw) -> HostAgent:
    return HostAgent(load_host(id="h0", tags="train,rollout", **kw), connections({}))


def test_default_worker_is_the_rollout_service():
    a = _agent(model="var/model")
    assert a.has_worker
    assert a.worker_argv[1:] == ["-m", "services.rollout", "--model", "var/model", "--worker-id", "h0-rollout"]


def test_worker_cmd_replaces_the_worker_for_benchmarks():
    a = _agent(model="var/model", worker_cmd="python -m services.rollout.simulated --capacity 64")
    assert a.has_worker
    assert a.worker_argv == ["python", "-m", "services.rollout.simulated", "--capacity", "64", "--model", "var/model",
                             "--worker-id", "h0-rollout"]


def test_no_model_no_worker_even_with_worker_cmd():
    a = _agent(worker_cmd="python -m services.rollout.simulated")
    assert not a.has_worker


async def test_a_worker_that_exits_takes_its_leftover_processes_with_it(tmp_path):
    """vLLM's engine processes outlive a SIGKILLed worker; the agent kills the worker's group."""
    import asyncio
    from pathlib import Path

    from services.scheduler.config import HostConfig
    from services.scheduler.host import HostAgent
    from shared.config import Connections

    pidfile = tmp_path / "grandchild"
    argv = ["bash", "-c", f"sleep 300 & echo $! > {pidfile}; sleep 0.2; exit 1"]
    agent = HostAgent(HostConfig(id="h", tags="rollout", model="m", restart_backoff_max=0.5), Connections(),
                      worker_argv=argv)
    quit = asyncio.Event()
    task = asyncio.create_task(agent._supervise(quit))
    try:
        for _ in range(100):
            if agent.restarts >= 1:
                break
            await asyncio.sleep(0.05)
        assert agent.restarts >= 1
        grandchild = int(pidfile.read_text())
        await asyncio.sleep(0.1)
        try:  # gone, or a zombie nobody has reaped yet (its parent, the worker, is gone)
            state = (Path(f"/proc/{grandchild}/status").read_text().split("State:")[1].split()[0])
        except FileNotFoundError:
            state = "gone"
        assert state in ("gone", "Z"), f"the worker's leftover process survived it (state {state})"
    finally:
        quit.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await agent._stop_worker()


async def test_a_drain_assignment_only_resends_lent_until(monkeypatch):
    """rollout -> rollout (the reclaim grace's drain, or a drain margin moving lent_until): the
    worker is resumed with the new lent_until; the trainer rank is not offloaded again."""
    from shared.messages.scheduler import HostAssignment

    a = _agent(model="var/model", trainer=True)
    done: list[tuple[str, float]] = []

    async def step(s, asg):
        done.append((s, asg.lent_until))
        return 0

    async def nothing(*args, **kw):
        return None

    monkeypatch.setattr(a, "_step", step)
    monkeypatch.setattr(a, "_worker_up", nothing)
    monkeypatch.setattr(a, "_publish", nothing)
    await a._apply(HostAssignment("h0", "rollout", 1, lent_until=150.0))  # the lend, from idle
    assert [s for s, _ in done] == ["offload_trainer", "wake", "load", "resume"]
    done.clear()
    await a._apply(HostAssignment("h0", "rollout", 2, lent_until=120.0))  # the drain
    assert done == [("wake", 120.0), ("load", 120.0), ("resume", 120.0)]
    assert (a.mode, a.epoch) == ("rollout", 2)


async def test_a_resume_the_worker_answers_paused_fails_the_switch(monkeypatch):
    """A worker woken without weights it could not get back (network transport, level-2 sleep) says
    `paused`: the lend is reported failed, not done."""
    import pytest

    from services.scheduler.host import SwitchFailed
    from shared.messages.rollout import WorkerStatus
    from shared.messages.scheduler import HostAssignment

    a = _agent(model="var/model")
    state = "paused"

    async def control(ctl):
        return WorkerStatus("h0-rollout", state, 1, 0, 4, "m", 512, 0.0)

    monkeypatch.setattr(a, "_control", control)
    with pytest.raises(SwitchFailed, match="paused after resume"):
        await a._step("resume", HostAssignment("h0", "rollout", 1))
    state = "serving"
    assert await a._step("resume", HostAssignment("h0", "rollout", 1)) == 0


async def test_a_lend_loads_the_newest_version_over_the_network_too(monkeypatch):
    """Network weights: the assignment names the version and no path; the load step still asks the
    worker to load it (its load of a pathless version is a catch-up round from the trainer), and a
    worker still older afterwards fails the switch: a lent host never serves an old version."""
    import pytest

    from services.scheduler.host import SwitchFailed
    from shared.messages.rollout import WorkerStatus
    from shared.messages.scheduler import HostAssignment

    a = _agent(model="var/model")
    a.worker = WorkerStatus("h0-rollout", "vacated", 0, 0, 4, "m", 512, 0.0)
    sent = []
    after = 6

    async def control(ctl):
        sent.append(ctl)
        return WorkerStatus("h0-rollout", "vacated", after, 0, 4, "m", 512, 0.0)

    monkeypatch.setattr(a, "_control", control)
    await a._step("load", HostAssignment("h0", "rollout", 1, version=6, path=""))
    assert [(c.op, c.version, c.path) for c in sent] == [("load", 6, "")]
    a.worker = WorkerStatus("h0-rollout", "vacated", 6, 0, 4, "m", 512, 0.0)
    sent.clear()
    await a._step("load", HostAssignment("h0", "rollout", 2, version=6, path=""))  # already there: nothing sent
    await a._step("load", HostAssignment("h0", "rollout", 3))  # no version published yet: nothing sent
    assert sent == []
    a.worker, after = WorkerStatus("h0-rollout", "vacated", 0, 0, 4, "m", 512, 0.0), 0  # the trainer said not now
    with pytest.raises(SwitchFailed, match="still serves version 0 after loading 7"):
        await a._step("load", HostAssignment("h0", "rollout", 4, version=7, path=""))
