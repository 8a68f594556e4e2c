"""services/trainer/service.py's scheduler hooks (status, gate, offload/reload) and the Runner's
offload/reload commands, with the edges faked: the NATS client and the engine (or the whole
Runner) are stand-ins; the service and runner code stay real."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from services.trainer.config import TrainerConfig
from services.trainer.engine import offload_support
from services.trainer.metrics import Metrics
from services.trainer.runner import Command, Runner, decode_groups, encode_groups
import services.trainer.service as service_mod
from services.trainer.service import TrainerService
from shared import subjects
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages.scheduler import TrainerControl, TrainerStatus, TrainGate, TrainGateReply
from shared.messages.trajectory import Sample, TrajectoryCompleted
from shared.messages.weights import WeightsPublished, WeightsWanted


def traj(sid: str, gid: str, reward: float) -> TrajectoryCompleted:
    s = Sample([5, 6, 7, 8], [0, 1, 1, 1], [0.0, -1.0, -1.0, -1.0], [-1, 0, 0, 0])
    return TrajectoryCompleted(session_id=sid, group_id=gid, reward=reward, samples=[s])


GROUP = [traj("a", "g", 1.0), traj("b", "g", 0.0)]


# -- fakes at the edges ----------------------------------------------------------------------

class FakeNC:
    """Records what is published; `gate` answers sf.sched.gate requests (or raises)."""

    def __init__(self, gate=None):
        self.published: list[tuple[str, bytes, float]] = []
        self.gate = gate
        self.gate_requests: list[TrainGate] = []

    async def publish(self, subject, data):
        self.published.append((subject, data, time.monotonic()))

    async def request(self, subject, data, timeout):
        assert subject == subjects.SCHED_GATE
        self.gate_requests.append(decode(data, TrainGate))
        return await self.gate(timeout)

    def states(self) -> list[tuple[str, float]]:
        return [(decode(d, TrainerStatus).state, t) for s, d, t in self.published if s == subjects.TRAINER_STATUS]


class FakeRunner:
    """Runs commands in the caller's thread like the real one; `train` takes `train_s`."""

    world = 1
    cuda = False

    def __init__(self, train_s: float = 0.0):
        self.hosts: list[str] = []
        self.offloaded_hosts: set[str] = set()
        self.train_s = train_s
        self.log: list[tuple[str, float, float]] = []  # (op, start, end), monotonic
        self.train_started = threading.Event()

    def run(self, cmd: Command) -> dict:
        t0 = time.monotonic()
        if cmd.op == "train":
            self.train_started.set()
            time.sleep(self.train_s)
        self.log.append((cmd.op, t0, time.monotonic()))
        if cmd.op == "train":
            ids = sorted({t.session_id for g in decode_groups(cmd.batch) for t in g})
            return {"ids": ids, "metrics": {"compute_s": self.train_s, "tokens": 6.0}, "staleness": {}}
        return {f"{cmd.op}_s": 0.001}

    def ops(self) -> list[str]:
        return [op for op, _, _ in self.log]


def make_service(nc: FakeNC, runner: FakeRunner, **cfg) -> TrainerService:
    cfg = TrainerConfig(group_size=2, groups_per_step=1, publish_every=1000, checkpoint_every=1000,
                        tensorboard_dir="", audit_log="", metrics_port=0, **cfg)
    svc = TrainerService(cfg, Connections(), runner, None, vocab_size=64, metrics=Metrics(0, ""))
    svc.nc = nc
    return svc


def batch(svc: TrainerService, tag: str = ""):
    """One global batch, through the intake (the ledger must have admitted what a step trains);
    another `tag` for each further step (a session trains once)."""
    group = [traj(t.session_id + tag, t.group_id + tag, t.reward) for t in GROUP]
    for i, t in enumerate(group):
        svc.intake.offer(t, f"m{i}{tag}", 0.0)
    return svc.intake.take(1)


# -- status ------------------------------------------------------------------------------------

async def test_status_reports_the_intake_and_the_host():
    svc = make_service(FakeNC(), FakeRunner(), host="host-0")
    svc.intake.offer(GROUP[0], "m1", 0.0)
    svc.intake.offer(traj("c", "h", 1.0), "m2", 0.0)
    svc.intake.offer(GROUP[1], "m3", 0.0)
    st = svc.status()
    assert (st.state, st.ready_groups, st.open_groups, st.buffered_samples) == ("waiting", 1, 1, 3)
    assert (st.groups_per_step, st.group_size, st.hosts) == (1, 2, ["host-0"])
    assert make_service(FakeNC(), FakeRunner()).status().hosts == []


async def test_a_step_reports_computing_publishing_then_waiting():
    nc = FakeNC()
    svc = make_service(nc, FakeRunner(train_s=0.05))
    await svc._step(batch(svc), wait_s=0.5)
    assert [s for s, _ in nc.states()] == ["computing", "publishing", "waiting"]
    st = svc.status()
    assert (st.step, st.last_wait_s, st.last_compute_s) == (1, 0.5, 0.05)


# -- the gate ----------------------------------------------------------------------------------

async def test_with_the_gate_the_step_starts_after_the_grant():
    granted_at: list[float] = []

    async def scheduler(timeout):
        assert timeout > 1.0  # the gate's own timeout plus a grace
        await asyncio.sleep(0.3)  # reclaiming the hosts
        granted_at.append(time.monotonic())
        return SimpleNamespace(data=encode(TrainGateReply(granted=True, waited_s=0.3)))

    nc, runner = FakeNC(scheduler), FakeRunner()
    svc = make_service(nc, runner, scheduler_gate=True, gate_timeout=1.0, host="host-0")
    await svc._step(batch(svc), wait_s=0.0)
    assert nc.gate_requests == [TrainGate(step=1, timeout=1.0, hosts=["host-0"])]
    states = nc.states()
    assert [s for s, _ in states][:2] == ["ready", "computing"]
    assert states[0][1] < granted_at[0] <= states[1][1]
    [(op, start, _)] = runner.log
    assert op == "train" and start >= granted_at[0]
    assert svc.metrics._gauges["sf_trainer_last_gate_s"]._value.get() >= 0.3
    assert svc.metrics._gauges["sf_trainer_last_gate_granted"]._value.get() == 1.0


@pytest.mark.parametrize("answer, why", [
    (NoRespondersError(), "no scheduler answers on sf.sched.gate"),
    (NatsTimeout(), "no answer within"),
    (TrainGateReply(granted=False, reason="host-0 failed to switch"), "refused: host-0 failed to switch"),
])
async def test_without_a_grant_the_step_logs_why_and_computes_anyway(answer, why, caplog):
    async def scheduler(timeout):
        if isinstance(answer, Exception):
            raise answer
        return SimpleNamespace(data=encode(answer))

    nc, runner = FakeNC(scheduler), FakeRunner()
    svc = make_service(nc, runner, scheduler_gate=True, gate_timeout=1.0)
    with caplog.at_level(logging.WARNING, logger="services.trainer.service"):
        await svc._step(batch(svc), wait_s=0.0)
    assert runner.ops() == ["train"] and svc.step == 1
    assert any("gate not granted" in r.message and why in r.message for r in caplog.records), caplog.text
    assert svc.metrics._gauges["sf_trainer_last_gate_granted"]._value.get() == 0.0


async def test_in_a_leader_change_the_gate_asks_the_next_leader_before_computing(monkeypatch):
    """Issue 30: the leading scheduler died (no responder) and a standby leads a few seconds later;
    the step must not compute in the gap, beside a host that may still be lent."""
    monkeypatch.setattr(service_mod, "LEADER_GAP_RETRY", 0.05)  # the retries' cadence; 0.25 s in service
    answers = iter([TrainGateReply(granted=True), NoRespondersError(), NoRespondersError(),
                    TrainGateReply(granted=True, waited_s=0.1)])

    async def scheduler(timeout):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return SimpleNamespace(data=encode(answer))

    nc, runner = FakeNC(scheduler), FakeRunner()
    svc = make_service(nc, runner, scheduler_gate=True, gate_timeout=1.0)
    await svc._step(batch(svc), wait_s=0.0)  # step 1: granted by the first leader
    await svc._step(batch(svc, "2"), wait_s=0.0)  # step 2: nobody, nobody, then the standby grants
    assert [r.step for r in nc.gate_requests] == [1, 2, 2, 2]
    assert runner.ops() == ["train", "train"]
    assert svc.metrics._gauges["sf_trainer_last_gate_granted"]._value.get() == 1.0


async def test_a_gate_the_dead_leader_took_is_asked_again_of_the_next_leader():
    """The leader took the gate request and died: no answer would come before the request's timeout
    (here 6 s); the standby's announcement of a newer term (sf.sched.leader) has it asked again at once."""
    from shared.messages.scheduler import SchedulerLeader

    asked = asyncio.Event()

    async def scheduler(timeout):
        if len(nc.gate_requests) == 1:  # the first leader: takes it, never answers
            asked.set()
            await asyncio.sleep(timeout)
            raise NatsTimeout()
        return SimpleNamespace(data=encode(TrainGateReply(granted=True)))

    nc, runner = FakeNC(scheduler), FakeRunner()
    svc = make_service(nc, runner, scheduler_gate=True, gate_timeout=1.0)
    await svc._on_leader(SimpleNamespace(data=encode(SchedulerLeader(term=1, instance="a-1")), reply=""))
    step = asyncio.create_task(svc._step(batch(svc), wait_s=0.0))
    await asyncio.wait_for(asked.wait(), 5)
    t0 = time.monotonic()
    await svc._on_leader(SimpleNamespace(data=encode(SchedulerLeader(term=1, instance="a-1")), reply=""))  # a beat
    await asyncio.sleep(0.1)
    assert not step.done() and len(nc.gate_requests) == 1  # the same leader's beat changes nothing
    await svc._on_leader(SimpleNamespace(data=encode(SchedulerLeader(term=2, instance="b-2")), reply=""))
    await asyncio.wait_for(step, 5)
    assert time.monotonic() - t0 < 1.0 and len(nc.gate_requests) == 2
    assert runner.ops() == ["train"]
    assert svc.metrics._gauges["sf_trainer_last_gate_granted"]._value.get() == 1.0


async def test_a_leader_gap_is_bounded_then_the_fallback_applies(caplog, monkeypatch):
    monkeypatch.setattr(service_mod, "LEADER_GAP_RETRY", 0.05)  # several retries inside the 0.3 s gap
    calls = []

    async def scheduler(timeout):
        calls.append(time.monotonic())
        if len(calls) == 1:
            return SimpleNamespace(data=encode(TrainGateReply(granted=True)))
        raise NoRespondersError()

    nc, runner = FakeNC(scheduler), FakeRunner()
    svc = make_service(nc, runner, scheduler_gate=True, gate_timeout=1.0, gate_leader_gap=0.3)
    await svc._step(batch(svc), wait_s=0.0)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="services.trainer.service"):
        await svc._step(batch(svc, "2"), wait_s=0.0)
    assert 0.3 <= time.monotonic() - t0 < 3.0 and len(calls) >= 3
    assert runner.ops() == ["train", "train"]  # on CPU the fallback computes, saying why
    assert any("gate not granted" in r.message and "no scheduler answers" in r.message for r in caplog.records)


async def test_without_the_gate_setting_nothing_is_asked():
    nc = FakeNC(gate=None)
    svc = make_service(nc, FakeRunner())
    await svc._step(batch(svc), wait_s=0.0)
    assert nc.gate_requests == [] and "ready" not in [s for s, _ in nc.states()]


# -- offload / reload --------------------------------------------------------------------------

async def test_offload_waits_for_the_step_in_progress_and_answers_with_a_status():
    nc, runner = FakeNC(), FakeRunner(train_s=0.3)
    svc = make_service(nc, runner)
    step = asyncio.create_task(svc._step(batch(svc), wait_s=0.0))
    await asyncio.to_thread(runner.train_started.wait, 5)
    msg = SimpleNamespace(data=encode(TrainerControl(op="offload", host="host-0")), reply="_INBOX.x")
    await svc._on_control(msg)
    await step
    assert runner.ops() == ["train", "offload"]
    (_, _, train_end), (_, offload_start, _) = runner.log
    assert offload_start >= train_end
    [(subject, data, _)] = [p for p in nc.published if p[0] == "_INBOX.x"]
    assert decode(data, TrainerStatus).step == 1
    assert "sf_trainer_last_offload_s" in svc.metrics._gauges


async def test_a_bad_control_request_still_gets_a_status():
    nc, runner = FakeNC(), FakeRunner()
    svc = make_service(nc, runner)
    await svc._on_control(SimpleNamespace(data=b"\x81\xa2op\xa4nuke", reply="_INBOX.y"))
    assert runner.ops() == [] and [p[0] for p in nc.published] == ["_INBOX.y"]


# -- the runner and the engine -----------------------------------------------------------------

def test_offload_support_names_why_not():
    zero = SimpleNamespace(offload_states=lambda: None)
    assert offload_support("cuda", 2, zero) == "" and offload_support("cuda", 3, zero) == ""
    assert "stage 0" in offload_support("cuda", 0, zero)
    assert "nothing to free on cpu" == offload_support("cpu", 3, zero)
    assert "has no offload_states" in offload_support("cuda", 1, object())


class FakeEngine:
    rank, world, pad_id = 0, 1, 0

    def __init__(self):
        self.cfg = TrainerConfig()
        self.algo = self.cfg.algo()
        self.offloaded = False
        self.calls: list[str] = []

    def offload(self):
        self.calls.append("offload")
        self.offloaded = True
        return {"offload_s": 0.01}

    def reload(self):
        self.calls.append("reload")
        self.offloaded = False
        return {"reload_s": 0.02}

    def train_step(self, batches):
        assert not self.offloaded, "a step ran on offloaded states"
        self.calls.append("train")
        return {"compute_s": 0.0}


def test_runner_offloads_and_reloads_and_never_trains_offloaded(tmp_path):
    engine = FakeEngine()
    runner = Runner(engine, tmp_path)
    assert runner.run(Command("offload")) == {"offload_s": 0.01}
    out = runner.run(Command("train", step=1, batch=encode_groups([GROUP])))
    assert engine.calls == ["offload", "reload", "train"] and out["reload_s"] == 0.02
    assert runner.run(Command("offload")) and runner.run(Command("reload")) == {"reload_s": 0.02}
    out = runner.run(Command("train", step=2, batch=encode_groups([GROUP])))
    assert "reload_s" not in out and engine.calls[-1] == "train"


# -- across hosts: one host's ranks, the gate fallback ----------------------------------------

class HostEngine(FakeEngine):
    """One rank of a multi-host trainer: `rank` on `rank_hosts[rank]`."""

    def __init__(self, rank: int, rank_hosts: list[str]):
        super().__init__()
        self.rank, self.world, self.rank_hosts = rank, len(rank_hosts), rank_hosts


def test_rank_to_host_mapping_and_scoping():
    from services.trainer.runner import control_scope, hosts_of, ranks_on

    rank_hosts = ["host-1", "host-1", "host-2", "host-2"]
    assert hosts_of(rank_hosts) == ["host-1", "host-2"]
    assert ranks_on(rank_hosts, "host-2") == [2, 3] and ranks_on(rank_hosts, "") == [0, 1, 2, 3]
    assert control_scope(["host-1", "host-2"], "host-2") == ("host-2", "")
    scope, note = control_scope(["host-1", "host-2"], "host-9")
    assert ranks_on(rank_hosts, scope) == [] and "nothing to do" in note  # never the wrong host's devices
    assert control_scope(["box"], "host-0")[0] == ""  # a single-host trainer that names no host: every rank
    assert control_scope([], "host-0")[0] == ""


def test_offload_and_reload_act_on_that_hosts_ranks_only(tmp_path):
    rank_hosts = ["host-1", "host-2"]
    ranks = [Runner(HostEngine(r, rank_hosts), tmp_path) for r in range(2)]
    for runner in ranks:  # what each rank does with the broadcast command
        runner.execute(Command("offload", host="host-2"))
    assert [r.engine.calls for r in ranks] == [[], ["offload"]]
    for runner in ranks:
        runner.execute(Command("reload", host="host-1"))  # host-1's rank (the engine's reload is idempotent)
    assert [r.engine.calls for r in ranks] == [["reload"], ["offload"]] and ranks[1].engine.offloaded
    ranks[1].execute(Command("reload", host="host-2"))
    assert ranks[1].engine.calls == ["offload", "reload"] and not ranks[1].engine.offloaded
    assert ranks[0].engine.calls == ["reload"]


def test_rank0_tracks_which_hosts_are_offloaded(tmp_path, monkeypatch):
    import services.trainer.runner as runner_mod

    monkeypatch.setattr(runner_mod.dist, "broadcast_object_list", lambda box, src: None)
    runner = Runner(HostEngine(0, ["host-1", "host-2"]), tmp_path)
    assert runner.hosts == ["host-1", "host-2"]
    runner.run(Command("offload", host="host-2"))
    assert runner.offloaded_hosts == {"host-2"} and runner.engine.calls == []  # rank 0 is on host-1
    runner.run(Command("offload", host="host-1"))
    assert runner.offloaded_hosts == {"host-1", "host-2"}
    runner.run(Command("reload", host="host-2"))
    assert runner.offloaded_hosts == {"host-1"}
    runner.run(Command("train", step=1, batch=encode_groups([GROUP])))
    assert runner.offloaded_hosts == set() and runner.engine.calls == ["offload", "reload", "train"]


async def test_status_and_control_carry_every_ranks_host():
    nc, runner = FakeNC(), FakeRunner()
    runner.hosts, runner.offloaded_hosts = ["host-1", "host-2"], {"host-2"}
    sent: list[Command] = []
    run = runner.run
    runner.run = lambda cmd: (sent.append(cmd), run(cmd))[1]
    svc = make_service(nc, runner, host="host-1")
    st = svc.status()
    assert st.hosts == ["host-1", "host-2"] and st.offloaded == ["host-2"]
    await svc._on_control(SimpleNamespace(data=encode(TrainerControl(op="offload", host="host-2")), reply=""))
    assert sent[-1].host == "host-2"


@pytest.mark.parametrize("fallback, cuda, waits", [
    ("auto", True, True), ("auto", False, False), ("wait", False, True), ("compute", True, False)])
def test_gate_fallback_by_device(fallback, cuda, waits):
    runner = FakeRunner()
    runner.cuda = cuda
    assert make_service(FakeNC(), runner, gate_fallback=fallback).gate_waits() is waits


async def test_on_cuda_an_ungranted_gate_waits_and_never_computes(caplog, monkeypatch):
    monkeypatch.setattr(service_mod, "GATE_RETRY", 0.05)  # the waits between asks; 1 s in service
    answers = [NatsTimeout(), NoRespondersError(), TrainGateReply(granted=True)]

    async def scheduler(timeout):
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return SimpleNamespace(data=encode(a))

    nc, runner = FakeNC(scheduler), FakeRunner()
    runner.cuda = True
    svc = make_service(nc, runner, scheduler_gate=True, gate_timeout=1.0)
    with caplog.at_level(logging.WARNING, logger="services.trainer.service"):
        await svc._step(batch(svc), wait_s=0.0)
    assert len(nc.gate_requests) == 3 and runner.ops() == ["train"]
    waiting = [r.message for r in caplog.records if "waiting, not computing" in r.message]
    assert len(waiting) == 2, caplog.text
    assert svc.metrics._gauges["sf_trainer_last_gate_granted"]._value.get() == 1.0


async def test_a_quit_while_waiting_for_the_gate_trains_nothing():
    async def scheduler(timeout):
        raise NoRespondersError()

    nc, runner = FakeNC(scheduler), FakeRunner()
    svc = make_service(nc, runner, scheduler_gate=True, gate_timeout=1.0, gate_fallback="wait")
    svc._quit = asyncio.Event()
    asyncio.get_running_loop().call_later(0.3, svc._quit.set)
    await svc._step(batch(svc), wait_s=0.0)
    assert runner.ops() == [] and svc.step == 0


# -- lending needs an offload ------------------------------------------------------------------

def test_lending_at_zero_stage_0_on_cuda_is_refused_at_start(monkeypatch):
    import services.trainer.engine as engine_mod
    from services.trainer.engine import LendingUnsupported, TrainEngine, lending_refusal

    assert "ZeRO stage 0" in lending_refusal("cuda", 0, True) and "SF_TRAINER_ZERO_STAGE" in lending_refusal(
        "cuda", 0, True)
    assert lending_refusal("cuda", 2, True) == "" and lending_refusal("cuda", 0, False) == ""
    assert lending_refusal("cpu", 0, True) == ""  # nothing to free on CPU: lending there is fine
    monkeypatch.setattr(engine_mod, "get_accelerator", lambda: SimpleNamespace(device_name=lambda: "cuda"))
    monkeypatch.setattr(engine_mod, "init_distributed", lambda: pytest.fail("refused after starting"))
    with pytest.raises(LendingUnsupported, match="stage 0"):
        TrainEngine(TrainerConfig(zero_stage=0, scheduler_gate=True))


# -- catch-up rounds (weights over the network) --------------------------------------------------

class SendingRunner(FakeRunner):
    """A runner whose `send` reports that every expected receiver joined."""

    sender = SimpleNamespace(port=29500)

    def run(self, cmd: Command) -> dict:
        if cmd.op != "send":
            return super().run(cmd)
        self.log.append((f"send {cmd.group} to {cmd.receivers}", time.monotonic(), time.monotonic()))
        return {"join_s": 0.0, "send_s": 0.0, "sent_bytes": 1, "receivers": cmd.receivers}


def fetch(worker: str, reply: str) -> SimpleNamespace:
    return SimpleNamespace(data=encode(WeightsWanted(worker, 3)), reply=reply, subject=subjects.WEIGHTS_FETCH)


async def test_workers_that_ask_while_the_device_is_busy_share_one_catch_up_round():
    nc, runner = FakeNC(), SendingRunner()
    svc = make_service(nc, runner)
    svc.version = svc._weights_are = 3
    async with svc._device:  # a step runs: three asks (one twice) wait for the device
        for worker, reply in (("w1", "_INBOX.a"), ("w2", "_INBOX.b"), ("w1", "_INBOX.c")):
            await svc._on_fetch(fetch(worker, reply))
    await asyncio.wait_for(asyncio.gather(*svc._catch_ups), 5)
    [send] = [op for op in runner.ops() if op.startswith("send")]
    assert send.endswith(" to 2")  # two workers: the round waits for two joins, not three
    offers = {s: decode(d, WeightsPublished) for s, d, _ in nc.published if s.startswith("_INBOX")}
    assert set(offers) == {"_INBOX.a", "_INBOX.b", "_INBOX.c"}
    assert {o.transfer.group for o in offers.values()} == {send.split()[1]} and offers["_INBOX.a"].version == 3
    await svc._on_fetch(fetch("w3", "_INBOX.d"))  # after the round, a new ask gets a round of its own
    await asyncio.wait_for(asyncio.gather(*svc._catch_ups), 5)
    assert [op.split()[-1] for op in runner.ops() if op.startswith("send")] == ["2", "1"]
