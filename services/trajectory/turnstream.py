"""What the agent has seen of one turn, and what is not yet persisted (pure: no sockets, no clock).

A turn's tokens arrive in deltas. For each one the stream
1. feeds the tokens to the decoded text and the stop-string matcher, and cuts the delta at
   the token that completed a stop string (what follows it is never shown or recorded);
2. queues the kept tokens as a `DeltaRecord` to persist: a stream persists every delta
   before the agent sees it; a plain request shows nothing until the end, so it persists
   in chunks of PERSIST_CHUNK tokens (a resume regenerates at most one chunk);
3. says which new text the agent may see: not a possible stop-string start, not a possible
   `<tool_call>`, and for a plain request at most every PROGRESS_INTERVAL seconds (nobody
   reads it before the end; it is progress only). What was held back reaches the agent with
   the turn's ChatDone, whose text is the whole content: the gateway sends the part its
   deltas did not.

It knows nothing about NATS or Redis: chat.py sends what it returns.
"""

from __future__ import annotations

from services.trajectory.generation import head
from services.trajectory.rendering import IncrementalText, Renderer
from services.trajectory.stopstrings import StopMatcher
from services.trajectory.store import DeltaRecord
from shared import toolcalls
from shared.messages import ChatRequest, TokenDelta

PERSIST_CHUNK = 32  # tokens a plain (non-stream) request buffers before persisting
PROGRESS_INTERVAL = 0.5  # seconds between text deltas of a request the agent does not stream


class TurnStream:
    def __init__(self, renderer: Renderer, req: ChatRequest, now: float):
        self.text = IncrementalText(renderer)
        self.stops = StopMatcher(self.text, req.stop)
        self.parse_tools = req.kind == "chat" and bool(req.tools)
        self.agent_streams = req.agent_streams
        self.sent = 0  # characters of content the agent has been sent
        self.last_progress = now
        self.pending: list[DeltaRecord] = []
        self._pending_tokens = 0

    @property
    def stopped(self) -> bool:
        """Did a stop string complete?"""
        return self.stops.at is not None

    def replay(self, token_ids: list[int]) -> None:
        """Tokens a dead replica already persisted (a resume): they may hold the stop string."""
        self.stops.add(token_ids)

    def add(self, delta: TokenDelta, worker: str, first: bool) -> int | None:
        """Step 1 and 2 for one delta. Returns how many of its tokens to keep if a stop string
        completed in it (the generation then ends "stop"), else None."""
        keep = self.stops.add(delta.token_ids)
        kept = delta if keep is None else head(delta, keep)
        self.pending.append(DeltaRecord(worker, first, kept.version, kept.token_ids, kept.logprobs))
        self._pending_tokens += len(kept.token_ids)
        return keep

    def to_persist(self, first: bool) -> list[DeltaRecord]:
        """The records to persist now (empty: keep buffering). The first delta of a dispatch is
        persisted at once, so a resume knows where each dispatch started."""
        if not (self.agent_streams or first or self._pending_tokens >= PERSIST_CHUNK):
            return []
        out, self.pending, self._pending_tokens = self.pending, [], 0
        return out

    def progress(self, now: float) -> tuple[str, int] | None:
        """Step 3: (new text, its offset in the content) the agent may see now, or None."""
        if not self.agent_streams and now - self.last_progress < PROGRESS_INTERVAL:
            return None
        self.last_progress = now
        visible = self.stops.visible(self.text.text)
        if self.parse_tools:
            visible = toolcalls.visible_prefix(visible)
        return self._advance(visible)

    def final_text(self) -> str:
        """All generated text, up to the stop string if one completed."""
        full = self.text.final()
        return full[: self.stops.at] if self.stops.at is not None else full

    def _advance(self, visible: str) -> tuple[str, int] | None:
        if len(visible) <= self.sent:
            return None
        piece, offset = visible[self.sent:], self.sent
        self.sent = len(visible)
        return piece, offset
