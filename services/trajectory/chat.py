"""One agent turn: find the session's prefix, build the prompt, generate, record (no sockets).

The transport (`call` to a rollout worker, `emit` to the gateway) and the worker
choice are passed in by service.py; the Redis writes go through store.py.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from typing import Any

from msgspec.structs import replace

from services.trajectory import toolcalls
from services.trajectory.config import TrajectoryConfig
from services.trajectory.conversation import candidate_prefixes, conversation_key
from services.trajectory.generation import Call, GenerationFailed, generate
from services.trajectory.rendering import IncrementalText, Renderer, RenderError
from services.trajectory.routing import WorkerTable
from services.trajectory.store import SessionNotFound, Store
from services.trajectory.turns import Turn, path, token_ids
from shared.messages import ChatDelta, ChatDone, ChatRequest, Usage

Emit = Callable[[Any], Awaitable[None]]


class TurnError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class Prompt:
    ids: list[int]  # everything the engine reads
    new_ids: list[int]  # the part this turn adds after its parent's tokens
    parent: int
    new_messages: list[dict[str, Any]]


class TurnHandler:
    def __init__(self, cfg: TrajectoryConfig, store: Store, renderer: Renderer, table: WorkerTable, call: Call):
        self.cfg, self.store, self.renderer, self.table, self.call = cfg, store, renderer, table, call

    async def handle(self, req: ChatRequest, emit: Emit) -> ChatDone:
        # 1. the session: the agent's, or a one-off one for a plain API key
        sid = req.session_id
        if sid:
            try:
                meta = await self.store.session(sid)
            except SessionNotFound:
                raise TurnError(404, "session_not_found", f"session {sid} does not exist") from None
            if meta["status"] == "finished":
                raise TurnError(409, "session_finished", f"session {sid} is finished; start a new one")
            sticky = meta.get("worker")
        else:
            sid = await self.store.create_session(anonymous=True)
            sticky = None

        # 2. the prompt, reusing the stored tokens of the turn this request extends
        try:
            prompt = await self._prompt(sid, req)
        except RenderError as e:
            raise TurnError(400, "invalid_messages", str(e)) from None
        max_len = self.table.max_model_len(time.time(), self.cfg.max_model_len)
        if len(prompt.ids) >= max_len:
            raise TurnError(400, "context_length_exceeded",
                            f"the prompt is {len(prompt.ids)} tokens; this model's context window is "
                            f"{max_len} tokens")
        sampling = req.sampling
        budget = min(sampling.max_tokens, max_len - len(prompt.ids))

        # 3. generate, streaming text deltas if asked
        text = IncrementalText(self.renderer)
        parse_tools = req.kind == "chat" and bool(req.tools)
        sent = 0

        async def on_tokens(ids: list[int]) -> None:
            nonlocal sent
            text.add(ids)
            if not req.stream:
                return
            visible = toolcalls.visible_prefix(text.text) if parse_tools else text.text
            if len(visible) > sent:
                await emit(ChatDelta(req.request_id, visible[sent:]))
                sent = len(visible)

        last_worker = sticky or ""

        async def pick(exclude: frozenset[str]) -> str:
            nonlocal last_worker
            deadline = time.monotonic() + self.cfg.worker_wait
            while True:
                now = time.time()
                w = self.table.choose(now, sticky, exclude) or self.table.choose(now, sticky)
                if w:
                    last_worker = w
                    return w
                if time.monotonic() > deadline:
                    raise GenerationFailed(f"no rollout worker is serving (waited {self.cfg.worker_wait:.0f}s)", 503)
                await asyncio.sleep(0.05)

        try:
            gen = await generate(self.call, pick, req.request_id, sid, prompt.ids,
                                 replace(sampling, max_tokens=budget), on_tokens, self.cfg.max_redispatch)
        except GenerationFailed as e:
            raise TurnError(e.status, "generation_failed", str(e)) from None

        # 4. the reply the agent sees, and the turn that records it
        full = text.final()
        content, calls = toolcalls.parse(full, req.request_id) if parse_tools else (full, [])
        if req.stream and len(content) > sent:
            await emit(ChatDelta(req.request_id, content[sent:]))
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        key = conversation_key(req.tools, req.messages + [reply]) if req.kind == "chat" else ""
        turn = Turn(
            turn_id=await self.store.next_turn_id(sid),
            parent=prompt.parent,
            prefix_ids=prompt.new_ids,
            segments=gen.segments,
            finish_reason=gen.finish_reason,
            request_id=req.request_id,
            created=time.time(),
            key=key,
            messages=prompt.new_messages,
            reply=reply if req.kind == "chat" else {"role": "assistant", "content": full},
        )
        await self.store.save_turn(sid, turn, last_worker)
        versions: list[int] = []
        for s in gen.segments:
            if not versions or versions[-1] != s.version:
                versions.append(s.version)
        finish = "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason
        return ChatDone(
            request_id=req.request_id,
            text=content,
            finish_reason=finish,
            usage=Usage(prompt_tokens=len(prompt.ids), completion_tokens=len(gen.token_ids)),
            turn_id=turn.turn_id,
            tool_calls=calls,
            versions=versions,
            session_id=sid,
        )

    async def _prompt(self, sid: str, req: ChatRequest) -> Prompt:
        if req.kind == "completion":
            ids = self.renderer.encode(req.prompt)
            return Prompt(ids, ids, -1, [{"role": "user", "content": req.prompt}])
        if not req.messages:
            raise RenderError("messages must not be empty")
        ks = candidate_prefixes(req.messages)
        keys = [conversation_key(req.tools, req.messages[:k]) for k in ks]
        found = await self.store.find_turn(sid, keys)
        if found:
            key, tid = found
            k = ks[keys.index(key)]
            chain = path(await self.store.turns(sid), tid)
            before = token_ids(chain)
            last = chain[-1].generated_ids
            cont = self.renderer.continuation(
                req.messages[:k], req.messages[k:], req.tools,
                history_ends_with_eos=bool(last) and last[-1] == self.renderer.eos_id,
            )
            if cont is not None:
                return Prompt(before + cont, cont, tid, req.messages[k:])
        ids = self.renderer.prompt(req.messages, req.tools)
        return Prompt(ids, ids, -1, req.messages)

