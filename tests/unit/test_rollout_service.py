"""services/rollout/service.py's control operations under the tag scheduler, against the real
Engine on a fake vLLM (tests/unit/test_rollout_engine.py's FakeLLM) and a fake NATS client
that records what is published: the service and engine code stay real."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from services.rollout import engine as engine_mod
from services.rollout import refill
from services.rollout.config import RolloutConfig
from services.rollout.engine import Engine
from services.rollout.service import RolloutService
from shared import subjects
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages.rollout import Generate, GenerateDone, RolloutControl, Sampling, TokenDelta, WorkerStatus
from shared.messages.weights import WeightsPublished, WeightsWanted, WeightTransfer
from tests.unit.test_rollout_engine import FakeLLM, write_ckpt


class FakeNC:
    def __init__(self):
        self.sent: list[tuple[str, object, float]] = []  # (subject, decoded message, monotonic time)
        self.asked: list[tuple[WeightsWanted, float]] = []  # sf.weights.fetch requests, with their timeout
        # the trainer's side of sf.weights.fetch: WeightsWanted -> WeightsPublished, or raises (no reply)
        self.trainer = None

    async def request(self, subject, data, timeout=None):
        assert subject == subjects.WEIGHTS_FETCH
        want = decode(data, WeightsWanted)
        self.asked.append((want, timeout))
        if self.trainer is None:
            raise TimeoutError("nats: timeout")
        return SimpleNamespace(data=encode(self.trainer(want)))

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
    # a router's rebalance (an abort with scheduled) moves one request: marked, the others untouched
    start(svc, "r5")
    start(svc, "r6")
    await asyncio.sleep(0.02)
    await control(svc, op="abort", request_id="r5", scheduled=True)
    assert svc.nc.done("r5").finish_reason == "preempted" and svc.nc.done("r5").scheduled
    assert "r6" in svc.tasks and not svc._moved


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


def round_of_own(version: int):
    """The trainer's catch-up: a round of one for the asking worker."""
    return lambda want: WeightsPublished(version, "", 0.0, 0, WeightTransfer("10.0.0.1", 29500, f"c-{want.worker_id}"))


async def network_worker_asleep(make, llm) -> RolloutService:
    """A GPU worker (vLLM sleep level 2) that received version 1 over the network, then slept (a reclaim)."""
    svc = await make(llm)
    svc.engine.gpu_sleep = True
    await svc._on_newest_weights(WeightsPublished(1, "", 0.0, 0, WeightTransfer("10.0.0.1", 29500, "v1")))
    assert svc.engine.version == 1 and svc.engine.served_path is None
    assert (await control(svc, op="sleep", scheduled=True)).state == "sleeping"
    return svc


async def test_a_wake_after_a_network_receive_fetches_the_version_before_serving(make):
    llm = FakeLLM()
    svc = await network_worker_asleep(make, llm)
    svc.nc.trainer = round_of_own(1)
    slept = len(llm.calls)
    st = await control(svc, op="wake")  # the lend: wake, (no load: no path), resume
    [(want, timeout)] = svc.nc.asked
    assert (want.worker_id, want.version) == ("w", 1) and timeout == refill.WAIT
    tail = llm.calls[slept:]
    assert tail[0] == ("wake_up", ("weights",)) and ("join", "c-w") in tail and ("update", 1) in tail
    assert tail.index(("finish_update", "1")) < tail.index(("wake_up", ("kv_cache",)))
    assert (st.state, st.version) == ("vacated", 1) and not svc.engine.needs_refill
    assert (await control(svc, op="resume")).state == "serving"
    await start(svc, "r1", max_tokens=2)
    assert svc.nc.done("r1").finish_reason == "length" and len(svc.nc.asked) == 1


async def test_a_wake_after_a_disk_load_reloads_from_the_path_and_asks_no_one(make, tmp_path):
    llm = FakeLLM()
    svc = await make(llm)
    svc.engine.gpu_sleep = True
    v1 = write_ckpt(tmp_path / "weights" / "v000001")
    await svc._on_newest_weights(WeightsPublished(version=1, path=str(v1), published_at=0.0))
    await control(svc, op="sleep", scheduled=True)
    assert (await control(svc, op="wake")).state == "vacated"
    assert (await control(svc, op="resume")).state == "serving"
    assert not svc.nc.asked and ("rpc", "reload_weights_in_place", {"weights_path": str(v1)}) in llm.calls
    await start(svc, "r1", max_tokens=2)
    assert svc.nc.done("r1").version == 1


async def test_a_refill_that_fails_is_bounded_reported_and_serves_nothing(make, monkeypatch, caplog):
    monkeypatch.setattr(refill, "GAP", 0.0)
    llm = FakeLLM()
    svc = await network_worker_asleep(make, llm)
    slept = len(llm.calls)
    st = await control(svc, op="wake")  # no trainer answers
    assert len(svc.nc.asked) == refill.TRIES and all(t == refill.WAIT for _, t in svc.nc.asked)
    assert st.state == "paused" and svc.engine.needs_refill
    assert "cannot serve after wake" in caplog.text and "sent none in 3 tries" in caplog.text
    # the scheduler's resume: asks again (bounded), then refuses; the trainer now says "not now"
    svc.nc.trainer = lambda want: WeightsPublished(1, "", 0.0, 0)
    st = await control(svc, op="resume", lent_until=time.time() + 30)
    assert len(svc.nc.asked) == 2 * refill.TRIES and st.state == "paused" and svc.engine.vacated
    assert "offers no round now" in caplog.text
    # a request routed here meanwhile never reaches vLLM: it ends preempted (re-dispatched)
    await start(svc, "r1", max_tokens=2)
    assert svc.nc.done("r1").finish_reason == "preempted"
    tail = llm.calls[slept:]
    assert not any(c[0] in ("resume", "rpc", "join") or c == ("wake_up", ("kv_cache",)) for c in tail)
    # the trainer is back: the next resume refills and serves
    svc.nc.trainer = round_of_own(1)
    st = await control(svc, op="resume")
    assert (st.state, st.version) == ("serving", 1) and len(svc.nc.asked) == 2 * refill.TRIES + 1
    await start(svc, "r2", max_tokens=2)
    assert svc.nc.done("r2").finish_reason == "length"


async def test_a_missed_refill_round_is_tried_again(make, monkeypatch):
    monkeypatch.setattr(refill, "GAP", 0.0)
    llm = FakeLLM()
    svc = await network_worker_asleep(make, llm)
    svc.nc.trainer = round_of_own(1)
    llm.join_fails = True
    real_join = llm.init_weight_transfer_engine

    async def join_second_time(request):
        try:
            await real_join(request)  # the first round closes before the worker joins
        finally:
            llm.join_fails = False

    llm.init_weight_transfer_engine = join_second_time
    # the newest version meanwhile: a refill also takes a newer version than the one discarded
    svc.nc.trainer = lambda want: round_of_own(1 if len(svc.nc.asked) == 1 else 2)(want)
    st = await control(svc, op="wake")
    assert len(svc.nc.asked) == 2 and (st.state, st.version) == ("vacated", 2) and not svc.engine.needs_refill


async def test_a_load_without_a_path_refills_the_same_version(make):
    # the scheduler's load (network: no path) of the version the worker had before its sleep is no no-op
    llm = FakeLLM()
    svc = await network_worker_asleep(make, llm)
    await svc.engine.wake()  # e.g. a wake whose refill timed out at the host agent
    svc.nc.trainer = round_of_own(1)
    st = await control(svc, op="load", version=1)
    assert len(svc.nc.asked) == 1 and not svc.engine.needs_refill and st.state == "vacated"


async def test_the_status_goes_out_when_the_worker_turns_busy_and_idle_not_only_at_the_beat(make):
    # the scheduler's timeline follows `running`: a lent worker's turns may start and end between beats
    svc = await make()
    gen = lambda rid: SimpleNamespace(data=encode(Generate(rid, [1, 2, 3], Sampling(max_tokens=3))),  # noqa: E731
                                      reply=rid, subject=subjects.rollout_gen("w"), headers=None)
    await svc._on_generate(gen("a"))
    await asyncio.sleep(0)
    assert [st.running for st, _ in svc.nc.statuses()] == [1]  # idle -> busy
    await svc._on_generate(gen("b"))  # busy already: no status
    for _ in range(200):
        if not svc.tasks:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)
    assert not svc.tasks and [st.running for st, _ in svc.nc.statuses()] == [1, 0]  # busy -> idle


async def test_catch_ups_asked_at_once_share_one_round(make):
    """A restarted worker's missed round and a lend's load ask together: one request, one round.
    A second round would find the worker already at the version, and the trainer would wait out
    its whole join window for a receiver that never joins."""
    llm = FakeLLM()
    svc = await make(llm)
    svc.nc.trainer = round_of_own(3)
    answer, plain = asyncio.Event(), svc.nc.request

    async def slow_trainer(subject, data, timeout=None):
        await answer.wait()  # the trainer answers between steps
        return await plain(subject, data, timeout)
    svc.nc.request = slow_trainer
    missed = asyncio.create_task(svc._catch_up(3))
    lend = asyncio.create_task(control(svc, op="load", version=3))
    await asyncio.sleep(0.05)
    answer.set()
    await asyncio.wait_for(asyncio.gather(missed, lend), 5)
    assert len(svc.nc.asked) == 1 and [c for c in llm.calls if c[0] == "join"] == [("join", "c-w")]
    assert svc.engine.version == 3
    await svc._catch_up(4)  # once it is done, the next catch-up asks again
    assert len(svc.nc.asked) == 2


async def test_a_generate_that_asks_for_a_receipt_gets_one_at_once_before_any_token(make):
    # the trajectory manager re-dispatches a Generate without a receipt within seconds (core NATS may drop
    # one while this worker reconnects): it goes out before anything can wait, here a drain-policy update
    svc = await make()
    assert svc.status().receipts  # what tells a trajectory manager to ask
    svc._admit.clear()  # new requests held
    gen = lambda rid, receipt: SimpleNamespace(  # noqa: E731
        data=encode(Generate(rid, [1, 2, 3], Sampling(max_tokens=3), receipt=receipt)), reply=rid,
        subject=subjects.rollout_gen("w"), headers=None)
    await svc._on_generate(gen("asks", True))
    await svc._on_generate(gen("old", False))  # a trajectory manager from before receipts: none, as before
    assert [(s, m) for s, m, _ in svc.nc.sent if s in ("asks", "old")] == [("asks", TokenDelta("asks", [], [], 0))]
    svc._admit.set()
    for _ in range(200):
        if not svc.tasks:
            break
        await asyncio.sleep(0.01)
    asks = [m for s, m, _ in svc.nc.sent if s == "asks"]
    assert asks[0] == TokenDelta("asks", [], [], 0) and isinstance(asks[-1], GenerateDone)
    assert sum(len(m.token_ids) for m in asks if isinstance(m, TokenDelta)) == 3
    assert not any(isinstance(m, TokenDelta) and not m.token_ids for s, m, _ in svc.nc.sent if s == "old")


def test_the_receipt_fields_stay_readable_both_ways():
    # a rolling upgrade: trajectory managers and workers from before receipts talk to new ones
    import msgspec

    class GenerateBefore(msgspec.Struct, tag="Generate", array_like=True, omit_defaults=True):
        request_id: str
        prompt_ids: list[int]
        sampling: Sampling
        session_id: str = ""
        hold_s: float = 0.0
        adapter: str = ""

    class StatusBefore(msgspec.Struct, tag="WorkerStatus", omit_defaults=True):
        worker_id: str
        state: str
        version: int
        running: int
        capacity: int
        model: str
        max_model_len: int
        ts: float
        instance: str = ""

    asked = Generate("r", [1], Sampling(), receipt=True)
    assert decode(encode(asked), GenerateBefore).request_id == "r"  # an old worker reads it, and sends none
    assert decode(encode(GenerateBefore("r", [1], Sampling())), Generate).receipt is False  # an old manager asks none
    new = WorkerStatus("w", "serving", 0, 0, 4, "m", 2048, 1.0, instance="i", receipts=True)
    assert decode(encode(new), StatusBefore).instance == "i"  # an old manager reads a new worker's beat
    assert decode(encode(StatusBefore("w", "serving", 0, 0, 4, "m", 2048, 1.0)), WorkerStatus).receipts is False
