"""One generation that survives preemption: dispatch, collect segments, re-dispatch.

If a worker answers "preempted" (it was vacated, or paused in abort mode), the
tokens it produced are kept and `prompt + partial` is sent again, with the
remaining token budget and the same sampling, to a worker that is serving. The
caller sees one continuous stream of tokens. This module does not know NATS: the
transport is the `call` function the service passes in.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec

from services.trajectory.tokenpath import TokenPath
from services.trajectory.turns import Segment
from shared.deltas import tail_of
from shared.messages import Generate, GenerateDone, RolloutReply, Sampling, TokenDelta

Call = Callable[[str, Generate], AsyncIterator[RolloutReply]]
Pick = Callable[[frozenset[str]], Awaitable[str]]
# (delta, worker, starts a dispatch, ends the generation) -> None, or how many of the delta's tokens
# to keep before ending the generation "stop" (a stop string completed). The last flag is set for the
# held tail of a GenerateDone that ends it ("stop", "length"): nothing follows those tokens.
OnTokens = Callable[[TokenDelta, str, bool, bool], Awaitable[int | None]]


MAX_BACKOFF = 1.0  # seconds, between re-dispatches after repeated preemptions
# Preemptions the tag scheduler caused (GenerateDone.scheduled: a reclaim moved the request) are
# not failures: they count neither toward max_redispatch nor toward the back-off. This bounds them.
MAX_SCHEDULED_PREEMPTIONS = 64


class GenerationFailed(RuntimeError):
    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Job:
    """What a generation asks of the workers; each dispatch sends it as a `Generate`, the tokens
    so far appended to the prompt, with the budget that is left."""

    request_id: str
    session_id: str
    prompt_ids: TokenPath
    sampling: Sampling
    hold_s: float = 0.0  # how often at most the worker sends tokens (Generate.hold_s; 0: as they come)
    adapter: str = ""  # multi-LoRA: the session's role, whose adapter the worker runs (Generate.adapter)


@dataclass
class Generated:
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str = ""
    dispatches: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def add(self, delta: TokenDelta, worker_id: str, new_dispatch: bool) -> None:
        last = self.segments[-1] if self.segments else None
        if last is None or new_dispatch or last.version != delta.version or last.worker_id != worker_id:
            self.segments.append(Segment([], [], delta.version, worker_id))
        seg = self.segments[-1]
        seg.token_ids += delta.token_ids
        seg.logprobs += delta.logprobs


@dataclass
class Preemptions:
    """One generation's preemptions: whether it may go on, and how long to wait first."""

    max_redispatch: int
    backoff: float
    started_with: int  # dispatches before this call (a resumed request)
    scheduled: int = 0  # preemptions the tag scheduler caused, in this call

    def delay(self, done: GenerateDone, dispatches: int) -> float:
        """Seconds to wait before the next dispatch; GenerationFailed past the limits."""
        if done.scheduled:  # the scheduler moved it: re-dispatch at once, uncounted (bounded)
            self.scheduled += 1
            if self.scheduled > MAX_SCHEDULED_PREEMPTIONS:
                raise GenerationFailed(f"request moved by the scheduler {self.scheduled} times; giving up", 503)
            return 0.0
        if (failed := dispatches - self.scheduled) > self.max_redispatch:
            raise GenerationFailed(f"request preempted {failed} times; giving up", 503)
        # from the second preemption on (say the only worker is still vacated and its status has
        # not said so yet), wait, doubling each time
        repeats = dispatches - self.started_with - self.scheduled
        return min(self.backoff * 2 ** (repeats - 2), MAX_BACKOFF) if repeats > 1 else 0.0


def head(delta: TokenDelta, n: int) -> TokenDelta:
    """The first n tokens of `delta` (a stop string completed at its n-th token)."""
    return TokenDelta(delta.request_id, delta.token_ids[:n], delta.logprobs[:n], delta.version)


async def _took(on_tokens: OnTokens, out: Generated, delta: TokenDelta, worker: str, first: bool,
                final: bool) -> bool:
    """Add `delta`'s tokens to `out`, as `on_tokens` keeps them; True if a stop string ended the generation."""
    keep = await on_tokens(delta, worker, first, final)
    out.add(delta if keep is None else head(delta, keep), worker, new_dispatch=first)
    if keep is None:
        return False
    out.finish_reason = "stop"
    return True


async def _dispatch(call: Call, worker: str, cmd: Generate, on_tokens: OnTokens, out: Generated) -> GenerateDone | None:
    """One dispatch's tokens into `out`: its GenerateDone, or None if a stop string ended the generation
    (closing the call early aborts the worker's request)."""
    first = True
    done: GenerateDone | None = None
    async with aclosing(call(worker, cmd)) as replies:
        async for reply in replies:
            match reply:
                case TokenDelta():
                    if not reply.token_ids:
                        continue
                    if await _took(on_tokens, out, reply, worker, first, final=False):
                        return None
                    first = False
                case GenerateDone():
                    done = reply
                    break
    if done is None:
        raise GenerationFailed(f"worker {worker} ended the stream without a result", 502)
    # the tokens the worker still held at the end ride on its GenerateDone (shared/deltas.Held)
    if (tail := tail_of(done)) is not None:
        if await _took(on_tokens, out, tail, worker, first, final=done.finish_reason in ("stop", "length")):
            return None
    return done


async def generate(
    call: Call,
    pick: Pick,
    job: Job,
    on_tokens: OnTokens,
    max_redispatch: int,
    resume: Generated | None = None,
    backoff: float = 0.05,
) -> Generated:
    """`on_tokens` runs before tokens count as generated: the service persists them there, so
    a replica that resumes this request (`resume`, rebuilt from Redis) continues after them."""
    out = resume or Generated()
    preemptions = Preemptions(max_redispatch, backoff, out.dispatches)
    preempted_on: set[str] = set()
    while True:
        remaining = job.sampling.max_tokens - len(out.token_ids)
        if remaining <= 0:
            out.finish_reason = "length"
            return out
        # 1. pick a serving worker; avoid one that just preempted us, if there is another
        worker = await pick(frozenset(preempted_on))
        cmd = Generate(
            request_id=f"{job.request_id}.{out.dispatches}",
            prompt_ids=(job.prompt_ids + out.token_ids).wire(),  # msgpack bytes spliced (tokenpath.py)
            sampling=msgspec.structs.replace(job.sampling, max_tokens=remaining),
            session_id=job.session_id,
            hold_s=job.hold_s,
            adapter=job.adapter,
        )
        out.dispatches += 1
        # 2. stream its tokens into the current segment
        if (done := await _dispatch(call, worker, cmd, on_tokens, out)) is None:
            return out  # a stop string completed
        # 3. finished, failed, or preempted: then go round again
        if done.finish_reason in ("stop", "length"):
            out.finish_reason = done.finish_reason
            return out
        if done.finish_reason == "error":
            # the worker says whose fault it was (GenerateDone.code), never its message's words
            status = 400 if done.code in ("context_length", "bad_request") else 500
            raise GenerationFailed(f"rollout worker {worker}: {done.error}", status)
        preempted_on.add(worker)
        # 4. preempted: go round again, within the limits, after the back-off
        if delay := preemptions.delay(done, out.dispatches):
            await asyncio.sleep(delay)
