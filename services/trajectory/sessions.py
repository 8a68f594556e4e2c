"""Session lifecycle: create (with staleness admission), get, reward, finish (publishes
TrajectoryCompleted with its staleness)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.js import JetStreamContext

from services.trajectory import turns as turn_tree
from services.trajectory.store import SessionFinished, SessionNotFound, Store
from shared import bus, subjects
from shared.admission import Admission, Backlog, BacklogUnknown, staleness
from shared.messages import SessionReply, SessionRequest, TrajectoryCompleted


class SessionOps:
    def __init__(
        self,
        store: Store,
        js: JetStreamContext,
        admission: Admission,
        open_window: float,
        policy_version: Callable[[], int],
        backlog: Callable[[], Awaitable[Backlog]],
    ):
        self.store, self.js, self.admission = store, js, admission
        self.open_window = open_window
        self.policy_version = policy_version
        self.backlog = backlog

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
        meta = await self.store.session(sid)
        if meta["status"] == "finished":
            return SessionReply(200, sid, "already finished", body={"reward": meta["reward"]})
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
        # durable first, then mark finished: a retry re-publishes under the same id (de-duplicated)
        await bus.publish_durable(self.js, subjects.TRAJ_COMPLETED, event, msg_id=f"traj-{sid}")
        await self.store.mark_finished(sid, float(reward))
        return SessionReply(200, sid, body={"reward": float(reward), "samples": len(samples),
                                            "staleness": event.staleness})
