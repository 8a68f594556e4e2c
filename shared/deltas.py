"""Merging token deltas (pure): one helper for rollout workers and trajectory replicas.

When a consumer falls behind its producer, the `TokenDelta`s waiting for it are merged, so a
backlog costs one message (one Redis append, one ChatDelta) instead of one per token. A merge
never crosses a version change or another request: each segment of a trajectory stays
exactly one (worker, version) run. Anything that is not a TokenDelta (a GenerateDone, an
engine's end-of-request marker, an exception) is kept in place and ends the run.

`Held` merges on purpose: a requester whose tokens nobody watches live (an agent that does not
stream) sets `Generate.hold_s`, and the worker sends a request's tokens at most that often; what
it still holds at the end rides on the GenerateDone (`with_tail`): one message, and for a reply
shorter than `hold_s` the only one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar

from shared.messages.rollout import GenerateDone, TokenDelta

T = TypeVar("T")


def continues(prev: TokenDelta, nxt: TokenDelta) -> bool:
    """Can `nxt` be appended to `prev` without losing which request and version made each token?"""
    return prev.request_id == nxt.request_id and prev.version == nxt.version


def merge_deltas(items: Iterable[T]) -> list[T]:
    """Consecutive TokenDeltas of one request and version become one; everything else keeps
    its place. The inputs are not modified."""
    out: list = []
    for item in items:
        prev = out[-1] if out else None
        if isinstance(item, TokenDelta) and isinstance(prev, TokenDelta) and continues(prev, item):
            out[-1] = _joined(prev, item)
        else:
            out.append(item)
    return out


def _joined(prev: TokenDelta, nxt: TokenDelta) -> TokenDelta:
    return TokenDelta(prev.request_id, prev.token_ids + nxt.token_ids, prev.logprobs + nxt.logprobs, prev.version)


class Held:
    """One request's deltas, sent at most every `hold_s` seconds (Generate.hold_s; 0 sends each as it
    comes), counted from `start`, the request's arrival: the first ones too, so a reply shorter than
    `hold_s` is one message, its GenerateDone (the requester then neither appends its tokens nor
    shows them before it saves the turn). They wait, merged, until `hold_s` has passed since the last
    send, checked as each new one arrives, with no timer: a paused engine holds them until it goes on,
    as it would hold tokens it has not sampled. A version change sends what is held first: a merge
    never crosses one. The caller sends `flush()` before the request's end (GenerateDone): nothing
    held is lost."""

    def __init__(self, hold_s: float, start: float = -math.inf) -> None:
        self.hold_s = hold_s
        self.pending: TokenDelta | None = None
        self.sent_at = start

    def add(self, delta: TokenDelta, now: float) -> list[TokenDelta]:
        """What to send now, in order."""
        out = []
        if self.pending is not None and not continues(self.pending, delta):
            out.append(self.pending)
            self.pending = None
        merged = delta if self.pending is None else _joined(self.pending, delta)
        if now - self.sent_at >= self.hold_s:
            out.append(merged)
            self.pending, self.sent_at = None, now
        else:
            self.pending = merged
        return out

    def flush(self) -> TokenDelta | None:
        """What is still held (None: nothing), now to be sent."""
        out, self.pending = self.pending, None
        return out


def with_tail(done: GenerateDone, tail: TokenDelta | None) -> tuple[TokenDelta | None, GenerateDone]:
    """(delta to send first, GenerateDone): the held `tail` rides on `done` when it is of `done`'s version
    (it always is: the worker's last tokens are its last version), else it goes before it on its own."""
    if tail is None or tail.version != done.version:
        return tail, done
    done.tail_ids, done.tail_logprobs = tail.token_ids, tail.logprobs
    return None, done


def tail_of(done: GenerateDone) -> TokenDelta | None:
    """The held tail a GenerateDone carries, as the TokenDelta it stands for (None: no tail)."""
    return TokenDelta(done.request_id, done.tail_ids, done.tail_logprobs, done.version) if done.tail_ids else None
