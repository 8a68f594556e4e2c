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
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from msgspec.structs import replace

from services.trajectory.config import TrajectoryConfig
from services.trajectory.generation import Call, Generated, GenerationFailed, Job, generate
from services.trajectory.messagelist import InvalidMessage
from services.trajectory.prompts import PromptBuilder, request_digests
from services.trajectory.record import Prompt, last_worker, record
from services.trajectory.rendering import Renderer, RenderError
from services.trajectory.routing import Picker, WorkerTable
from services.trajectory.store import Alias, DeltaRecord, InFlight, Lookup, SessionNotFound, Store
from services.trajectory.turns import Turn
from services.trajectory.turnstream import TurnStream
from shared.adapters import role_of
from shared.codec import decode, encode
from shared.messages import ChatDelta, ChatDone, ChatRequest, TokenDelta
from shared.logonce import OncePerCause
from shared.messages.chat import KEEPALIVE_INTERVAL

log = logging.getLogger(__name__)
_warn = OncePerCause(log)

Emit = Callable[[Any], Awaitable[None]]
LEASE_MS = 3000
RESUME_POLL = 0.2  # seconds between checks while a re-sent request waits for the replica serving it
PICK_POLL = 0.05  # seconds between looks at the worker table while no worker fits


class TurnError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class LeaseLost(Exception):
    """Another replica took this request over (this one could not renew its lease in time).
    This replica stops, its worker call is closed, and the request's state is left to the owner."""


class _FinishedElsewhere(Exception):
    def __init__(self, done: bytes):
        self.done = done


class _Lease:
    """One handling of one request, and its hold on the request's lease. `owner` names this
    handling, not the process: a re-sent copy that lands on the replica still serving the first
    (paused, then continued) waits for it like any other replica instead of sharing its lease."""

    def __init__(self, owner: str, rid: str, emit: Emit) -> None:
        self.owner = owner
        self.rid = rid
        self.emit = emit  # where its keepalives go
        self.lost = False
        self.work: asyncio.Task | None = None  # the handling, once it holds the lease (_held): renewed, stopped if lost
        self.renewed = 0.0  # monotonic time of its last renewal


class TurnHandler:
    def __init__(self, cfg: TrajectoryConfig, store: Store, renderer: Renderer, table: WorkerTable, call: Call):
        self.cfg, self.store, self.renderer, self.table, self.call = cfg, store, renderer, table, call
        self.prompts = PromptBuilder(store, renderer)
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.lengths = table.lengths  # recent reply lengths per GRPO group: predicted lending, rebalance's worth test
        self.live: set[_Lease] = set()  # every handling in flight here: each gets keepalives (_tick)
        self._ticker: asyncio.Task | None = None

    async def handle(self, req: ChatRequest, emit: Emit) -> ChatDone:
        rid = req.request_id
        lease = _Lease(f"{self.owner}-{secrets.token_hex(2)}", rid, emit)
        # keepalives from the start, whatever Redis makes the turn wait for: the gateway re-sends a request
        # after 5 s of silence (bench/load.py, a starved replica: 125 re-sends in 45 s, each one more turn)
        self.live.add(lease)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick())
        try:
            look = await self._lookup(req, lease.owner)
            # 0. a retry of a request that already finished gets the same answer
            if look.done is not None:
                return decode(look.done, ChatDone)
            return await self._handle(req, emit, look, lease)
        except _FinishedElsewhere as e:  # a re-sent request whose first copy finished meanwhile
            return decode(e.done, ChatDone)
        except InvalidMessage as e:  # found where it was read (messagelist.py)
            raise TurnError(400, "invalid_messages", str(e)) from None
        except asyncio.CancelledError:
            if lease.lost and asyncio.current_task().uncancel() == 0:  # our lease renewal (_lose), not the agent
                raise LeaseLost(f"request {rid}: another replica holds its lease") from None
            raise
        finally:
            self.live.discard(lease)  # no keepalive, no renewal from here on

    async def _lookup(self, req: ChatRequest, owner: str) -> Lookup:
        """The request's state in one round trip, and a new request's lease for `owner`; a new request
        without a session gets a new anonymous one once its lease is `owner`'s (a resume continues in
        the session it began in; a re-sent copy waiting for the first makes none)."""
        digests = request_digests(req)
        try:
            look = await self.store.lookup(req.request_id, req.session_id, digests.follow, owner, LEASE_MS)
            if look.leased and not req.session_id:
                sid = await self.store.create_session(anonymous=True)
                look = await self.store.lookup(req.request_id, sid, "", owner, LEASE_MS)
        except SessionNotFound as e:
            raise TurnError(404, "session_not_found", f"session {e.args[0]} does not exist") from None
        look.raw = digests.whole
        return look

    async def _tick(self) -> None:
        """Every KEEPALIVE_INTERVAL while any turn runs here: a keepalive for each (the gateway tells a dead
        replica from a slow model by them), then every lease held renewed, together (one Redis call per
        RENEW_BATCH leases, not one per turn and second). The renewal runs in a task of its own, one at a
        time: one that waits for Redis delays no keepalive. Ends when no turn is left; handle starts it again."""
        renewal: asyncio.Task | None = None
        while self.live:
            await asyncio.sleep(KEEPALIVE_INTERVAL)
            for lease in list(self.live):
                try:
                    await lease.emit(ChatDelta(lease.rid, "", 0))
                except Exception as e:  # NATS trouble: the gateway re-sends after its silence timeout
                    _warn(f"keepalive:{type(e).__name__}", "keepalive of %s failed: %s", lease.rid, e)
            held = [lease for lease in self.live if lease.work is not None and not lease.lost]
            if held and (renewal is None or renewal.done()):
                renewal = asyncio.create_task(self._renew(held))

    def _held(self, rid: str, lease: _Lease) -> None:
        """This handling holds the request's lease now (it began the request, or took it over): keep it."""
        lease.work, lease.renewed = asyncio.current_task(), time.monotonic()

    async def _renew(self, held: list[_Lease]) -> None:
        """Renew the leases `held`. One that is lost (another replica holds it, or renewals failed until it
        lapsed) stops its turn. A lease that lapsed while this replica was slow (a stalled event loop on a
        loaded host) but that nobody took is taken back: only another holder means it is lost. Only a
        handling that holds its lease is here: a re-sent copy waiting for the first one to finish (_resume)
        holds nothing yet, and must not take the first copy's lease for its own loss."""
        try:
            renewed = await self.store.renew_leases([(lease.rid, lease.owner) for lease in held], LEASE_MS)
        except Exception as e:  # a Redis hiccup: fine while a lease has not lapsed
            log.warning("lease renewal of %d request(s) failed: %s", len(held), e)
            for lease in held:
                if lease in self.live and self._lapsed(lease):
                    self._lose(lease, f"renewals failed until it lapsed ({e})")
            return
        for lease, ok in zip(held, renewed, strict=True):
            if lease not in self.live:
                continue  # its turn ended meanwhile
            why = "another replica holds it"
            if not ok:
                try:
                    ok = await self.store.claim_request(lease.rid, lease.owner, LEASE_MS)
                except Exception as e:
                    log.warning("request %s: lease renewal failed: %s", lease.rid, e)
                    if not self._lapsed(lease):
                        continue  # a Redis hiccup: fine while the lease has not lapsed
                    why = f"renewals failed until it lapsed ({e})"
            if ok:
                lease.renewed = time.monotonic()
            elif lease in self.live:
                self._lose(lease, why)

    @staticmethod
    def _lapsed(lease: _Lease) -> bool:
        """Has the lease run out since its last renewal?"""
        return time.monotonic() - lease.renewed >= LEASE_MS / 1000

    @staticmethod
    def _lose(lease: _Lease, why: str) -> None:
        log.warning("request %s: lease lost (%s); stopping here", lease.rid, why)
        lease.lost = True
        if lease.work is not None:
            lease.work.cancel()

    async def _handle(self, req: ChatRequest, emit: Emit, look: Lookup, lease: _Lease) -> ChatDone:
        rid = req.request_id
        # 1. resume a request a dead replica was serving, or start a new one
        max_len = self.table.max_model_len(time.time(), self.cfg.max_model_len)
        prompt, partial, turn_id, sticky, begin = await self._begin(req, look, max_len, lease)

        # 2. generate; each delta is persisted, then shown (turnstream.py)
        stream = TurnStream(self.renderer, req, time.monotonic())

        async def show(piece: tuple[str, int] | None) -> None:
            if piece is not None:
                await emit(ChatDelta(rid, *piece))

        async def on_tokens(delta: TokenDelta, worker: str, first: bool, final: bool) -> int | None:
            nonlocal begin
            keep = stream.add(delta, worker, first)
            if final:  # the generation's last tokens: saved with the turn, shown with its ChatDone
                return keep
            if records := stream.to_persist(first):
                await self._persist(rid, records, lease, begin)
                begin = None  # the request's state went with its first tokens
            await show(stream.progress(time.monotonic()))
            return keep

        if partial is not None:
            stream.replay(partial.token_ids)  # a dead replica may have persisted the stop string already
            await show(stream.progress(time.monotonic()))
        budget = min(req.sampling.max_tokens, max_len - len(prompt.ids))
        group = (look.meta or {}).get("group_id") or None
        expected = min(budget, self.lengths.expected(group) or budget)
        try:
            if partial is not None and stream.stopped:  # it had already stopped
                gen = partial
                gen.finish_reason = "stop"
            else:
                # worker request ids are this handler's own: a replica that took the request over must
                # not collide with (or abort) what a paused predecessor still has running on a worker
                job = Job(f"{rid}.{secrets.token_hex(3)}", look.session_id, prompt.ids,
                          replace(req.sampling, max_tokens=budget),
                          hold_s=0.0 if req.agent_streams else self.cfg.plain_hold_s,
                          adapter=role_of((look.meta or {}).get("metadata") or {}))
                gen = await generate(self.call, lambda exclude: self._pick(sticky, exclude, expected), job, on_tokens,
                                     self.cfg.max_redispatch, resume=partial)
        except GenerationFailed as e:
            await self.store.drop_request(rid, lease.owner)
            raise TurnError(e.status, "generation_failed", str(e)) from None
        except asyncio.CancelledError:
            if not lease.lost:  # else the request is another replica's now: leave its state alone
                await asyncio.shield(self.store.drop_request(rid, lease.owner))
            raise

        # 3. the turn and the reply (record.py), saved in one transaction. The text the agent has not been
        # shown yet goes with the ChatDone (`text` is the whole content; the gateway sends what its deltas
        # did not), not as a delta of its own: one NATS message less a turn, each end
        if group:
            self.lengths.record(group, len(gen.token_ids))
        turn, done = record(req, look.session_id, turn_id, prompt, gen, stream.final_text(),
                            self.renderer.token_texts, time.time())
        await self._save(turn, prompt, gen, done, last_worker(gen, sticky or ""), lease, began=begin is None)
        return done

    async def _persist(self, rid: str, records: list[DeltaRecord], lease: _Lease, begin: InFlight | None) -> None:
        """Append a running request's tokens (the first ones with the new request's state, `begin`),
        unless another replica took it over meanwhile (this one was paused past its lease and its
        keepalive has not run yet), or began or finished it: then stop here."""
        if not await self.store.append_deltas(rid, records, lease.owner, begin):
            lease.lost = True
            raise LeaseLost(f"request {rid}: taken over by another replica before its tokens were saved")

    async def _save(self, turn: Turn, prompt: Prompt, gen: Generated, done: ChatDone, worker: str, lease: _Lease,
                    began: bool) -> None:
        """Save the turn in the session the ChatDone names (record.py)."""
        cache = {}
        if turn.key:  # a later turn may extend this one: what finds it fast, and its token path
            cache["path"] = path = prompt.ids + gen.token_ids
            if prompt.raw and prompt.request_key:
                cache["alias"] = (prompt.raw, Alias(turn.turn_id, prompt.request_key, turn.key, path.last))
        # saved only while this replica holds the lease, checked in the same script: a replica paused past
        # its lease, whose request another took over or finished meanwhile, stops here instead of writing
        # the turn a second time
        if not await self.store.save_turn(done.session_id, turn, worker, result=encode(done), owner=lease.owner,
                                          began=began, **cache):
            lease.lost = True
            raise LeaseLost(f"request {turn.request_id}: taken over by another replica before its turn was saved")

    async def _begin(self, req: ChatRequest, look: Lookup, max_len: int,
                     lease: _Lease) -> tuple[Prompt, Generated | None, int, str | None, InFlight | None]:
        """(prompt, partial generation of a resumed request, turn id, sticky worker, the state a new
        request writes with its first tokens), once this handling holds the request's lease."""
        rid = req.request_id
        if look.state is not None or not look.leased:
            # a running request (a dead replica's, to resume), or a new one whose lease another handling
            # holds before its first tokens (the gateway re-sent it while the first copy is alive or
            # paused, found by tests/faults): wait for that handling like any re-send, or take over from it
            resumed = await self._resume(rid, lease.owner)
            self._held(rid, lease)
            if resumed is not None:
                prompt, partial, turn_id = resumed
                return prompt, partial, turn_id, None, None
            # it ended with neither tokens nor a result: one that had begun was dropped (it failed); one
            # that had not lost its replica before its first tokens, and starts here
            if look.state is None and look.meta is None:  # without a session: its own, now that it leads
                look = await self._lookup(req, lease.owner)
        else:
            self._held(rid, lease)
        try:
            if look.state is not None:
                raise TurnError(409, "duplicate_request", f"request {rid} ended while being resumed; retry")
            prompt = await self._new_prompt(req, look, max_len)
        except (TurnError, InvalidMessage):
            await self.store.drop_request(rid, lease.owner)  # it holds the lease and began nothing: free it
            raise
        state = InFlight(look.session_id, look.turn_id, prompt.ids.wire(), prompt.new_ids, prompt.parent,
                         prompt.new_messages, prompt.request_key, prompt.raw)
        return prompt, None, look.turn_id, (look.meta or {}).get("worker"), state

    async def _new_prompt(self, req: ChatRequest, look: Lookup, max_len: int) -> Prompt:
        """A new request's prompt, within the limits."""
        assert look.meta is not None
        if look.meta["status"] != "open":  # finishing (its trajectory is being published) or finished
            raise TurnError(409, "session_finished", f"session {look.session_id} is finished; start a new one")
        prompt = await self._prompt(look, req)
        if len(prompt.ids) >= max_len:
            raise TurnError(400, "context_length_exceeded",
                            f"the prompt is {len(prompt.ids)} tokens; this model's context window is "
                            f"{max_len} tokens")
        if req.max_prompt_tokens and len(prompt.ids) > req.max_prompt_tokens:  # the gateway's limit
            raise TurnError(400, "prompt_too_long",
                            f"the prompt is {len(prompt.ids)} tokens; this gateway accepts at most "
                            f"{req.max_prompt_tokens} (SF_GATEWAY_MAX_PROMPT_TOKENS)")
        return prompt

    async def _pick(self, sticky: str | None, exclude: frozenset[str], expected_tokens: float | None = None) -> str:
        """A serving worker (routing.Picker), waiting up to `worker_wait` for one."""
        picker = Picker.start(self.table, time.time(), sticky, exclude, self.cfg.worker_wait, expected_tokens)
        while (worker := picker.choose(time.time())) is None:
            if picker.expired(time.time()):
                raise GenerationFailed(f"no rollout worker is serving (waited {self.cfg.worker_wait:.0f}s)", 503)
            await asyncio.sleep(PICK_POLL)
        return worker

    async def _resume(self, rid: str, owner: str = "") -> tuple[Prompt, Generated, int] | None:
        """Take over a request another replica started. If that replica is alive (the gateway
        re-sent because it was slow, not dead), wait for it: its result is the answer. None: the
        lease is `owner`'s and the request has neither a state nor a result (it ended before its
        first tokens were saved)."""
        deadline = time.monotonic() + self.cfg.resume_wait
        owner = owner or self.owner
        while not await self.store.claim_request(rid, owner, LEASE_MS):
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
            return None
        state, records = found
        partial = Generated()
        for r in records:
            partial.add(TokenDelta(rid, r.token_ids, r.logprobs, r.version), r.worker, r.starts_dispatch)
        partial.dispatches = sum(r.starts_dispatch for r in records)
        prompt = Prompt(state.prompt_ids, state.new_ids, state.parent, state.new_messages, state.request_key,
                        state.raw)
        return prompt, partial, state.turn_id

    async def _prompt(self, look: Lookup, req: ChatRequest) -> Prompt:
        try:
            return await self.prompts.build(look.session_id, req, (look.follow, look.followed), look.raw)
        except RenderError as e:
            raise TurnError(400, "invalid_messages", str(e)) from None
