"""Malformed bus messages (shared/deadletter.py) against real NATS and Redis: garbage on every
subject the trajectory manager, a rollout worker, the trainer and the scheduler consume.

Two kinds of garbage go to each subject: random bytes, and a valid message of another type (a
TrainGateReply, which no subscription reads). Afterwards every service

- is still running and answers a normal request (and a request got its protocol's error reply);
- counted each one in sf_bus_malformed_total{service, subject pattern} on its /metrics;
- copied what JetStream stored (sf.traj.completed, sf.weights.published) to the DEAD stream,
  which `seamlessflow dead list --json` shows; the trainer's consumer went past its garbage.

The services run in this process, as their `run()` coroutines, against a private nats-server (the
trainer consumes the whole TRAJECTORIES stream and DEAD must hold only this test's letters). Only
the edges are stand-ins: the trainer's Runner (no DeepSpeed: the bus is the subject) and the rollout
worker's engine (services/rollout/simulated.py, SIMULATED, inside the real RolloutService).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from seamlessflow.stack import servers
from services.rollout.config import RolloutConfig
from services.rollout.service import RolloutService
from services.rollout.simulated import SimulatedEngine
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService
from services.trainer.config import TrainerConfig
from services.trainer.metrics import Metrics
from services.trainer.service import TrainerService
from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import TrajectoryService
from shared import bus, deadletter, subjects
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages import (
    ChatFailed,
    ChatReply,
    Generate,
    GenerateDone,
    RolloutReply,
    Sampling,
    SchedulerControl,
    SchedulerReply,
    SessionReply,
    SessionRequest,
    TrainerControl,
    TrainerStatus,
    TrainGateReply,
    WorkerStatus,
)
from shared.messages.trajectory import Sample, TrajectoryCompleted

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WORKER = "w-malformed"
DURABLE = "trainer-malformed"
RANDOM = random.Random(11).randbytes(64)
WRONG = encode(TrainGateReply(True, 0.0, "a reply, not a request"))
GARBAGE = (RANDOM, WRONG)

# what each service consumes, by the pattern its metric is labelled with
CONSUMED = {
    "trajectory": [subjects.CHAT, subjects.session_op("*"), subjects.CHAT_CANCEL, subjects.ROLLOUT_STATUS,
                   subjects.WEIGHTS_PUBLISHED, subjects.TRAINER_STATUS],
    "rollout": [subjects.rollout_gen("*"), subjects.rollout_ctl("*"), subjects.WEIGHTS_PUBLISHED],
    "trainer": [subjects.TRAJ_COMPLETED, subjects.ROLLOUT_STATUS, subjects.TRAINER_CTL],
    "scheduler": [subjects.SCHED_HOST, subjects.SCHED_CHANGED, subjects.ROLLOUT_STATUS, subjects.TRAINER_STATUS,
                  subjects.WEIGHTS_PUBLISHED, subjects.SCHED_GATE, subjects.SCHED_CTL],
}
STORED = {"trainer": [subjects.TRAJ_COMPLETED],
          **{s: [subjects.WEIGHTS_PUBLISHED] for s in ("trajectory", "rollout", "scheduler")}}


class FakeRunner:
    """The trainer's engine edge: offload/reload answer at once; nothing here trains."""

    world = 1

    def run(self, cmd) -> dict:
        return {f"{cmd.op}_s": 0.001}


def simulated_engine():
    return SimulatedEngine(capacity=4, step_ms=1.0)


def scrape(port: int) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.labels["service"], s.labels["subject"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == f"{deadletter.METRIC}_total"}


async def until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        await asyncio.sleep(0.1)


@pytest.fixture
async def nats(tmp_path):
    port = servers.free_port()
    proc = servers.start_nats(port, tmp_path / "nats")
    yield f"nats://127.0.0.1:{port}"
    servers.stop(proc)


async def test_garbage_on_every_consumed_subject(nats, redis_url, tiny_model, tmp_path):
    # a database of its own: the scheduler must not restore hosts another module left behind
    conn = Connections(nats_url=nats, redis_url=redis_url.rsplit("/", 1)[0] + "/11")
    ports = {name: servers.free_port() for name in CONSUMED}
    quit = asyncio.Event()
    traj_ready, sched_ready = asyncio.Event(), asyncio.Event()
    trainer = TrainerService(
        TrainerConfig(durable=DURABLE, group_size=2, groups_per_step=1, ack_wait=5.0, fetch_timeout=0.3,
                      weights_dir=str(tmp_path / "weights"), tensorboard_dir="", audit_log="", metrics_port=0),
        conn, FakeRunner(), None, vocab_size=64, metrics=Metrics(ports["trainer"]))
    services = {
        "trajectory": TrajectoryService(TrajectoryConfig(model=str(tiny_model), trainer_consumer=DURABLE,
                                                         metrics_port=ports["trajectory"]), conn).run(quit, traj_ready),
        "rollout": RolloutService(RolloutConfig(model=str(tiny_model), worker_id=WORKER, status_interval=0.5,
                                                metrics_port=ports["rollout"]), conn, simulated_engine()).run(quit),
        "trainer": trainer.run(quit),
        "scheduler": SchedulerService(SchedulerConfig(metrics_port=ports["scheduler"]), conn).run(quit, sched_ready),
    }
    tasks = {name: asyncio.create_task(coro, name=name) for name, coro in services.items()}
    nc = await bus.connect(conn, name="garbage")
    js = nc.jetstream()
    try:
        # 1. every service up: the trainer's consumer exists, the worker beats
        seen: list[WorkerStatus] = []

        async def on_status(msg):
            try:
                seen.append(decode(msg.data, WorkerStatus))
            except Exception:
                pass
        await nc.subscribe(subjects.ROLLOUT_STATUS, cb=on_status)

        async def up():
            assert not any(t.done() for t in tasks.values()), {n: t for n, t in tasks.items() if t.done()}
            try:
                await js.consumer_info(subjects.TRAJECTORIES_STREAM, DURABLE)
            except Exception:
                return False
            return traj_ready.is_set() and sched_ready.is_set() and any(s.worker_id == WORKER for s in seen)
        await until(up, 30, "services ready")

        # 2. garbage, twice on each subject: requests expect their protocol's error, the rest is fire and forget
        async def ask(subject: str, data: bytes) -> bytes:
            return (await nc.request(subject, data, timeout=5)).data

        for data in GARBAGE:
            assert isinstance(decode(await ask(subjects.CHAT, data), ChatReply), ChatFailed)
            assert decode(await ask(subjects.session_op("create"), data), SessionReply).status == 400
            done = decode(await ask(subjects.rollout_gen(WORKER), data), RolloutReply)
            assert isinstance(done, GenerateDone) and done.finish_reason == "error" and done.code == "bad_request"
            assert decode(await ask(subjects.rollout_ctl(WORKER), data), WorkerStatus).worker_id == WORKER
            decode(await ask(subjects.TRAINER_CTL, data), TrainerStatus)
            assert not decode(await ask(subjects.SCHED_GATE, data), TrainGateReply).granted
            assert not decode(await ask(subjects.SCHED_CTL, data), SchedulerReply).ok
            for subject in (subjects.CHAT_CANCEL, subjects.ROLLOUT_STATUS, subjects.SCHED_HOST,
                            subjects.SCHED_CHANGED, subjects.TRAINER_STATUS):
                await nc.publish(subject, data)
            await js.publish(subjects.TRAJ_COMPLETED, data, timeout=5)
            await js.publish(subjects.WEIGHTS_PUBLISHED, data, timeout=5)
        await nc.flush()

        # 3. counted, per service and subject pattern, on each one's /metrics
        expected = {(svc, subject): float(len(GARBAGE)) for svc, subs in CONSUMED.items() for subject in subs}

        async def counted():
            got = {}
            for svc, port in ports.items():
                got.update(await asyncio.to_thread(scrape, port))
            return got if got == expected else None
        await until(counted, 15, f"the counts {expected}")

        # 4. what JetStream stored is in DEAD, once per service and message; the trainer's consumer moved on
        want = sorted((svc, subject) for svc, subs in STORED.items() for subject in subs for _ in GARBAGE)

        async def dead():
            letters = await deadletter.recent(js, 50)
            return letters if sorted((d.service, d.subject) for d in letters) == want else None
        letters = await until(dead, 15, "the dead letters")
        assert all(d.error and d.time > 0 and d.size in (len(RANDOM), len(WRONG)) for d in letters)

        async def consumer_info():
            return await js.consumer_info(subjects.TRAJECTORIES_STREAM, DURABLE)

        async def settled():
            i = await consumer_info()
            return i.num_pending == 0 and i.num_ack_pending == 0
        await until(settled, 10, "the garbage terminated")
        sample = Sample([5, 6, 7, 8], [0, 1, 1, 1], [0.0, -1.0, -1.0, -1.0], [-1, 0, 0, 0])
        await bus.publish_durable(js, subjects.TRAJ_COMPLETED, TrajectoryCompleted("s0", "g0", 1.0, [sample]), "s0")

        async def delivered():  # held with its incomplete group: delivered, not blocked behind the garbage
            i = await consumer_info()
            return i.num_pending == 0 and i.num_ack_pending == 1
        await until(delivered, 10, "a good trajectory delivered after the garbage")

        # 5. everyone still serves a normal request
        created = decode(await ask(subjects.session_op("create"), encode(SessionRequest(op="create"))), SessionReply)
        assert created.status == 200, created
        gen = Generate("r1", [5, 6, 7], Sampling(max_tokens=2))
        async with bus.stream_request(nc, subjects.rollout_gen(WORKER), encode(gen), 5, 5) as replies:
            async for data in replies:
                if isinstance(reply := decode(data, RolloutReply), GenerateDone):
                    assert reply.finish_reason == "length", reply
                    break
        assert decode(await ask(subjects.TRAINER_CTL, encode(TrainerControl(op="offload"))), TrainerStatus)
        assert decode(await ask(subjects.SCHED_CTL, encode(SchedulerControl(op="status"))), SchedulerReply).ok
        assert not any(t.done() for t in tasks.values())

        # 6. the operator's view
        env = {k: v for k, v in os.environ.items() if not k.startswith("SF_")} | {"SF_NATS_URL": nats}
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "seamlessflow", "dead", "list", "--json",
                                                       "--limit", "50"], cwd=ROOT, env=env, capture_output=True,
                                      text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        listed = json.loads(out.stdout)
        assert sorted((d["service"], d["subject"]) for d in listed) == want
        assert {"time", "service", "subject", "error", "size"} <= set(listed[0])
        assert await deadletter.purge(js) == len(want) and await deadletter.recent(js) == []  # `dead purge`
    finally:
        quit.set()
        done, pending = await asyncio.wait(tasks.values(), timeout=30)
        for t in pending:
            t.cancel()
        await nc.close()
    for t in done:
        t.result()  # a service that crashed says how
