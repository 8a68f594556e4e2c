"""Session lifecycle: create, get, reward, finish (publishes TrajectoryCompleted)."""

from __future__ import annotations

import time

import msgspec
from nats.js import JetStreamContext

from services.trajectory import turns as turn_tree
from services.trajectory.store import SessionFinished, SessionNotFound, Store
from shared import bus, subjects
from shared.messages import SessionReply, SessionRequest, TrajectoryCompleted


class SessionOps:
    def __init__(self, store: Store, js: JetStreamContext):
        self.store, self.js = store, js

    async def handle(self, req: SessionRequest) -> SessionReply:
        try:
            match req.op:
                case "create":
                    sid = await self.store.create_session(req.group_id, req.metadata)
                    meta = await self.store.session(sid)
                    return SessionReply(200, sid, body={"group_id": meta["group_id"]})
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

    async def trajectory(self, sid: str) -> dict:
        meta = await self.store.session(sid)
        turns = await self.store.turns(sid)
        return {
            "id": sid,
            "group_id": meta["group_id"],
            "status": meta["status"],
            "reward": meta["reward"],
            "metadata": meta["metadata"],
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
            "samples": [msgspec.structs.asdict(s) for s in turn_tree.samples(turns)],
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
        event = TrajectoryCompleted(
            session_id=sid,
            group_id=meta["group_id"],
            reward=float(reward),
            samples=turn_tree.samples(turns),
            metadata=meta["metadata"],
            finished_at=time.time(),
        )
        # durable first, then mark finished: a retry re-publishes under the same id (de-duplicated)
        await bus.publish_durable(self.js, subjects.TRAJ_COMPLETED, event, msg_id=f"traj-{sid}")
        await self.store.mark_finished(sid, float(reward))
        return SessionReply(200, sid, body={"reward": float(reward), "samples": len(event.samples)})
