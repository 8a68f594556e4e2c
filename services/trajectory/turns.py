"""A session's turns form a token prefix tree (pure).

Each turn stores only the tokens it added: `prefix_ids` (template glue, new
messages and the generation prompt; loss mask 0) and the generated `segments`
(loss mask 1), each segment tagged with the policy version and worker that
sampled it. A turn's full token sequence is the concatenation along its path to
the root, so earlier turns are reused token for token and never re-tokenized;
two requests that extend the same turn differently become sibling branches.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.messages import Sample


class Segment(msgspec.Struct, array_like=True):
    token_ids: list[int]
    logprobs: list[float]
    version: int
    worker_id: str = ""


class Turn(msgspec.Struct, omit_defaults=True):
    turn_id: int
    parent: int  # -1 for a root turn
    prefix_ids: list[int]
    segments: list[Segment]
    finish_reason: str
    request_id: str
    created: float
    key: str = ""  # conversation key of (messages + reply): how the next turn finds this one
    messages: list[dict[str, Any]] = []  # the new messages prefix_ids render
    reply: dict[str, Any] = {}  # the assistant message the agent received

    @property
    def generated_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]


def path(turns: dict[int, Turn], turn_id: int) -> list[Turn]:
    """Turns from the root to `turn_id`. Raises KeyError on a broken chain."""
    out = []
    seen = set()
    while turn_id != -1:
        if turn_id in seen:
            raise ValueError(f"turn cycle at {turn_id}")
        seen.add(turn_id)
        t = turns[turn_id]
        out.append(t)
        turn_id = t.parent
    return out[::-1]


def token_ids(turns: list[Turn]) -> list[int]:
    ids: list[int] = []
    for t in turns:
        ids += t.prefix_ids
        ids += t.generated_ids
    return ids


def sample(turns: list[Turn]) -> Sample:
    """Flatten one root-to-leaf path into the per-token arrays the trainer consumes."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    messages: list[dict[str, Any]] = []
    for t in turns:
        n = len(t.prefix_ids)
        ids += t.prefix_ids
        mask += [0] * n
        logprobs += [0.0] * n
        versions += [-1] * n
        for s in t.segments:
            ids += s.token_ids
            mask += [1] * len(s.token_ids)
            logprobs += s.logprobs
            versions += [s.version] * len(s.token_ids)
        messages += t.messages
        if t.reply:
            messages.append(t.reply)
    return Sample(ids, mask, logprobs, versions, messages=messages, turn_ids=[t.turn_id for t in turns])


def leaves(turns: dict[int, Turn]) -> list[int]:
    """Turns no other turn extends: one sample per branch, in creation order."""
    parents = {t.parent for t in turns.values()}
    return sorted(tid for tid in turns if tid not in parents)


def samples(turns: dict[int, Turn]) -> list[Sample]:
    return [sample(path(turns, leaf)) for leaf in leaves(turns)]
