"""Merging token deltas that queued up (pure): one helper for rollout workers and trajectory replicas.

When a consumer falls behind its producer, the `TokenDelta`s waiting for it are merged, so a
backlog costs one message (one Redis append, one ChatDelta) instead of one per token. A merge
never crosses a version change or another request: each segment of a trajectory stays
exactly one (worker, version) run. Anything that is not a TokenDelta (a GenerateDone, an
engine's end-of-request marker, an exception) is kept in place and ends the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from shared.messages.rollout import TokenDelta

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
            out[-1] = TokenDelta(prev.request_id, prev.token_ids + item.token_ids,
                                 prev.logprobs + item.logprobs, prev.version)
        else:
            out.append(item)
    return out
