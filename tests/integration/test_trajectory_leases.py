"""Request leases in Redis (real Redis): who may renew them, and what a re-sent request
does while the replica that started it is still alive, or after it died."""

from __future__ import annotations

import asyncio

import pytest

from services.trajectory import chat
from services.trajectory.chat import TurnError, TurnHandler
from services.trajectory.config import TrajectoryConfig
from services.trajectory.routing import WorkerTable
from services.trajectory.store import DeltaRecord, InFlight, Store
from tests.integration.conftest import begin_request

pytestmark = pytest.mark.integration


def handler(store: Store, resume_wait: float = 5.0) -> TurnHandler:
    return TurnHandler(TrajectoryConfig(resume_wait=resume_wait), store, renderer=None, table=WorkerTable(5.0), call=None)


def state() -> InFlight:
    return InFlight("sess-x", 0, [1, 2, 3], [1, 2, 3], -1, [])


async def test_only_the_holder_renews_a_lease(store):
    rid = "lease-renew"
    assert await begin_request(store, rid, state(), "replica-a", 10_000)
    assert not await store.renew_lease(rid, "replica-b", 60_000)
    assert await store.r.pttl(f"sf:req:{rid}:owner") <= 10_000
    assert await store.renew_lease(rid, "replica-a", 60_000)
    assert await store.r.pttl(f"sf:req:{rid}:owner") > 10_000
    await store.drop_request(rid, "replica-a")


async def test_many_leases_renew_in_one_call_each_only_for_its_holder(store, monkeypatch):
    monkeypatch.setattr("services.trajectory.store.RENEW_BATCH", 2)  # 5 leases: three calls
    rids = [f"lease-many-{i}" for i in range(5)]
    for rid in rids:
        assert await begin_request(store, rid, state(), "replica-a", 10_000)
    await store.r.set(f"sf:req:{rids[1]}:owner", "replica-b", px=10_000)  # taken over
    await store.r.delete(f"sf:req:{rids[3]}:owner")  # lapsed, nobody took it: a renewal does not revive it
    got = await store.renew_leases([(rid, "replica-a") for rid in rids], 60_000)
    assert got == [True, False, True, False, True]
    ttl = [await store.r.pttl(f"sf:req:{rid}:owner") for rid in rids]
    assert ttl[0] > 10_000 and ttl[2] > 10_000 and ttl[4] > 10_000 and ttl[1] <= 10_000 and ttl[3] == -2
    assert await store.renew_leases([], 60_000) == []
    for rid in rids:
        await store.r.delete(f"sf:req:{rid}", f"sf:req:{rid}:owner")


async def test_a_resend_waits_for_a_live_replica_and_gets_its_result(store):
    rid = "lease-live"
    assert await begin_request(store, rid, state(), "replica-a", 1_000)
    h = handler(store)

    async def replica_a_finishes():  # alive: renews its lease, then finishes
        for _ in range(6):
            await asyncio.sleep(0.25)
            assert await store.renew_lease(rid, "replica-a", 1_000)
        await store.r.set(f"sf:done:{rid}", b"the result", ex=60)
        await store.drop_request(rid, "replica-a")

    a = asyncio.create_task(replica_a_finishes())
    with pytest.raises(chat._FinishedElsewhere) as got:
        await h._resume(rid)  # replica b, meanwhile, renewing nothing of a's
    await a
    assert got.value.done == b"the result"


async def test_a_resend_takes_over_when_the_holder_died(store):
    rid = "lease-dead"
    assert await begin_request(store, rid, state(), "replica-a", 500)
    assert await store.append_deltas(rid, [DeltaRecord("w0", True, 3, [7, 8], [-0.5, -0.25])], "replica-a")
    h = handler(store)
    prompt, partial, turn_id = await asyncio.wait_for(h._resume(rid), 5)  # after a's lease lapses
    assert prompt.ids == [1, 2, 3] and partial.token_ids == [7, 8] and partial.segments[0].version == 3
    assert await store.r.get(f"sf:req:{rid}:owner") == h.owner.encode()
    await store.drop_request(rid, h.owner)


async def test_a_resend_gives_up_after_resume_wait(store):
    rid = "lease-stuck"
    assert await begin_request(store, rid, state(), "replica-a", 60_000)
    with pytest.raises(TurnError) as e:
        await handler(store, resume_wait=0.5)._resume(rid)
    assert e.value.status == 409 and "still being served" in str(e.value)
    await store.drop_request(rid, "replica-a")


async def test_only_the_holder_drops_a_request(store):
    # bug 1: a replica that lost the lease deleted the state its successor continues from
    rid = "lease-drop"
    assert await begin_request(store, rid, state(), "replica-a", 60_000)
    assert await store.append_deltas(rid, [DeltaRecord("w0", True, 0, [7], [-0.5])], "replica-a")
    assert not await store.drop_request(rid, "replica-b")
    assert await store.load_request(rid) is not None
    assert await store.drop_request(rid, "replica-a")
    assert await store.load_request(rid) is None and await store.r.get(f"sf:req:{rid}:owner") is None


async def test_a_replica_paused_past_its_lease_writes_nothing_of_a_request_taken_over(store):
    # found by tests/faults (SIGSTOP of a replica): once continued, it appended its worker's tokens to
    # the request its successor was serving, and saved its own turn over the successor's
    rid = "lease-paused"
    assert await begin_request(store, rid, state(), "replica-a", 60_000)
    await store.r.set(f"sf:req:{rid}:owner", "replica-b", px=60_000)  # b took it over
    assert not await store.append_deltas(rid, [DeltaRecord("w0", True, 0, [7], [-0.5])], "replica-a")
    assert not await store.hold(rid, "replica-a", 3_000)
    assert (await store.load_request(rid))[1] == []
    assert await store.append_deltas(rid, [DeltaRecord("w1", True, 0, [9], [-0.5])], "replica-b")
    assert await store.hold(rid, "replica-b", 3_000)
    await store.drop_request(rid, "replica-b")  # b finished: the request is gone, for a as for anyone
    assert not await store.hold(rid, "replica-a", 3_000)
    assert not await store.append_deltas(rid, [DeltaRecord("w0", True, 0, [7], [-0.5])], "replica-a")
    assert await store.r.exists(f"sf:req:{rid}:deltas") == 0


async def test_a_turn_is_saved_only_by_its_lease_holder(store):
    # the save checks the lease in its own script (one round trip; it was hold + save)
    from services.trajectory.turns import Segment, Turn

    sid = await store.create_session()
    turn = Turn(0, -1, [1, 2, 3], [Segment([7], [-0.5], 0)], "stop", "lease-save", 0.0)
    assert await begin_request(store, "lease-save", state(), "replica-a", 60_000)
    await store.r.set("sf:req:lease-save:owner", "replica-b", px=60_000)  # b took it over
    assert not await store.save_turn(sid, turn, "w0", result=b"a's", owner="replica-a")
    assert await store.turns(sid) == {} and await store.done("lease-save") is None
    assert await store.save_turn(sid, turn, "w1", result=b"b's", owner="replica-b")
    assert list(await store.turns(sid)) == [0] and await store.done("lease-save") == b"b's"
    assert await store.r.exists("sf:req:lease-save", "sf:req:lease-save:owner") == 0
    # the request ended (saved by b): a, continued, writes nothing
    assert not await store.save_turn(sid, turn, "w0", result=b"a's", owner="replica-a")
    assert await store.done("lease-save") == b"b's"


async def test_a_new_requests_lookup_takes_its_lease_and_its_first_tokens_begin_it(store):
    # one round trip less a turn: no call of its own to begin a request (issue 15)
    rid = "lease-new"
    look = await store.lookup(rid, "", owner="replica-a", lease_ms=60_000)
    assert look.leased and look.state is None and await store.r.get(f"sf:req:{rid}:owner") == b"replica-a"
    assert (await store.lookup(rid, "", owner="replica-a", lease_ms=60_000)).leased  # its own: still held
    assert not (await store.lookup(rid, "", owner="replica-b", lease_ms=60_000)).leased  # a re-sent copy waits
    assert await store.load_request(rid) is None  # nothing begun yet: a resume finds no state
    assert not await store.append_deltas(rid, [DeltaRecord("w1", True, 0, [9], [-0.5])], "replica-b", begin=state())
    assert await store.append_deltas(rid, [DeltaRecord("w0", True, 0, [7], [-0.5])], "replica-a", begin=state())
    got, deltas = await store.load_request(rid)
    assert got == state() and [d.token_ids for d in deltas] == [[7]]
    # begun: a lookup finds its state and takes no lease; a second beginning is refused, even by its holder
    assert not (await store.lookup(rid, "", owner="replica-b", lease_ms=60_000)).leased
    assert not await store.append_deltas(rid, [DeltaRecord("w0", True, 0, [8], [-0.5])], "replica-a", begin=state())
    await store.drop_request(rid, "replica-a")
    # finished elsewhere: no lease, and no beginning
    await store.r.set(f"sf:done:{rid}", b"the result", ex=60)
    look = await store.lookup(rid, "", owner="replica-c", lease_ms=60_000)
    assert look.done == b"the result" and not look.leased
    assert not await store.append_deltas(rid, [], "replica-c", begin=state())
    await store.r.delete(f"sf:done:{rid}")


async def test_a_turn_never_begun_is_saved_only_while_nobody_began_or_finished_it(store):
    # a turn whose state was never written (no tokens appended) is saved by its lease holder, unless another
    # handling began the request meanwhile (or finished it)
    from services.trajectory.turns import Segment, Turn

    sid = await store.create_session()
    turn = Turn(0, -1, [1, 2, 3], [Segment([7], [-0.5], 0)], "stop", "lease-unbegun", 0.0)
    assert (await store.lookup("lease-unbegun", sid, owner="replica-a", lease_ms=60_000)).leased
    await store.r.delete("sf:req:lease-unbegun:owner")  # lapsed: b takes it and begins
    assert (await store.lookup("lease-unbegun", sid, owner="replica-b", lease_ms=60_000)).leased
    assert await store.append_deltas("lease-unbegun", [], "replica-b", begin=state())
    await store.r.delete("sf:req:lease-unbegun:owner")  # b's lapsed too, and nobody holds it
    assert not await store.save_turn(sid, turn, "w0", result=b"a's", owner="replica-a", began=False)
    assert await store.turns(sid) == {}
    await store.drop_request("lease-unbegun", "replica-b")  # b failed: nothing begun, nothing finished
    assert await store.save_turn(sid, turn, "w0", result=b"a's", owner="replica-a", began=False)
    assert list(await store.turns(sid)) == [0] and await store.done("lease-unbegun") == b"a's"
    assert not await store.save_turn(sid, turn, "w0", result=b"again", owner="replica-a", began=False)
