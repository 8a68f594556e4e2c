"""One agent turn: find the session's prefix, build the prompt, generate, record (no sockets).

The transport (`call` to a rollout worker, `emit` to the gateway) and the worker choice
are passed in by service.py; Redis goes through store.py.

A request's tokens are persisted (store.append_delta) before the agent sees them. If the
replica serving a request dies, the gateway re-sends the same request_id; whichever
replica gets it waits for the dead one's lease to lapse, rebuilds the partial generation
from Redis and continues it, so the agent's HTTP request still completes.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from msgspec.structs import replace

from services.trajectory import toolcalls
from services.trajectory.config import TrajectoryConfig
from services.trajectory.conversation import candidate_prefixes, conversation_key
from services.trajectory.generation import Call, Generated, GenerationFailed, generate, head
from services.trajectory.rendering import IncrementalText, Renderer, RenderError
from services.trajectory.routing import WorkerTable
from services.trajectory.stopstrings import StopMatcher
from services.trajectory.store import DeltaRecord, InFlight, Lookup, SessionNotFound, Store
from services.trajectory.turns import Turn, path, token_ids
from shared.codec import decode, encode
from shared.messages import ChatDelta, ChatDone, ChatRequest, TokenDelta, TokenLogprob, Usage
from shared.messages.chat import KEEPALIVE_INTERVAL

Emit = Callable[[Any], Awaitable[None]]
LEASE_MS = 3000
PREFER_OTHER_WORKER_S = 2.0  # after a preemption, how long to wait for a worker other than the preempter
PERSIST_CHUNK = 32  # tokens a plain (non-stream) request buffers before persisting
PROGRESS_INTERVAL = 0.5  # seconds between text deltas of a request the agent does not stream
RESUME_POLL = 0.2  # seconds between checks while a re-sent request waits for the replica serving it


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


class _FinishedElsewhere(Exception):
    def __init__(self, done: bytes):
        self.done = done


class TurnHandler:
    def __init__(self, cfg: TrajectoryConfig, store: Store, renderer: Renderer, table: WorkerTable, call: Call):
        self.cfg, self.store, self.renderer, self.table, self.call = cfg, store, renderer, table, call
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"

    async def handle(self, req: ChatRequest, emit: Emit) -> ChatDone:
        rid = req.request_id
        sid = req.session_id or await self.store.create_session(anonymous=True)
        try:
            look = await self.store.lookup(rid, sid)
        except SessionNotFound:
            raise TurnError(404, "session_not_found", f"session {sid} does not exist") from None
        # 0. a retry of a request that already finished gets the same answer
        if look.done is not None:
            return decode(look.done, ChatDone)
        keepalive = asyncio.create_task(self._keepalive(rid, emit))
        try:
            return await self._handle(req, emit, sid, look)
        except _FinishedElsewhere as e:  # a re-sent request whose first copy finished meanwhile
            return decode(e.done, ChatDone)
        finally:
            keepalive.cancel()

    async def _keepalive(self, rid: str, emit: Emit) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_INTERVAL)
            await emit(ChatDelta(rid, "", 0))
            try:
                await self.store.renew_lease(rid, self.owner, LEASE_MS)
            except Exception:  # Redis hiccup: the next write reports it
                pass

    async def _handle(self, req: ChatRequest, emit: Emit, sid: str, look: Lookup) -> ChatDone:
        rid = req.request_id
        # 1. resume a request a dead replica was serving, or start a new one
        if look.state is not None:
            prompt, partial, turn_id = await self._resume(rid)
            sticky = None
        else:
            assert look.meta is not None
            if look.meta["status"] == "finished":
                raise TurnError(409, "session_finished", f"session {sid} is finished; start a new one")
            sticky = look.meta.get("worker")
            prompt = await self._prompt(sid, req)
            partial, turn_id = None, look.turn_id
        max_len = self.table.max_model_len(time.time(), self.cfg.max_model_len)
        if len(prompt.ids) >= max_len:
            raise TurnError(400, "context_length_exceeded",
                            f"the prompt is {len(prompt.ids)} tokens; this model's context window is "
                            f"{max_len} tokens")
        if partial is None:
            state = InFlight(sid, turn_id, prompt.ids, prompt.new_ids, prompt.parent, prompt.new_messages)
            if not await self.store.begin_request(rid, state, self.owner, LEASE_MS):
                raise TurnError(409, "duplicate_request", f"request {rid} is already running")

        # 2. generate; each token is persisted, then streamed
        text = IncrementalText(self.renderer)
        stops = StopMatcher(text, req.stop)
        parse_tools = req.kind == "chat" and bool(req.tools)
        sent = 0
        last_emit = time.monotonic()

        async def stream_text() -> None:
            nonlocal sent, last_emit
            if not req.stream:
                return
            if not req.agent_streams and time.monotonic() - last_emit < PROGRESS_INTERVAL:
                return  # nobody reads a plain request's text before the end: progress now and then
            last_emit = time.monotonic()
            visible = stops.visible(text.text)
            visible = toolcalls.visible_prefix(visible) if parse_tools else visible
            if len(visible) > sent:
                await emit(ChatDelta(rid, visible[sent:], sent))
                sent = len(visible)

        if partial is not None:
            stops.add(partial.token_ids)  # a dead replica may have persisted the stop string already
            await stream_text()

        # A stream persists each delta before the agent sees it. A plain request shows nothing
        # until the end, so it persists in chunks: a resume regenerates at most one chunk.
        pending: list[DeltaRecord] = []

        async def on_tokens(delta: TokenDelta, worker: str, first: bool) -> int | None:
            keep = stops.add(delta.token_ids)  # a stop string ends the turn: drop what follows it
            kept = delta if keep is None else head(delta, keep)
            pending.append(DeltaRecord(worker, first, kept.version, kept.token_ids, kept.logprobs))
            if req.agent_streams or first or sum(len(r.token_ids) for r in pending) >= PERSIST_CHUNK:
                await self.store.append_deltas(rid, pending)
                pending.clear()
            await stream_text()
            return keep

        last_worker = sticky or ""

        async def pick(exclude: frozenset[str]) -> str:
            nonlocal last_worker
            deadline = time.monotonic() + self.cfg.worker_wait
            # after a preemption, wait a little for another worker before going back to the same
            # one, if there is another one at all
            prefer = exclude and self.table.others(time.time(), exclude)
            prefer_until = time.monotonic() + (PREFER_OTHER_WORKER_S if prefer else 0.0)
            while True:
                now = time.time()
                w = self.table.choose(now, sticky, exclude)
                if w is None and time.monotonic() >= prefer_until:
                    w = self.table.choose(now, sticky)
                if w:
                    last_worker = w
                    return w
                if time.monotonic() > deadline:
                    raise GenerationFailed(f"no rollout worker is serving (waited {self.cfg.worker_wait:.0f}s)", 503)
                await asyncio.sleep(0.05)

        budget = min(req.sampling.max_tokens, max_len - len(prompt.ids))
        try:
            if partial is not None and stops.at is not None:  # it had already stopped
                gen = partial
                gen.finish_reason = "stop"
            else:
                gen = await generate(self.call, pick, rid, sid, prompt.ids,
                                     replace(req.sampling, max_tokens=budget), on_tokens,
                                     self.cfg.max_redispatch, resume=partial)
        except GenerationFailed as e:
            await self.store.drop_request(rid)
            raise TurnError(e.status, "generation_failed", str(e)) from None
        except asyncio.CancelledError:
            await asyncio.shield(self.store.drop_request(rid))
            raise

        # 3. the reply the agent sees, and the turn that records it
        full = text.final()
        if stops.at is not None:
            full = full[: stops.at]
        content, calls = toolcalls.parse(full, rid) if parse_tools else (full, [])
        if req.stream and len(content) > sent:
            await emit(ChatDelta(rid, content[sent:], sent))
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        turn = Turn(
            turn_id=turn_id,
            parent=prompt.parent,
            prefix_ids=prompt.new_ids,
            segments=gen.segments,
            finish_reason=gen.finish_reason,
            request_id=rid,
            created=time.time(),
            key=conversation_key(req.tools, req.messages + [reply]) if req.kind == "chat" else "",
            messages=prompt.new_messages,
            reply=reply if req.kind == "chat" else {"role": "assistant", "content": full},
        )
        versions: list[int] = []
        for s in gen.segments:
            if not versions or versions[-1] != s.version:
                versions.append(s.version)
        logprobs: list[TokenLogprob] = []
        if req.logprobs:
            lps = [lp for seg in gen.segments for lp in seg.logprobs]
            logprobs = [TokenLogprob(t, lps[k]) for k, t in self.renderer.token_texts(gen.token_ids)]
        done = ChatDone(
            request_id=rid,
            text=content,
            finish_reason="tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason,
            usage=Usage(prompt_tokens=len(prompt.ids), completion_tokens=len(gen.token_ids)),
            turn_id=turn.turn_id,
            tool_calls=calls,
            versions=versions,
            session_id=sid,
            logprobs=logprobs,
        )
        await self.store.save_turn(sid, turn, last_worker, result=encode(done))
        return done

    async def _resume(self, rid: str) -> tuple[Prompt, Generated, int]:
        """Take over a request another replica started. If that replica is alive (the gateway
        re-sent because it was slow, not dead), wait for it: its result is the answer."""
        deadline = time.monotonic() + self.cfg.resume_wait
        while not await self.store.claim_request(rid, self.owner, LEASE_MS):
            if (done := await self.store.done(rid)) is not None:
                raise _FinishedElsewhere(done)
            if time.monotonic() > deadline:
                raise TurnError(409, "duplicate_request", f"request {rid} is still being served by another "
                                f"replica after {self.cfg.resume_wait:.0f}s")
            await asyncio.sleep(RESUME_POLL)
        # read again now that the lease is ours: the dead owner may have written more
        found = await self.store.load_request(rid)
        if found is None:
            if (done := await self.store.done(rid)) is not None:
                raise _FinishedElsewhere(done)
            raise TurnError(409, "duplicate_request", f"request {rid} ended while being resumed; retry")
        state, records = found
        partial = Generated()
        for r in records:
            partial.add(TokenDelta(rid, r.token_ids, r.logprobs, r.version), r.worker, r.starts_dispatch)
        partial.dispatches = sum(r.starts_dispatch for r in records)
        prompt = Prompt(state.prompt_ids, state.new_ids, state.parent, state.new_messages)
        return prompt, partial, state.turn_id

    async def _prompt(self, sid: str, req: ChatRequest) -> Prompt:
        try:
            return await self._render(sid, req)
        except RenderError as e:
            raise TurnError(400, "invalid_messages", str(e)) from None

    async def _render(self, sid: str, req: ChatRequest) -> Prompt:
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
            last = chain[-1].generated_ids
            cont = self.renderer.continuation(
                req.messages[:k], req.messages[k:], req.tools,
                history_ends_with_eos=bool(last) and last[-1] == self.renderer.eos_id,
            )
            if cont is not None:
                return Prompt(token_ids(chain) + cont, cont, tid, req.messages[k:])
        ids = self.renderer.prompt(req.messages, req.tools)
        return Prompt(ids, ids, -1, req.messages)
