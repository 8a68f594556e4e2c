"""services/rollout/service.py's control operations under the tag scheduler, against the real
Engine on a fake vLLM (tests/unit/test_rollout_engine.py's FakeLLM) and a fake NATS client
that records what is published: the service and engine code stay real."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from services.rollout import engine as engine_mod
from services.rollout.config import RolloutConfig
from services.rollout.engine import Engine
from services.rollout.service import RolloutService
from shared import subjects
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages.rollout import Generate, GenerateDone, RolloutControl, Sampling, TokenDelta, WorkerStatus
from shared.messages.weights import WeightsPublished
from tests.unit.test_rollout_engine import FakeLLM, write_ckpt


class FakeNC:
    def __init__(self):
        self.sent: list[tuple[str, object, float]] = []  # (subject, decoded message, monotonic time)

    async def publish(self, subject, data):
        tp = WorkerStatus if subject == subjects.ROLLOUT_STATUS or subject.startswith("_INBOX.ctl") else \
            TokenDelta | GenerateDone
        self.sent.append((subject, decode(data, tp), time.monotonic()))

    def statuses(self) -> list[tuple[WorkerStatus, float]]:
        return [(m, t) for s, m, t in self.sent if s == subjects.ROLLOUT_STATUS]

    def done(self, inbox: str) -> GenerateDone:
        [d] = [m for s, m, _ in self.sent if s == inbox and isinstance(m, GenerateDone)]
        return d


@pytest.fixture
def make(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_mod, "_vllm_request", lambda ids, kw: (ids, kw))
    model = write_ckpt(tmp_path / "model")

    async def make(llm=None, **cfg) -> RolloutService:
        cfg = RolloutConfig(model=str(model), worker_id="w", **cfg)
        engine = Engine(cfg, llm or FakeLLM())
        await engine.start(warmup=False)
        svc = RolloutService(cfg, Connections(), engine=engine)
        svc.nc = FakeNC()
        return svc
    return make


def start(svc: RolloutService, rid: str, max_tokens: int = 10_000, hold_s: float = 0.0) -> asyncio.Task:
    """A Generate as service._on_generate starts it; its replies go to inbox `rid`."""
    req = Generate(rid, [1, 2, 3], Sampling(max_tokens=max_tokens), hold_s=hold_s)
    task = asyncio.create_task(svc._generate(req, rid))
    svc.tasks[rid] = task
    task.add_done_callback(lambda t: svc.tasks.pop(rid, None))
    return task


async def control(svc: RolloutService, **ctl) -> WorkerStatus:
    inbox = f"_INBOX.ctl.{len(svc.nc.sent)}"
    await svc._control(SimpleNamespace(data=encode(RolloutControl(**ctl)), reply=inbox))
    [reply] = [m for s, m, _ in svc.nc.sent if s == inbox]
    return reply


async def test_a_vacate_publishes_its_status_before_waiting_for_in_flight_requests(make):
    svc = await make()
    slow_end = asyncio.Event()
    real_pause = svc.engine.pause_abort_all

    async def slow_pause():  # in-flight requests take a while to end (a slow engine, a long sweep)
        await asyncio.sleep(0.3)
        await real_pause()
        slow_end.set()

    svc.engine.pause_abort_all = slow_pause
    task = start(svc, "r1")
    await asyncio.sleep(0.02)
    reply = await control(svc, op="vacate", scheduled=True)
    assert reply.state == "vacated" and task.done()
    first_vacated = next(t for st, t in svc.nc.statuses() if st.state == "vacated")
    ended = next(t for s, m, t in svc.nc.sent if s == "r1" and isinstance(m, GenerateDone))
    assert first_vacated < ended  # routers heard it before the requests were over


async def test_held_tokens_go_out_merged_and_all_before_the_end(make):
    # Generate.hold_s (an agent that does not stream): the tokens held and merged, the first ones too;
    # a vacate mid-request sends everything held with its GenerateDone: no token is lost
    svc = await make()
    start(svc, "held", hold_s=60.0)
    start(svc, "each")
    await asyncio.sleep(0.1)
    await control(svc, op="vacate", scheduled=True)
    for rid in ("held", "each"):
        replies = [m for s, m, _ in svc.nc.sent if s == rid]
        assert isinstance(replies[-1], GenerateDone) and replies[-1].finish_reason == "preempted"
        deltas = replies[:-1]
        assert all(isinstance(m, TokenDelta) for m in deltas)
        if rid == "held":
            # all that was held, merged, riding on the GenerateDone: one message
            assert len(deltas) == 0 and replies[-1].tail_ids and len(replies[-1].tail_logprobs) == len(replies[-1].tail_ids)
            held_ids = [t for m in deltas for t in m.token_ids] + replies[-1].tail_ids
        else:
            each_ids = [t for m in deltas for t in m.token_ids]
            assert len(deltas) > 2 and not replies[-1].tail_ids
    assert len(held_ids) + len(each_ids) == svc.generated_tokens  # every token the engine made went out


async def test_scheduled_vacates_mark_their_preemptions(make):
    svc = await make()
    start(svc, "r1")
    await asyncio.sleep(0.02)
    await control(svc, op="vacate", scheduled=True)
    d = svc.nc.done("r1")
    assert d.finish_reason == "preempted" and d.scheduled
    # a request that arrives while vacated is turned away the same way
    await start(svc, "r2")
    assert svc.nc.done("r2").scheduled
    await control(svc, op="resume")
    # an operator's vacate (or an abort) is not the scheduler's
    start(svc, "r3")
    await asyncio.sleep(0.02)
    await control(svc, op="vacate")
    assert svc.nc.done("r3").finish_reason == "preempted" and not svc.nc.done("r3").scheduled
    await control(svc, op="resume")
    start(svc, "r4")
    await asyncio.sleep(0.02)
    await control(svc, op="abort", request_id="r4")
    assert svc.nc.done("r4").finish_reason == "preempted" and not svc.nc.done("r4").scheduled


async def test_sleep_wake_and_the_lend_sequence(make, tmp_path):
    llm = FakeLLM()
    svc = await make(llm, start_vacated=True)
    assert svc.state() == "vacated"  # the host agent's worker waits for its assignment
    st = await control(svc, op="sleep", scheduled=True)
    assert st.state == "sleeping"
    # no weights into a sleeping engine: the reply still shows the old version
    v1 = write_ckpt(tmp_path / "weights" / "v000001")
    st = await control(svc, op="load", version=1, path=str(v1))
    assert st.version == 0 and st.state == "sleeping" and not any(c[0] == "rpc" for c in llm.calls)
    # lend: wake, load, resume
    until = time.time() + 30
    assert (await control(svc, op="wake")).state == "vacated"
    assert (await control(svc, op="load", version=1, path=str(v1))).version == 1
    st = await control(svc, op="resume", lent_until=until)
    assert (st.state, st.version, st.lent_until) == ("serving", 1, until)
    # reclaim: the lend is over
    st = await control(svc, op="vacate", scheduled=True)
    assert st.lent_until == 0.0


async def test_sleep_keep_holds_requests_in_place_until_wake(make):
    svc = await make()
    task = start(svc, "r1", max_tokens=60)
    await asyncio.sleep(0.02)
    st = await control(svc, op="sleep", keep=True)
    assert st.state == "sleeping" and st.running == 1 and not task.done()
    await asyncio.sleep(0.05)
    assert not task.done()
    assert (await control(svc, op="wake")).state == "serving"
    await asyncio.wait_for(task, 5)
    d = svc.nc.done("r1")
    assert d.finish_reason == "length" and not d.scheduled


async def test_the_weight_follower_never_loads_into_a_sleeping_engine(make, tmp_path):
    llm = FakeLLM()
    svc = await make(llm)
    v2 = write_ckpt(tmp_path / "weights" / "v000002")
    await control(svc, op="sleep")
    await svc._on_newest_weights(WeightsPublished(version=2, path=str(v2), published_at=0.0))
    assert svc.engine.version == 0 and not any(c[0] == "rpc" for c in llm.calls)
    await control(svc, op="wake")
    await svc._on_newest_weights(WeightsPublished(version=2, path=str(v2), published_at=0.0))
    assert svc.engine.version == 2
