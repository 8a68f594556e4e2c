"""Session lifecycle: create (with stream back-pressure and staleness admission), get, reward,
finish (stores the TrajectoryCompleted, then publishes it: finishing.py)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import msgspec
from services.trajectory import turns as turn_tree
from services.trajectory.config import TrajectoryConfig
from services.trajectory.finishing import Publisher
from services.trajectory.store import SessionFinished, SessionNotFound, Store
from shared.admission import Admission, Backlog, BacklogUnknown, staleness
from shared.codec import decode, encode
from shared.messages import SessionReply, SessionRequest, TrajectoryCompleted


PENDING_RETRY_AFTER = 5.0  # seconds an agent waits before asking again about a pending finish


class SessionOps:
    def __init__(
        self,
        store: Store,
        publisher: Publisher,
        cfg: TrajectoryConfig,
        policy_version: Callable[[], int],
        backlog: Callable[[], Awaitable[Backlog]],
        pressure: Callable[[], SessionReply | None] = lambda: None,
    ):
        self.store, self.publisher, self.admission = store, publisher, Admission(cfg.max_staleness)
        self.open_window = cfg.open_session_timeout
        self.policy_version = policy_version
        self.backlog = backlog
        self.pressure = pressure  # the stream's back-pressure: a refusal (429/503) while it is too full
        self.publish_wait = cfg.publish_wait

    async def handle(self, req: SessionRequest) -> SessionReply:
        try:
            match req.op:
                case "create":
                    return await self.create(req)
                case "get":
                    return SessionReply(200, req.session_id, body=await self.trajectory(req.session_id))
                case "reward":
                    if req.reward is None:
                        return SessionReply(400, req.session_id, "reward is required")
                    await self.store.set_reward(req.session_id, req.reward)
                    return SessionReply(200, req.session_id)
                case "finish":
                    return await self.finish(req.session_id, req.reward)
        except SessionNotFound:
            return SessionReply(404, req.session_id, f"session {req.session_id} does not exist")
        except SessionFinished:
            return SessionReply(409, req.session_id, f"session {req.session_id} is already finished")
        return SessionReply(400, message=f"unknown op {req.op}")

    async def create(self, req: SessionRequest) -> SessionReply:
        if (refused := self.pressure()) is not None:  # with or without staleness admission
            return refused
        if self.admission.enabled:
            try:
                backlog = await self.backlog()
            except BacklogUnknown as e:
                return SessionReply(503, message=f"admission control cannot read the trainer's backlog: {e}")
            open_now = await self.store.count_open(time.time() - self.open_window)
            if not self.admission.admit(open_now, backlog):
                return SessionReply(429, message=self.admission.refusal(open_now, backlog))
        sid = await self.store.create_session(req.group_id, req.metadata)
        meta = await self.store.session(sid)
        return SessionReply(200, sid, body={"group_id": meta["group_id"], "policy_version": self.policy_version()})

    async def trajectory(self, sid: str) -> dict:
        meta = await self.store.session(sid)
        turns = await self.store.turns(sid)
        samples = turn_tree.samples(turns)
        return {
            "id": sid,
            "group_id": meta["group_id"],
            "status": meta["status"],
            "reward": meta["reward"],
            "metadata": meta["metadata"],
            "staleness": max((staleness(self.policy_version(), s.versions) for s in samples), default=0),
            "turns": [
                {
                    "turn_id": t.turn_id,
                    "parent": t.parent,
                    "request_id": t.request_id,
                    "finish_reason": t.finish_reason,
                    "prefix_ids": t.prefix_ids,
                    "segments": [msgspec.structs.asdict(s) for s in t.segments],
                    "messages": t.messages,
                    "reply": t.reply,
                }
                for t in sorted(turns.values(), key=lambda t: t.turn_id)
            ],
            "samples": [msgspec.structs.asdict(s) for s in samples],
        }

    async def finish(self, sid: str, reward: float | None) -> SessionReply:
        """open -> finishing (the event stored in Redis) -> published -> finished. Answers once the
        trajectory is durable in the stream, or 503 + Retry-After while it waits for room; a retry is
        idempotent (the stored event, the same de-dup id)."""
        meta = await self.store.session(sid)
        if meta["status"] == "finished":
            return SessionReply(200, sid, "already finished", body={"reward": meta["reward"]})
        if meta["status"] == "finishing":
            status, raw = "finishing", await self.store.finishing_event(sid) or b""
        else:
            reply_or_event = await self._event(sid, meta, reward)
            if isinstance(reply_or_event, SessionReply):
                return reply_or_event
            status, raw = await self.store.begin_finish(sid, reply_or_event.reward, encode(reply_or_event))
        if status == "missing":
            raise SessionNotFound(sid)
        if status == "finished" or not raw:  # finished by another replica meanwhile
            meta = await self.store.session(sid)
            return SessionReply(200, sid, "already finished", body={"reward": meta["reward"]})
        event = decode(raw, TrajectoryCompleted)
        if not await self.publisher.publish(sid, raw, self.publish_wait):
            return SessionReply(
                503, sid, f"session {sid} is finishing: its trajectory is stored and waits for room in the "
                "trajectory stream (the trainer is behind); it will be published without further action. "
                "Retry finish to confirm.", retry_after=PENDING_RETRY_AFTER, code="trajectory_pending")
        return SessionReply(200, sid, body={"reward": event.reward, "samples": len(event.samples),
                                            "staleness": event.staleness})

    async def _event(self, sid: str, meta: dict, reward: float | None) -> TrajectoryCompleted | SessionReply:
        """The TrajectoryCompleted of an open session, or why it cannot finish."""
        reward = reward if reward is not None else meta["reward"]
        if reward is None:
            return SessionReply(400, sid, "no reward: pass one to finish or POST it to /reward first")
        turns = await self.store.turns(sid)
        if not turns:
            return SessionReply(400, sid, "session has no turns to train on")
        samples = turn_tree.samples(turns)
        version = self.policy_version()
        event = TrajectoryCompleted(
            session_id=sid,
            group_id=meta["group_id"],
            reward=float(reward),
            samples=samples,
            metadata=meta["metadata"],
            finished_at=time.time(),
            policy_version=version,
            staleness=max(staleness(version, s.versions) for s in samples),
        )
        return event
