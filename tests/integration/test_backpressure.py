"""Issue 16 end to end: a full TRAJECTORIES stream pushes back instead of discarding.

Real nats-server (private: the trainer consumes the whole stream), real Redis (its own database),
trajectory-manager replicas and the trainer as real processes; the stream limited to 256 KiB.
Chat turns are faked: each session gets one stored turn (a 1,200-token sample) written straight
into Redis, then the agents use the session API (sf.session.*) as the gateway would.

1. With the trainer stopped, agents finish sessions until new ones are refused with 429.
2. Sessions admitted earlier finish too and overflow the stream: their finishes retry, on
   replica A, which is SIGKILLed while retrying. Every finished session is in the stream or
   pending in Redis; none is lost.
3. Replica B starts: still 429; a retried finish of a pending session is a 503 with Retry-After.
4. The trainer starts: it trains every finished session exactly once (audit log), B trims the
   trained ones and publishes the pending ones, and admission reopens.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from pathlib import Path

import pytest

from seamlessflow.stack import servers
from services.trainer import audit
from services.trajectory.store import FINISHING, Store
from services.trajectory.turns import Segment, Turn
from shared import bus, subjects
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages import SessionReply, SessionRequest, TrajectoryCompleted
from tests.integration.test_trainer_service import Trainer, trainer_env

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

LIMIT = 256 * 1024
TOKENS = 1200  # ~16 KB per TrajectoryCompleted: the stream holds ~16
RESERVE_GROUPS = 4  # admitted at the start, finished once the stream is past its high-water mark


class Proc(Trainer):
    """A service process with its output in a log file (the trainer test's helper)."""

    @classmethod
    def trajectory(cls, model: Path, env: dict[str, str], log: Path) -> "Proc":
        return cls([sys.executable, "-m", "services.trajectory", "--model", str(model)], env, log)


def limits_env() -> dict[str, str]:
    return {"SF_TRAJECTORIES_MAX_BYTES": str(LIMIT)}


async def session(nc, op: str, timeout: float = 10.0, **kw) -> SessionReply:
    data = await bus.request(nc, subjects.session_op(op), encode(SessionRequest(op=op, **kw)), timeout)
    return decode(data, SessionReply)


async def fake_turn(store: Store, sid: str, rng: random.Random) -> None:
    prompt = 200
    ids = [rng.randrange(5, 500) for _ in range(TOKENS)]
    turn = Turn(turn_id=0, parent=-1, prefix_ids=ids[:prompt],
                segments=[Segment(ids[prompt:], [-6.2 + rng.uniform(-0.2, 0.2) for _ in ids[prompt:]], 0, "w0")],
                finish_reason="length", request_id=f"req-{sid}", created=time.time())
    await store.save_turn(sid, turn, "w0")


async def open_group(nc, store: Store, g: str, rng: random.Random) -> list[str] | None:
    """Two sessions of one GRPO group with a turn each; None (and nothing left to finish) when refused."""
    sids = []
    for _ in range(2):
        reply = await session(nc, "create", group_id=g)
        if reply.status != 200:
            assert reply.status == 429 and reply.code == "backpressure" and reply.retry_after > 0, reply
            return None
        sids.append(reply.session_id)
        await fake_turn(store, reply.session_id, rng)
    return sids


async def in_stream(js) -> list[str]:
    info = await js.stream_info(subjects.TRAJECTORIES_STREAM)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await js.get_msg(subjects.TRAJECTORIES_STREAM, seq)
        except Exception:
            continue
        out.append(decode(raw.data, TrajectoryCompleted).session_id)
    return out


async def pending(store: Store) -> set[str]:
    sids = {m.decode() for m in await store.r.zrange(FINISHING, 0, -1)}
    for sid in sids:
        assert await store.finishing_event(sid), f"{sid} is pending without its stored event"
    return sids


async def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def trained_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [i for r in audit.read(path) if r["event"] == "step" for i in r["ids"]]


async def test_a_full_stream_pushes_back_and_loses_nothing(tmp_path, tiny_model, redis_url):
    port = servers.free_port()
    nats_proc = servers.start_nats(port, tmp_path / "nats")
    url = f"nats://127.0.0.1:{port}"
    redis_db = redis_url.rsplit("/", 1)[0] + "/11"
    store = Store.connect(redis_db, ttl=3600)
    await store.r.flushdb()
    base = {**trainer_env(url, tmp_path, "trainer"), "SF_REDIS_URL": redis_db, **limits_env(),
            "SF_TRAJECTORY_FILL_POLL": "0.2"}
    for k in [k for k in base if k.startswith("SF_TRAINER_")]:
        del base[k]
    procs: list[Proc] = []
    nc = await bus.connect(Connections(nats_url=url), name="agents")
    js = nc.jetstream()
    rng = random.Random(16)
    try:
        # replica A: a finish waits up to 60 s for room, so it is still retrying when it is killed
        a = Proc.trajectory(tiny_model, {**base, "SF_TRAJECTORY_PUBLISH_WAIT": "60"}, tmp_path / "traj-a.log")
        procs.append(a)
        await a.wait_for("trajectory manager ready", 60)

        # 1. the reserve, admitted while the stream is empty; then fill until a session is refused
        reserve = [await open_group(nc, store, f"r{g}", rng) for g in range(RESERVE_GROUPS)]
        assert all(reserve)
        finished: list[str] = []
        for g in range(64):
            sids = await open_group(nc, store, f"g{g}", rng)
            if sids is None:
                break
            replies = [await session(nc, "finish", session_id=s, reward=float(i)) for i, s in enumerate(sids)]
            assert all(r.status == 200 for r in replies), replies  # durable before the reply
            finished += sids
            await asyncio.sleep(0.25)  # a fill reading between groups
        else:
            pytest.fail("sessions were never refused")
        assert sorted(await in_stream(js)) == sorted(finished)
        info = await js.stream_info(subjects.TRAJECTORIES_STREAM)
        assert str(info.config.discard) in ("new", "DiscardPolicy.NEW") and info.state.bytes >= 0.8 * LIMIT

        # 2. the reserve finishes: the stream overflows, those finishes retry on A; SIGKILL A meanwhile
        reserve_ids = [s for pair in reserve for s in pair]
        finishes = [asyncio.create_task(session(nc, "finish", timeout=8, session_id=s, reward=1.0))
                    for s in reserve_ids]

        async def retrying() -> bool:
            return len(await pending(store)) > 0 and sum(t.done() for t in finishes) + len(await pending(store)) \
                >= len(reserve_ids)

        await wait_for(retrying, 20, "finishes retrying on a full stream")
        await asyncio.sleep(0.5)
        a.kill(signal.SIGKILL)
        a.proc.wait()
        results = await asyncio.gather(*finishes, return_exceptions=True)
        unanswered = [s for s, r in zip(reserve_ids, results) if isinstance(r, Exception)]
        assert unanswered, "A answered every finish before it died"
        assert all(r.status == 200 for r in results if not isinstance(r, Exception)), results
        # finished: every session whose finish took effect (stored), answered or not
        finished += [s for s in reserve_ids if (await store.session(s))["status"] != "open"]
        stuck = await pending(store)
        stream_ids = await in_stream(js)
        assert stuck and sorted(stream_ids + sorted(stuck)) == sorted(finished), "a finished session was lost"
        assert "high-water mark" in a.text() and a.text().count("new sessions are refused") == 1

        # 3. replica B: still full, so 429; a retried finish is pending: 503 with Retry-After
        b = Proc.trajectory(tiny_model, {**base, "SF_TRAJECTORY_PUBLISH_WAIT": "1"}, tmp_path / "traj-b.log")
        procs.append(b)
        await b.wait_for("trajectory manager ready", 60)
        refused = await session(nc, "create")
        assert refused.status == 429 and refused.retry_after > 0 and "back-pressure" in refused.message
        one = sorted(stuck)[0]
        again = await session(nc, "finish", session_id=one, reward=1.0)
        assert again.status == 503 and again.retry_after > 0 and again.code == "trajectory_pending", again
        # the agents whose finish went unanswered retry it (idempotent): now every reserve session is finished
        retried = await asyncio.gather(*(session(nc, "finish", session_id=s, reward=1.0) for s in unanswered))
        assert all(r.status in (200, 503) for r in retried), retried
        finished = list(dict.fromkeys(finished + reserve_ids))
        assert sorted(await in_stream(js) + sorted(await pending(store))) == sorted(finished)

        # 4. the trainer: trains every finished session once; B trims and publishes the pending ones
        audit_path = tmp_path / "trained.jsonl"
        env = {**trainer_env(url, tmp_path, "trainer", SF_TRAINER_GROUP_SIZE="2", SF_TRAINER_GROUPS_PER_STEP="1",
                             SF_TRAINER_CHECKPOINT_EVERY="1", SF_TRAINER_KEEP_CHECKPOINTS="1"), **limits_env()}
        trainer = Trainer.start(tiny_model, env, tmp_path / "trainer.log")
        procs.append(trainer)

        async def all_trained() -> bool:
            assert trainer.proc.poll() is None, trainer.text()[-3000:]
            return set(trained_ids(audit_path)) >= set(finished)

        await wait_for(all_trained, 400, "the trainer to train every finished session")
        ids = trained_ids(audit_path)
        assert len(ids) == len(set(ids)), "a session was trained twice"
        assert not await pending(store)
        assert (await session(nc, "finish", session_id=one, reward=1.0)).status == 200

        async def admitted() -> bool:
            return (await session(nc, "create")).status == 200

        await wait_for(admitted, 20, "admission to reopen")
        assert "sessions are admitted again" in b.text() and "trimmed trained trajectories" in b.text()
    finally:
        for p in procs:
            p.kill(signal.SIGTERM)
        for p in procs:
            try:
                p.proc.wait(timeout=30)
            except Exception:
                p.kill(signal.SIGKILL)
        await nc.close()
        await store.close()
        servers.stop(nats_proc)
