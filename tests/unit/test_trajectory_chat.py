"""services/trajectory/chat.py: one agent turn, with the edges faked: Redis (an in-memory
store with the same methods as store.py) and the rollout worker (`call`). The handler, the
turn stream, the picker, generation and the record stay real, with the tiny model's tokenizer."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.trajectory import chat
from services.trajectory.chat import LeaseLost, TurnHandler
from services.trajectory.config import TrajectoryConfig
from services.trajectory.rendering import Renderer
from services.trajectory.routing import WorkerTable
from services.trajectory.store import DeltaRecord, InFlight, Lookup, SessionNotFound
from shared.codec import decode, encode
from shared.messages import ChatDelta, ChatDone, ChatRequest, Generate, GenerateDone, Sampling, TokenDelta, WorkerStatus


class FakeStore:
    """store.Store's methods over dicts; leases are plain owner strings (no expiry)."""

    def __init__(self):
        self.sessions: dict[str, dict] = {}
        self.seq: dict[str, int] = {}
        self.requests: dict[str, InFlight] = {}
        self.deltas: dict[str, list[DeltaRecord]] = {}
        self.owners: dict[str, str] = {}
        self.done_: dict[str, bytes] = {}
        self.saved: list[tuple[str, object, str]] = []
        self.renew_ok = True
        self.n = 0

    async def create_session(self, group_id="", metadata=None, anonymous=False):
        self.n += 1
        sid = f"sess-{self.n}"
        self.sessions[sid] = {"status": "open", "anonymous": anonymous}
        return sid

    async def lookup(self, rid, sid, follow="", owner="", lease_ms=0):
        done, state = self.done_.get(rid), self.requests.get(rid)
        leased = False
        if owner and done is None and state is None:  # a new request: its lease, as store.py takes it
            leased = self.owners.setdefault(rid, owner) == owner
        if sid and sid not in self.sessions:
            raise SessionNotFound(sid)
        turn_id = -1
        if sid:
            self.seq[sid] = self.seq.get(sid, 0) + 1
            turn_id = self.seq[sid] - 1
        return Lookup(done, state, dict(self.sessions[sid]) if sid else None, turn_id,
                      state.session_id if state else sid, leased=leased)

    async def find_turn(self, sid, keys):
        return None

    async def turns(self, sid):
        return {}

    async def claim_request(self, rid, owner, lease_ms):
        if self.owners.get(rid) not in (None, owner):
            return False
        self.owners[rid] = owner
        return True

    async def load_request(self, rid):
        return (self.requests[rid], list(self.deltas.get(rid, []))) if rid in self.requests else None

    async def done(self, rid):
        return self.done_.get(rid)

    async def renew_lease(self, rid, owner, lease_ms):
        return self.renew_ok and self.owners.get(rid) == owner

    async def renew_leases(self, leases, lease_ms):  # as store.py: renew_lease for each, in one call
        return [await self.renew_lease(rid, owner, lease_ms) for rid, owner in leases]

    def _holds(self, rid, owner):
        return rid in self.requests and self.owners.get(rid) in (None, owner)

    def _new(self, rid, owner):  # nobody began or finished it, and nobody else holds its lease
        return rid not in self.requests and rid not in self.done_ and self.owners.get(rid) in (None, owner)

    async def append_deltas(self, rid, recs, owner, begin=None):
        if not (self._holds(rid, owner) if begin is None else self._new(rid, owner)):
            return False
        if begin is not None:
            self.requests[rid] = begin
        self.deltas.setdefault(rid, []).extend(recs)
        return True

    async def hold(self, rid, owner, lease_ms):
        if not self._holds(rid, owner):
            return False
        self.owners[rid] = owner
        return True

    async def drop_request(self, rid, owner):
        if self.owners.get(rid) not in (None, owner):
            return False
        for d in (self.requests, self.deltas, self.owners):
            d.pop(rid, None)
        return True

    async def save_turn(self, sid, turn, worker, result=b"", owner="", began=True, **caches):
        if owner and not (self._holds(turn.request_id, owner) if began else self._new(turn.request_id, owner)):
            return False
        self.saved.append((sid, turn, worker))
        self.done_[turn.request_id] = result
        for d in (self.requests, self.deltas, self.owners):
            d.pop(turn.request_id, None)
        return True


@pytest.fixture(scope="module")
def renderer(tiny_model):
    return Renderer.from_pretrained(str(tiny_model))


@pytest.fixture(autouse=True)
def fast_resume_poll(monkeypatch):
    """A re-sent copy checks every RESUME_POLL (0.2 s in chat.py) whether the replica serving the request
    finished or lost it; the copies here check every 0.05 s, so each wait ends sooner, not differently."""
    monkeypatch.setattr(chat, "RESUME_POLL", 0.05)


def table() -> WorkerTable:
    t = WorkerTable(stale_after=3600)
    t.update(WorkerStatus("w0", "serving", 0, 0, 8, "m", 512, ts=time.time()))
    return t


def worker(renderer, text: str, delay: float = 0.0, calls: list | None = None):
    """A rollout worker that sends `text` one token at a time, then stops (EOS)."""
    ids = renderer.encode(text) + [renderer.eos_id]

    async def call(w, cmd):
        cmd = decode(encode(cmd), Generate)  # as the worker reads it off the wire
        if calls is not None:
            calls.append(cmd)
        try:
            for t in ids[len(cmd.prompt_ids) - len(calls[0].prompt_ids) if calls else 0:]:
                await asyncio.sleep(delay)
                yield TokenDelta(cmd.request_id, [t], [-0.5], 0)
            yield GenerateDone(cmd.request_id, "stop", len(cmd.prompt_ids), 0, w)
        finally:
            if calls is not None:
                calls.append("closed")

    return call


def request(rid: str, sid: str = "", **kw) -> ChatRequest:
    return ChatRequest(rid, sid, "chat", "m", Sampling(max_tokens=64, temperature=0.0),
                       messages=[{"role": "user", "content": "hi"}], **kw)


async def run(h: TurnHandler, req: ChatRequest) -> tuple[ChatDone, list]:
    sent: list = []

    async def emit(m):
        sent.append(m)

    return await h.handle(req, emit), sent


async def test_a_turn_streams_persists_and_records(renderer):
    store = FakeStore()
    sid = await store.create_session()
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(), worker(renderer, "hello world"))
    done, sent = await run(h, request("r1", sid))
    text = "".join(m.text for m in sent if isinstance(m, ChatDelta))
    assert done.text == text == "hello world" and done.finish_reason == "stop"
    (saved_sid, turn, w), = store.saved
    assert saved_sid == sid and w == "w0" and turn.reply == {"role": "assistant", "content": "hello world"}
    assert decode(store.done_["r1"], ChatDone) == done


async def test_deltas_reach_the_agent_whatever_the_retired_stream_field_says(renderer):
    # bug 7: ChatRequest.stream was always True on the wire and its branches were dead; a request
    # that does not set it (its default, False) must still stream when the agent streams
    store = FakeStore()
    sid = await store.create_session()
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(), worker(renderer, "abc def"))
    done, sent = await run(h, request("r7", sid, stream=False, agent_streams=True))
    deltas = [m for m in sent if isinstance(m, ChatDelta) and m.text]
    assert len(deltas) > 1 and "".join(d.text for d in deltas) == done.text == "abc def"


async def test_a_resumed_anonymous_request_stays_in_the_session_it_began_in(renderer):
    # bug 2: a request without a session that another replica resumes was recorded in a fresh session
    store = FakeStore()
    first = await store.create_session(anonymous=True)
    prompt = renderer.prompt([{"role": "user", "content": "hi"}], [])
    state = InFlight(first, 0, prompt, prompt, -1, [{"role": "user", "content": "hi"}])
    assert (await store.lookup("r2", "", owner="dead-replica")).leased
    assert await store.append_deltas("r2", [DeltaRecord("w0", True, 0, renderer.encode("hello"), [-0.5])],
                                     "dead-replica", begin=state)
    store.owners.pop("r2")  # the dead replica's lease lapsed
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(), worker(renderer, " there"))
    done, _ = await run(h, request("r2"))  # the gateway re-sends it, still without a session
    assert done.session_id == first and [s for s, _, _ in store.saved] == [first]
    assert len(store.sessions) == 1  # no stray session was created
    assert done.text.startswith("hello")


async def test_a_replica_that_loses_its_lease_stops_and_leaves_the_request_to_the_owner(renderer, monkeypatch):
    # bug 1: the keepalive ignored renew_lease's False and the replica went on writing the request
    monkeypatch.setattr(chat, "KEEPALIVE_INTERVAL", 0.05)
    store = FakeStore()
    sid = await store.create_session()
    calls: list = []
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(),
                    worker(renderer, "a long answer " * 20, delay=0.02, calls=calls))
    task = asyncio.create_task(run(h, request("r3", sid)))
    while not store.deltas.get("r3"):
        await asyncio.sleep(0.01)
    store.owners["r3"] = "replica-b"  # another replica took the request over
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(task, 5)
    assert calls[-1] == "closed"  # the worker call was closed (service.py then sends abort)
    assert store.saved == [] and "r3" in store.requests and store.owners["r3"] == "replica-b"


async def test_a_replica_paused_past_its_lease_stops_at_its_next_write(renderer):
    # found by tests/faults (SIGSTOP): continued, the paused replica processed its worker's queued tokens
    # before its keepalive ran, appended them to the request its successor serves and saved its own turn
    store = FakeStore()
    sid = await store.create_session()
    calls: list = []
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(),
                    worker(renderer, "a long answer " * 20, delay=0.002, calls=calls))
    task = asyncio.create_task(run(h, request("r6", sid)))
    while not store.deltas.get("r6"):
        await asyncio.sleep(0)
    store.owners["r6"] = "replica-b"  # taken over while this one was paused (its keepalive never ran)
    before = list(store.deltas["r6"])
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(task, 5)
    assert store.saved == [] and store.deltas["r6"] == before and calls[-1] == "closed"


async def resend_while_serving(renderer, rid: str, answer: str, delay: float):
    """Serve `rid`, and once its first delta is stored send it again to the same replica (as the
    gateway re-sends a silent turn). Returns (copy's done, copy's messages, first's done, store)."""
    store = FakeStore()
    sid = await store.create_session()
    h = TurnHandler(TrajectoryConfig(worker_wait=2, resume_wait=10), store, renderer, table(),
                    worker(renderer, answer, delay=delay))
    first = asyncio.create_task(run(h, request(rid, sid)))
    while not store.deltas.get(rid):
        await asyncio.sleep(0.01)
    (done2, sent2), (done1, _) = await asyncio.wait_for(asyncio.gather(run(h, request(rid, sid)), first), 10)
    return done2, sent2, done1, store


async def test_a_resent_copy_on_the_same_replica_waits_for_the_first(renderer):
    # a re-sent request that lands on the replica still serving it must not share its lease
    done2, _, done1, store = await resend_while_serving(renderer, "r7", "a long answer " * 5, 0.005)
    assert done2 == done1 and len(store.saved) == 1  # one turn, the first copy's


async def test_a_resent_copy_waits_for_the_first_longer_than_a_keepalive(renderer, monkeypatch):
    # bench/load.py on a starved replica: the gateway re-sent a slow turn, and its copy's keepalive, which
    # also renewed the lease, found the first copy holding it, called the lease lost and stopped the copy
    # silently after one interval: the gateway heard nothing more and re-sent again (then a 504)
    monkeypatch.setattr(chat, "KEEPALIVE_INTERVAL", 0.05)
    done2, sent2, done1, store = await resend_while_serving(renderer, "r9", "a long answer " * 5, 0.02)  # 0.6 s
    assert done2 == done1 and len(store.saved) == 1
    assert len([m for m in sent2 if isinstance(m, ChatDelta) and not m.text]) >= 3  # it kept the gateway told


async def test_keepalives_keep_their_cadence_while_redis_makes_the_turn_wait(renderer, monkeypatch):
    # the gateway re-sends after 5 s of silence: keepalives must not wait for the lookup, nor for a lease
    # renewal that waits for a Redis connection (bench/load.py: 125 re-sends in 45 s on a starved replica)
    monkeypatch.setattr(chat, "KEEPALIVE_INTERVAL", 0.05)
    store = FakeStore()
    sid = await store.create_session()
    slow_lookup, slow_renew = store.lookup, store.renew_lease

    async def lookup(*a):
        await asyncio.sleep(0.4)
        return await slow_lookup(*a)

    async def renew(*a):
        await asyncio.sleep(0.4)
        return await slow_renew(*a)

    store.lookup, store.renew_lease = lookup, renew
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(),
                    worker(renderer, "a long answer " * 5, delay=0.03))  # 31 tokens: 0.9 s, two slow renewals
    stamps: list[float] = []
    start = time.monotonic()

    async def emit(m):
        if isinstance(m, ChatDelta) and not m.text:
            stamps.append(time.monotonic())

    done = await asyncio.wait_for(h.handle(request("r10", sid), emit), 20)
    assert done.text.startswith("a long answer") and store.saved
    gaps = [b - a for a, b in zip([start, *stamps], stamps)]
    assert stamps and max(gaps) < 0.25, gaps


async def test_turns_in_flight_share_one_ticker_and_one_renewal_call_per_tick(renderer, monkeypatch):
    # a replica's keepalives and lease renewals: one task and one Redis call per tick for all its turns,
    # not a task and a call per turn and second (a 10 s reply cost 10 renewals; 500 agents, 500 calls a second)
    monkeypatch.setattr(chat, "KEEPALIVE_INTERVAL", 0.05)
    store = FakeStore()
    sid = await store.create_session()
    calls: list[int] = []
    renew_many = store.renew_leases

    async def renew_leases(leases, lease_ms):
        calls.append(len(leases))
        return await renew_many(leases, lease_ms)

    store.renew_leases = renew_leases
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(),
                    worker(renderer, "a long answer " * 5, delay=0.02))  # 31 tokens: 0.6 s, past the check at 0.3 s
    tasks_before = len(asyncio.all_tasks())
    runs = [asyncio.create_task(run(h, request(f"r-many-{i}", sid))) for i in range(6)]
    await asyncio.sleep(0.3)
    assert len(asyncio.all_tasks()) - tasks_before <= 6 + 2  # the turns, the ticker, at most one renewal
    done = await asyncio.wait_for(asyncio.gather(*runs), 20)
    assert len(store.saved) == 6
    assert calls and max(calls) == 6  # every lease held, renewed in one call
    for (_, sent), i in zip(done, range(6)):
        assert sum(isinstance(m, ChatDelta) and not m.text for m in sent) >= 3, i  # each kept the gateway told
    assert h._ticker is not None
    await asyncio.sleep(0.15)
    assert h._ticker.done() and not h.live  # it ends with the last turn


async def test_two_copies_that_both_begin_a_request_give_one_turn(renderer):
    # found by tests/faults: a replica paused before it began a request, then continued, and its copy of
    # the gateway's re-send answered the agent 409 "already running" instead of the first copy's result
    store = FakeStore()
    sid = await store.create_session()
    h = TurnHandler(TrajectoryConfig(worker_wait=2, resume_wait=10), store, renderer, table(),
                    worker(renderer, "a long answer " * 5, delay=0.005))
    (done1, _), (done2, _) = await asyncio.wait_for(asyncio.gather(run(h, request("r8", sid)),
                                                                   run(h, request("r8", sid))), 10)
    assert done1 == done2 and len(store.saved) == 1


async def test_two_copies_of_an_anonymous_request_give_one_turn_in_one_session(renderer):
    # the copy that waits for the first (whose lookup took the lease) makes no session of its own
    store = FakeStore()
    h = TurnHandler(TrajectoryConfig(worker_wait=2, resume_wait=10), store, renderer, table(),
                    worker(renderer, "a long answer " * 5, delay=0.005))
    (done1, _), (done2, _) = await asyncio.wait_for(asyncio.gather(run(h, request("r8a")), run(h, request("r8a"))), 10)
    assert done1 == done2 and len(store.saved) == 1 and len(store.sessions) == 1


async def test_a_lease_that_lapsed_but_nobody_took_is_taken_back_and_the_turn_goes_on(renderer, monkeypatch):
    """Seen live on a loaded box: the event loop stalled past the 3 s lease, the key expired, and
    the replica abandoned a turn no other replica had taken (the agent waited for a re-send)."""
    monkeypatch.setattr(chat, "KEEPALIVE_INTERVAL", 0.05)
    store = FakeStore()
    sid = await store.create_session()
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(),
                    worker(renderer, "a long answer " * 8, delay=0.005))  # 49 tokens: 0.25 s, five keepalives
    task = asyncio.create_task(run(h, request("r5", sid)))
    while not store.deltas.get("r5"):
        await asyncio.sleep(0.01)
    del store.owners["r5"]  # the lease expired; no other replica claimed it
    done, _ = await asyncio.wait_for(task, 30)
    assert done.text.startswith("a long answer") and store.saved  # finished here, not abandoned


async def test_renewal_errors_count_as_lost_once_the_lease_would_have_lapsed(renderer, monkeypatch):
    monkeypatch.setattr(chat, "KEEPALIVE_INTERVAL", 0.05)
    monkeypatch.setattr(chat, "LEASE_MS", 200)
    store = FakeStore()

    async def broken(*a):
        raise ConnectionError("redis down")

    store.renew_lease = broken
    sid = await store.create_session()
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(), worker(renderer, "slow " * 50, delay=0.02))
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(run(h, request("r4", sid)), 5)


async def test_unknown_session_is_404_and_finished_session_is_409(renderer):
    store = FakeStore()
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(), worker(renderer, "x"))
    with pytest.raises(chat.TurnError) as e:
        await run(h, request("r5", "sess-nope"))
    assert e.value.status == 404
    sid = await store.create_session()
    store.sessions[sid]["status"] = "finished"
    with pytest.raises(chat.TurnError) as e:
        await run(h, request("r6", sid))
    assert e.value.status == 409
    assert "r6" not in store.owners  # the lease its lookup took is freed at once, for a retry


async def test_a_new_turn_costs_three_store_calls_and_begins_with_its_first_tokens(renderer):
    # issue 15: the lookup takes the lease, the first append writes the state: no call to begin a request
    store = FakeStore()
    sid = await store.create_session()
    calls: list[str] = []
    for name in ("lookup", "append_deltas", "save_turn", "drop_request", "claim_request", "load_request"):
        method = getattr(store, name)

        async def counted(*a, _name=name, _method=method, **kw):
            begins = _name == "append_deltas" and kw.get("begin", a[3] if len(a) > 3 else None) is not None
            calls.append(_name + "+begin" * begins)
            return await _method(*a, **kw)

        setattr(store, name, counted)
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(), worker(renderer, "hi"))
    done, _ = await run(h, request("r-calls", sid))
    assert done.text == "hi" and len(store.saved) == 1
    assert calls[0] == "lookup" and calls[1] == "append_deltas+begin" and calls[-1] == "save_turn"
    assert set(calls[2:-1]) <= {"append_deltas"}, calls  # a plain reply's later tokens, if any


async def test_a_reply_that_comes_whole_on_the_done_is_saved_with_the_turn_and_never_appended(renderer):
    # a plain turn shorter than the worker's hold (shared/deltas.Held): lookup and save, two store calls
    # a turn; its tokens are recorded and its text comes with the ChatDone
    store = FakeStore()
    sid = await store.create_session()
    ids = renderer.encode("all at once") + [renderer.eos_id]

    async def call(w, cmd):
        yield GenerateDone(cmd.request_id, "stop", len(cmd.prompt_ids), 3, w, tail_ids=ids, tail_logprobs=[-0.5] * len(ids))

    calls: list[str] = []
    for name in ("lookup", "append_deltas", "save_turn"):
        method = getattr(store, name)

        async def counted(*a, _name=name, _method=method, **kw):
            calls.append(_name)
            return await _method(*a, **kw)

        setattr(store, name, counted)
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(), call)
    done, sent = await run(h, request("r-whole", sid))
    assert calls == ["lookup", "save_turn"] and done.text == "all at once" and done.finish_reason == "stop"
    assert not [m for m in sent if isinstance(m, ChatDelta) and m.text]  # shown with the ChatDone only
    (_, turn, _), = store.saved
    assert [(s.token_ids, s.version) for s in turn.segments] == [(ids, 3)]
    # a stop string inside it cuts it there, as it would a delta
    done, _ = await run(h, replace_stop(request("r-whole-stop", sid), ["at"]))
    assert done.text == "all " and done.finish_reason == "stop"


def replace_stop(req: ChatRequest, stop: list[str]) -> ChatRequest:
    from msgspec.structs import replace

    return replace(req, stop=stop)


async def test_a_resent_copy_of_a_request_whose_replica_died_before_its_first_tokens_starts_it(renderer):
    # its lookup took the lease, then its replica died: nothing to resume, so the copy begins it once the lease lapses
    store = FakeStore()
    sid = await store.create_session()
    store.owners["r-orphan"] = "dead-replica"
    h = TurnHandler(TrajectoryConfig(worker_wait=2, resume_wait=10), store, renderer, table(), worker(renderer, "hello"))

    async def lapse():
        await asyncio.sleep(0.15)  # three polls
        del store.owners["r-orphan"]

    (done, _), _ = await asyncio.wait_for(asyncio.gather(run(h, request("r-orphan", sid)), lapse()), 10)
    assert done.text == "hello" and len(store.saved) == 1 and "r-orphan" not in store.owners
    # without a session: the copy makes the anonymous one once it leads, and only then
    store.owners["r-orphan-anon"] = "dead-replica"
    task = asyncio.create_task(run(h, request("r-orphan-anon")))
    await asyncio.sleep(0.1)  # two polls
    assert len(store.sessions) == 1  # waiting: none made yet
    del store.owners["r-orphan-anon"]
    done, _ = await asyncio.wait_for(task, 10)
    assert done.text == "hello" and len(store.sessions) == 2 and done.session_id != sid


class TreeStore(FakeStore):
    """FakeStore that also keeps the prefix tree: turns, conversation keys, aliases, cached paths."""

    def __init__(self):
        super().__init__()
        self.turns_: dict[int, object] = {}
        self.idx: dict[str, int] = {}
        self.alias: dict[str, object] = {}
        self.paths: dict[int, object] = {}  # turn id -> its TokenPath
        self.followed = 0

    async def find_turn(self, sid, keys):
        return next(((k, self.idx[k]) for k in keys if k in self.idx), None)

    async def turns(self, sid):
        return dict(self.turns_)

    async def follow(self, sid, raw):
        from services.trajectory.store import Followed

        if raw not in self.alias:
            return None
        self.followed += 1
        alias = self.alias[raw]
        return Followed(alias, self.paths.get(alias.turn_id))

    async def lookup(self, rid, sid, follow="", owner="", lease_ms=0):
        """As Store.lookup: the follow in the same call (counted once, like a separate follow)."""
        from msgspec.structs import replace

        look = await super().lookup(rid, sid, owner=owner, lease_ms=lease_ms)
        return replace(look, follow=follow, followed=await self.follow(sid, follow)) if sid and follow else look

    async def path(self, sid, tid):
        return self.paths.get(tid)

    async def save_turn(self, sid, turn, worker, result=b"", path=None, alias=None, owner="", began=True):
        if not await super().save_turn(sid, turn, worker, result, owner, began):
            return False
        self.turns_[turn.turn_id] = turn
        self.idx[turn.key] = turn.turn_id
        if path is not None:
            self.paths[turn.turn_id] = path
            self.paths.pop(turn.parent, None)
        if alias is not None:
            self.alias[alias[0]] = alias[1]
        return True


async def test_each_turn_extends_the_last_one_by_what_it_adds(renderer):
    from services.trajectory.turns import path, sample

    store = TreeStore()
    sid = await store.create_session()
    msgs = [{"role": "system", "content": "be brief"}]
    for t in range(4):
        msgs.append({"role": "user", "content": f"step {t}"})
        calls: list = []
        h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(),
                        worker(renderer, f"ok {t}", calls=calls))
        req = ChatRequest(f"r{t}", sid, "chat", "m", Sampling(max_tokens=64, temperature=0.0), messages=list(msgs))
        done, _ = await run(h, req)
        # the prompt is the stored path plus the continuation: what a full render gives for canonical tokens
        assert calls[0].prompt_ids == renderer.prompt(msgs, [])
        msgs.append({"role": "assistant", "content": done.text, "refusal": None})  # as an SDK echoes it
    turns = await store.turns(sid)
    assert [t.parent for t in turns.values()] == [-1, 0, 1, 2]
    assert store.followed == 3 and list(store.paths) == [3]  # found by raw digest; only the leaf's path kept
    assert sample(path(turns, 3)).token_ids == store.paths[3]
    # an agent that re-serializes its messages (other key order, no extra fields) misses the raw digest;
    # the conversation keys still find the turn
    reordered = [{"content": m["content"], "role": m["role"]} for m in msgs] + [{"role": "user", "content": "more"}]
    await run(TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(), worker(renderer, "y")),
              ChatRequest("r8", sid, "chat", "m", Sampling(max_tokens=64, temperature=0.0), messages=reordered))
    assert store.turns_[4].parent == 3 and store.followed == 3
    # an agent that rewrites an old message is not the same conversation: a new root
    msgs[1] = {"role": "user", "content": "step 0, edited"}
    msgs.append({"role": "user", "content": "again"})
    await run(TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(), worker(renderer, "x")),
              ChatRequest("r9", sid, "chat", "m", Sampling(max_tokens=64, temperature=0.0), messages=msgs))
    assert store.turns_[5].parent == -1
