"""The trajectory store's fast path on real Redis: a turn saved with its spliced token path and
alias is found again by the next request's lookup (one round trip) or by follow, byte for byte."""

from __future__ import annotations

import pytest

from services.trajectory.store import Alias, InFlight, Store
from services.trajectory.tokenpath import TokenPath
from services.trajectory.turns import Segment, Turn
from tests.integration.conftest import begin_request

pytestmark = pytest.mark.integration


async def saved_turn(store: Store, sid: str, rid: str, prompt: TokenPath, reply: list[int], digest: str) -> TokenPath:
    look = await store.lookup(rid, sid)
    assert await begin_request(store, rid, InFlight(sid, look.turn_id, prompt.wire(), prompt.ids, -1, []), "me", 5_000)
    turn = Turn(look.turn_id, -1, prompt.ids, [Segment(reply, [0.0] * len(reply), 0, "w")], "stop", rid, 0.0, key="tk")
    path = prompt + reply
    assert await store.save_turn(sid, turn, "w", path=path, owner="me",
                                 alias=(digest, Alias(turn.turn_id, "rk", "tk", path.last)))
    return path


async def test_the_next_lookup_follows_the_saved_turn_in_the_same_round_trip(store):
    sid = await store.create_session()
    prompt = TokenPath.of(list(range(300))) + [70_000, 5]
    path = await saved_turn(store, sid, "st-r0", prompt, [9, 8, 2], "digest-0")

    look = await store.lookup("st-r1", sid, follow="digest-0")
    assert look.follow == "digest-0" and look.followed is not None
    assert look.followed.alias == Alias(0, "rk", "tk", 2)
    got = look.followed.path
    assert got.last == 2 and got._ids is None  # known from the alias: nothing decoded
    assert got.ids == path.ids == list(range(300)) + [70_000, 5, 9, 8, 2]
    assert (await store.follow(sid, "digest-0")).path.ids == got.ids  # the separate call agrees

    missed = await store.lookup("st-r2", sid, follow="another-digest")
    assert missed.follow == "another-digest" and missed.followed is None
    assert (await store.lookup("st-r3", sid)).follow == ""  # nothing asked: nothing looked up


async def test_an_alias_from_before_last_ids_still_leads_to_its_path(store):
    sid = await store.create_session()
    await saved_turn(store, sid, "st-old-r0", TokenPath.of([1, 2, 3]), [4, 2], "digest-old")
    await store.r.hset(f"sf:s:{sid}:alias", "digest-old", "0 rk tk")  # as an older replica wrote it
    followed = (await store.lookup("st-old-r1", sid, follow="digest-old")).followed
    assert followed.alias.last_id is None and followed.path.last == 2 and followed.path.ids == [1, 2, 3, 4, 2]


async def test_a_running_requests_spliced_prompt_reads_back_as_its_ids(store):
    prompt = TokenPath.from_raw(TokenPath.of([7] * 20).raw) + [1, 2]
    sid = await store.create_session()
    assert await begin_request(store, "st-run", InFlight(sid, 0, prompt.wire(), [1, 2], -1, []), "me", 5_000)
    state, deltas = await store.load_request("st-run")
    assert state.prompt_ids == [7] * 20 + [1, 2] and deltas == []
    await store.drop_request("st-run", "me")
