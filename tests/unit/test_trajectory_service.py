"""services/trajectory/service.py with NATS faked at the edge: the admission backlog fails
closed, and best-effort failures are logged once per cause (not swallowed)."""

from __future__ import annotations

import logging
import time
import types

import pytest

from services.trajectory import service as svc_mod
from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import TrajectoryService
from services.trajectory.sessions import SessionOps
from shared import subjects
from shared.admission import Backlog, BacklogUnknown
from shared.codec import encode
from shared.config import Connections
from shared.messages import Generate, Sampling, SessionRequest, TokenDelta, TrainerStatus


class JS:
    def __init__(self, info=None, error: Exception | None = None):
        self.info, self.error, self.asked = info, error, []

    async def consumer_info(self, stream, durable, timeout):
        self.asked.append((stream, durable))
        if self.error:
            raise self.error
        return self.info


def service(js) -> TrajectoryService:
    s = TrajectoryService(TrajectoryConfig(), Connections())
    s.js = js
    return s


async def test_the_backlog_comes_from_the_trainer_consumer_and_its_metadata():
    cfg = subjects.trainer_consumer(subjects.TRAINER_DURABLE, sessions_per_version=12)
    js = JS(types.SimpleNamespace(num_pending=5, config=cfg))
    assert await service(js)._backlog() == Backlog(untrained=5, per_version=12)
    assert js.asked == [(subjects.TRAJECTORIES_STREAM, subjects.TRAINER_DURABLE)]


@pytest.mark.parametrize("js", [
    JS(error=TimeoutError("nats timeout")),  # bug 4: any error used to count as an empty backlog
    JS(types.SimpleNamespace(num_pending=0, config=subjects.ConsumerConfig(durable_name="trainer"))),  # no batch size
])
async def test_an_unknown_backlog_is_refused_and_logged(js, caplog):
    caplog.set_level(logging.WARNING, logger="sf.trajectory")
    svc_mod._warn.seen.clear()
    with pytest.raises(BacklogUnknown):
        await service(js)._backlog()
    assert any("admission refuses sessions" in r.message for r in caplog.records)


async def test_session_create_answers_503_when_the_backlog_is_unknown():
    class Store:
        async def count_open(self, newer_than):
            return 0

    async def unknown():
        raise BacklogUnknown("consumer 'trainer': TimeoutError")

    ops = SessionOps(Store(), None, TrajectoryConfig(max_staleness=0), lambda: 0, unknown)
    reply = await ops.create(SessionRequest("create"))
    assert reply.status == 503 and "backlog" in reply.message


class FakeNC:
    """Replies to a Generate with one token; publishing the abort fails (bug 5: it was swallowed)."""

    is_connected = True
    stats = {"reconnects": 0}  # nats.py's counters: a reconnect ends the streams in flight

    def __init__(self):
        self.cb = None

    def new_inbox(self):
        return "_INBOX.t"

    async def subscribe(self, subject, cb):
        self.cb = cb

    async def publish(self, subject, payload, reply=None):
        if subject.startswith("sf.rollout.ctl."):
            raise ConnectionError("connection closed")
        msg = types.SimpleNamespace(subject=reply, data=encode(TokenDelta("r.0", [1], [0.0], 0)), headers=None)
        await self.cb(msg)


async def test_a_failed_abort_is_logged_once_per_cause(caplog):
    caplog.set_level(logging.DEBUG, logger="sf.trajectory")
    svc_mod._warn.seen.clear()
    s = service(None)
    s.nc = FakeNC()
    for _ in range(2):  # the agent leaves after the first token, twice
        replies = s._call("w0", Generate("r.0", [1, 2], Sampling()))
        assert isinstance(await replies.__anext__(), TokenDelta)
        await replies.aclose()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "abort of r.0" in r.message]
    assert len(warned) == 1 and "connection closed" in warned[0].message
    assert s.table.inflight["w0"] == 0


class SilentNC(FakeNC):
    """A worker that takes the Generate, sends one token, then says nothing more; aborts are recorded."""

    def __init__(self):
        super().__init__()
        self.aborts: list[bytes] = []

    async def publish(self, subject, payload, reply=None):
        if subject.startswith("sf.rollout.ctl."):
            self.aborts.append(subject)
            return
        msg = types.SimpleNamespace(subject=reply, data=encode(TokenDelta("r.0", [1], [0.0], 0)), headers=None)
        await self.cb(msg)


async def test_a_call_that_times_out_is_also_aborted_on_its_worker():
    """Issue 9, item 5: a worker that stopped replying may still be generating; free its slot."""
    from shared.messages import GenerateDone, WorkerStatus

    s = TrajectoryService(TrajectoryConfig(first_token_timeout=5, token_timeout=0.3), Connections())
    s.nc = SilentNC()
    s.table.update(WorkerStatus("w0", "serving", 0, 0, 4, "m", 2048, 1e12))  # alive for the whole test
    got = [r async for r in s._call("w0", Generate("r.0", [1, 2], Sampling()))]
    assert isinstance(got[0], TokenDelta)
    assert isinstance(got[-1], GenerateDone) and got[-1].finish_reason == "preempted"
    assert s.nc.aborts == ["sf.rollout.ctl.w0"]


async def test_a_call_to_a_worker_whose_heartbeat_stopped_ends_within_a_poll_not_the_token_timeout(monkeypatch):
    import time

    from shared.bus import Replies
    from shared.messages import GenerateDone, WorkerStatus

    monkeypatch.setattr(Replies, "ALIVE_POLL", 0.1)  # 0.5 s in bus.py

    s = TrajectoryService(TrajectoryConfig(first_token_timeout=60, token_timeout=60, worker_stale_after=5),
                          Connections())
    s.nc = SilentNC()
    s.table.update(WorkerStatus("w0", "serving", 0, 0, 4, "m", 2048, time.time() - 4.8))  # stale in 0.2 s
    t0 = time.monotonic()
    got = [r async for r in s._call("w0", Generate("r.0", [1, 2], Sampling()))]
    assert isinstance(got[-1], GenerateDone) and got[-1].finish_reason == "preempted"
    assert time.monotonic() - t0 < 2.0
    # its heartbeats may have stopped only because a network partition cut it off: back, it would go on
    # generating the request that now runs elsewhere until max_tokens, so it is aborted as well
    assert s.nc.aborts == ["sf.rollout.ctl.w0"]


class HeldTailNC(FakeNC):
    """A worker that got hold_s: the first token on its own, the rest riding on its GenerateDone."""

    async def publish(self, subject, payload, reply=None):
        from shared.messages import GenerateDone

        for m in (TokenDelta("r.0", [1], [-0.1], 4),
                  GenerateDone("r.0", "stop", 2, 4, "w0", tail_ids=[2, 3], tail_logprobs=[-0.2, -0.3])):
            await self.cb(types.SimpleNamespace(subject=reply, data=encode(m), headers=None))


async def test_a_done_carrying_the_held_tail_comes_with_it():
    # generation.py takes the tail off the done: tokens that end the generation are saved with the turn
    s = service(None)
    s.nc = HeldTailNC()
    got = [r async for r in s._call("w0", Generate("r.0", [1, 2], Sampling(), hold_s=0.1))]
    assert [type(r).__name__ for r in got] == ["TokenDelta", "GenerateDone"] and got[0].token_ids == [1]
    assert got[-1].finish_reason == "stop" and got[-1].tail_ids == [2, 3] and got[-1].version == 4


async def test_a_call_records_what_its_request_has_done_for_the_rebalance():
    # routing.Running: the tokens it was dispatched with, those generated since, its budget (the worth test)
    from dataclasses import replace as copy

    from services.trajectory.routing import Running
    s = service(None)
    s.nc = HeldTailNC()
    seen = [copy(s.on_worker["w0"]["r.0"]) async for _ in s._call("w0", Generate("r.0", [1, 2], Sampling(max_tokens=50),
                                                                                   hold_s=0.1))]
    assert seen[0] == Running(2, 1, 50)
    assert "r.0" not in s.on_worker["w0"]  # gone with the call


async def test_a_turn_or_session_op_that_waited_out_its_place_in_the_redis_line_is_a_503_overloaded():
    # not `redis_unavailable`: Redis answers, this replica is behind (shared/redispool.PoolExhausted)
    from shared.codec import decode
    from shared.messages import ChatFailed, ChatRequest, SessionReply
    from shared.redispool import PoolExhausted

    async def busy(*a, **kw):
        raise PoolExhausted("No connection available: 5 s in line for one of 64 Redis connections")

    s = service(JS())
    s.turns = types.SimpleNamespace(handle=busy)
    s.sessions = types.SimpleNamespace(handle=busy)
    sent = []

    class NC:
        async def publish(self, subject, payload):
            sent.append(payload)

    s.nc = NC()
    await s._chat(ChatRequest("r1", "sess-1", "chat", "m", Sampling(max_tokens=4), messages=[]), "_INBOX.x")
    failed = decode(sent[0], ChatFailed)
    assert (failed.status, failed.code) == (503, "overloaded") and "in line" in failed.message

    class Msg:
        data, reply = encode(SessionRequest("create")), "_INBOX.y"

        async def respond(self, data):
            sent.append(data)

    await s._session(Msg())
    reply = decode(sent[1], SessionReply)
    assert (reply.status, reply.code) == (503, "overloaded") and reply.retry_after > 0


class CtlNC:
    """Records what is published on the workers' control subjects."""

    def __init__(self):
        self.ctl: list[tuple[str, object]] = []

    async def publish(self, subject, payload, reply=None):
        from shared.codec import decode
        from shared.messages import RolloutControl
        self.ctl.append((subject, decode(payload, RolloutControl)))


async def test_a_worker_that_begins_serving_is_moved_its_share_of_this_replicas_requests():
    from shared.messages import WorkerStatus

    def status(s, wid, state, running):
        return s._on_status(types.SimpleNamespace(data=encode(WorkerStatus(wid, state, 0, running, 8, "m", 2048, 1e12)),
                                                  subject=subjects.ROLLOUT_STATUS, headers=None))

    for rebalance in (True, False):
        s = TrajectoryService(TrajectoryConfig(rebalance=rebalance), Connections())
        s.nc = CtlNC()
        await status(s, "busy", "serving", 8)
        s.on_worker["busy"] = dict.fromkeys(f"r{i}.0" for i in range(8))  # as _call records them, oldest first
        await status(s, "lent", "sleeping", 0)
        assert s.nc.ctl == []  # not serving yet
        await status(s, "lent", "serving", 0)  # the lend's resume
        moved = [(subj, c.op, c.request_id, c.scheduled) for subj, c in s.nc.ctl]
        if rebalance:
            assert moved == [("sf.rollout.ctl.busy", "abort", f"r{i}.0", True) for i in range(4, 8)]
        else:
            assert moved == []
        await status(s, "lent", "serving", 0)  # a heartbeat of a worker that serves already moves nothing
        assert len(s.nc.ctl) == len(moved)


async def test_the_worth_test_reads_what_each_request_has_done():
    """SF_TRAJECTORY_REBALANCE_WORTH: the requests _call records (routing.Running: context, tokens
    generated, budget) go to routing.WorkerTable.moves; a lend that ends before any of them would finish
    moves none of them. Without the test, the share moves."""
    from services.trajectory.routing import Running
    from shared.messages import WorkerStatus

    def status(s, wid, running, ts, tokens=0, lent_until=0.0):
        st = WorkerStatus(wid, "serving", 0, running, 8, "m", 2048, ts, generated_tokens=tokens, lent_until=lent_until)
        return s._on_status(types.SimpleNamespace(data=encode(st), subject=subjects.ROLLOUT_STATUS, headers=None))

    now = time.time()
    for worth in (True, False):
        s = TrajectoryService(TrajectoryConfig(rebalance_worth=worth), Connections())
        s.nc = CtlNC()
        await status(s, "busy", 8, now - 1, 0)
        await status(s, "busy", 8, now, 800)  # 800 tokens/s
        s.table.lengths.record_recent([4000.0] * 20)
        s.on_worker["busy"] = {f"r{i}.0": Running(1024, 8, 8000) for i in range(8)}
        await status(s, "lent", 0, now, lent_until=now + 2.0)  # begins serving, lent for 2 s more
        assert len(s.nc.ctl) == (0 if worth else 4)


def trainer_status(state: str, ready_groups: int) -> TrainerStatus:
    return TrainerStatus(state=state, step=3, version=3, ready_groups=ready_groups, open_groups=2, buffered_samples=99,
                         groups_per_step=2, group_size=4, last_wait_s=0.0, last_compute_s=0.0, ts=time.time())


async def test_the_backlog_counts_what_the_trainer_holds_untrained():
    """Issue 26: the trainer prefetches complete groups and trains a batch it has taken; neither is in
    the consumer's num_pending, yet what is admitted now trains after them. Its heartbeat says how
    many: complete groups x group size, plus one step's batch while it steps. Members of incomplete
    groups (open_groups) do not count; a stale heartbeat counts nothing."""
    cfg = subjects.trainer_consumer(subjects.TRAINER_DURABLE, sessions_per_version=8)
    svc = service(JS(types.SimpleNamespace(num_pending=5, config=cfg)))
    assert await svc._backlog() == Backlog(untrained=5, per_version=8)  # no heartbeat yet
    await svc._on_trainer(types.SimpleNamespace(data=encode(trainer_status("computing", 2)),
                                                subject=subjects.TRAINER_STATUS))
    assert await svc._backlog() == Backlog(untrained=5 + 2 * 4 + 2 * 4, per_version=8)
    await svc._on_trainer(types.SimpleNamespace(data=encode(trainer_status("waiting", 1)),
                                                subject=subjects.TRAINER_STATUS))
    assert await svc._backlog() == Backlog(untrained=5 + 4, per_version=8)
    svc.trainer = (svc.trainer[0], time.monotonic() - 2 * svc.cfg.worker_stale_after)
    assert await svc._backlog() == Backlog(untrained=5, per_version=8)


class ReceiptNC(FakeNC):
    """A worker that sends receipts, scripted per dispatch: "drop" (core NATS lost the Generate: no reply at
    all), or a receipt if asked, then after `first_token_s` one token and its GenerateDone. It records each
    Generate (when, decoded) and each abort."""

    def __init__(self, script: list[str], first_token_s: float = 0.0):
        super().__init__()
        self.script, self.first_token_s = script, first_token_s
        self.generates: list[tuple[float, Generate]] = []
        self.aborts: list[str] = []
        self.tasks: set = set()

    async def publish(self, subject, payload, reply=None):
        import asyncio

        from shared.codec import decode
        if subject.startswith("sf.rollout.ctl."):
            self.aborts.append(subject)
            return
        cmd = decode(payload, Generate)
        self.generates.append((time.monotonic(), cmd))
        if self.script[len(self.generates) - 1] == "serve":
            task = asyncio.create_task(self._serve(cmd, reply))
            self.tasks.add(task)

    async def _serve(self, cmd: Generate, reply: str) -> None:
        import asyncio

        from shared.messages import GenerateDone
        send = lambda m: self.cb(types.SimpleNamespace(subject=reply, data=encode(m), headers=None))  # noqa: E731
        if cmd.receipt:
            await send(TokenDelta(cmd.request_id, [], [], 0))
        await asyncio.sleep(self.first_token_s)
        await send(TokenDelta(cmd.request_id, [7], [-0.1], 0))
        await send(GenerateDone(cmd.request_id, "length", 2, 0, "w0"))


def receipt_service(nc: ReceiptNC, receipts: bool = True, **cfg) -> TrajectoryService:
    from shared.messages import WorkerStatus

    s = TrajectoryService(TrajectoryConfig(**cfg), Connections())
    s.nc = nc
    s.table.update(WorkerStatus("w0", "serving", 0, 0, 4, "m", 2048, 1e12, receipts=receipts))  # alive throughout
    return s


async def one_turn(s: TrajectoryService):
    """A generation of one token through the real generation loop and this service's _call."""
    from services.trajectory.generation import Job, generate
    from services.trajectory.tokenpath import TokenPath

    async def pick(exclude):
        return "w0"

    async def on_tokens(delta, worker, first, final):
        return None

    return await generate(s._call, pick, Job("r", "s", TokenPath.of([1, 2]), Sampling(max_tokens=1)), on_tokens, 3,
                          backoff=0.0)


async def test_a_generate_without_a_receipt_is_re_dispatched_within_the_receipt_timeout_not_the_first_token_one():
    # issue 30: core NATS dropped the Generate while the worker's subscription moved between cluster members;
    # its heartbeats go on, so before receipts the turn waited the 120 s first-reply timeout
    s = receipt_service(ReceiptNC(["drop", "serve"]), receipt_timeout=0.3, first_token_timeout=60)
    t0 = time.monotonic()
    out = await one_turn(s)
    took = time.monotonic() - t0
    assert out.token_ids == [7] and out.dispatches == 2 and out.finish_reason == "length"
    (sent0, first), (sent1, second) = s.nc.generates
    assert first.receipt and second.receipt
    assert 0.29 <= sent1 - sent0 < 0.3 + 2 * 0.1 and took < 1.0  # the receipt timeout, then at once
    assert s.nc.aborts == ["sf.rollout.ctl.w0"]  # the lost one: in case the worker did get it and only the receipt was lost
    assert s.table.inflight["w0"] == 0


async def test_a_receipt_then_a_slow_first_token_is_not_re_dispatched():
    # after the receipt the first-token timeout applies, unchanged: vLLM's warm-up stays covered
    s = receipt_service(ReceiptNC(["serve", "serve"], first_token_s=0.4), receipt_timeout=0.2, first_token_timeout=60)
    out = await one_turn(s)
    assert out.token_ids == [7] and out.dispatches == 1 and s.nc.aborts == []
    assert [g.receipt for _, g in s.nc.generates] == [True]
    # the receipt stops at the transport: the caller sees the tokens and the end only
    got = [r async for r in s._call("w0", Generate("r.9", [1, 2], Sampling(max_tokens=1)))]
    assert [type(r).__name__ for r in got] == ["TokenDelta", "GenerateDone"] and got[0].token_ids == [7]


async def test_a_worker_from_before_receipts_is_asked_for_none_and_waited_for_as_before():
    # wire compatibility: its WorkerStatus has no `receipts` (False), so it gets no `receipt` it would ignore,
    # and a first token later than the receipt timeout is no loss
    s = receipt_service(ReceiptNC(["serve"], first_token_s=0.5), receipts=False, receipt_timeout=0.2,
                        first_token_timeout=60)
    out = await one_turn(s)
    assert out.dispatches == 1 and [g.receipt for _, g in s.nc.generates] == [False]


async def test_a_receipt_timeout_of_0_asks_for_none():
    s = receipt_service(ReceiptNC(["serve"], first_token_s=0.3), receipt_timeout=0, first_token_timeout=60)
    assert (await one_turn(s)).dispatches == 1 and [g.receipt for _, g in s.nc.generates] == [False]
