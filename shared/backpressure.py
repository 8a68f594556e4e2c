"""The TRAJECTORIES stream's limits and what follows from its fill level: the high-water mark
that closes admission, the trim of trained history, and the back-off of a publish that found
the stream full.

The stream discards nothing (`DiscardPolicy.NEW`: a publish to a full stream fails). Room is
made by deleting only trajectories the trainer has acknowledged (its consumer's ack floor, which
moves after a checkpoint covers them), oldest first, once the stream is above `trim_above` of its
limits. What is above that is untrained, so the high-water mark measures untrained data.

Everything here is pure except `read_fill` (two JetStream API calls) and `trim` (one purge).
It does not know Redis, sessions or HTTP.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

import msgspec
from nats.js import JetStreamContext

from shared.config import load

GiB = 1024**3
PREFIX = "SF_TRAJECTORIES_"


class TrajectoryLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """SF_TRAJECTORIES_*: read by every process that declares the streams, so all declare the same."""

    max_bytes: int = 2 * GiB  # the stream's byte limit (a publish beyond it fails; nothing is discarded)
    max_msgs: int = -1  # the stream's message limit; -1 = none
    high_water: float = 0.8  # fill fraction at which new sessions are refused (429)
    trim_above: float = 0.5  # fill fraction above which trained trajectories are deleted, oldest first


def limits_from_env(env=None) -> TrajectoryLimits:
    limits = load(TrajectoryLimits, PREFIX, env)
    if not 0 < limits.trim_above < limits.high_water <= 1:
        raise ValueError(f"{PREFIX}*: need 0 < TRIM_ABOVE ({limits.trim_above}) < HIGH_WATER "
                         f"({limits.high_water}) <= 1")
    return limits


@dataclass(frozen=True)
class Fill:
    """One reading of the stream and the trainer consumer. Consumer figures are -1 when it does not exist."""

    bytes: int
    msgs: int
    max_bytes: int
    max_msgs: int
    first_seq: int
    ack_floor: int = -1  # stream seq: every message up to it is acknowledged by the trainer
    pending: int = -1  # not yet delivered to the trainer
    ack_pending: int = -1  # delivered, not acknowledged yet (held until a checkpoint)
    read_at: float = 0.0

    @property
    def fraction(self) -> float:
        """The fuller of bytes and messages, as a fraction of its limit (0 for no limit)."""
        parts = [self.bytes / self.max_bytes if self.max_bytes > 0 else 0.0,
                 self.msgs / self.max_msgs if self.max_msgs > 0 else 0.0]
        return max(parts)

    @property
    def lag(self) -> int:
        """Messages the trainer has not acknowledged: undelivered plus held. -1 without a trainer consumer."""
        return self.pending + self.ack_pending if self.pending >= 0 else -1

    def above(self, mark: float) -> bool:
        return self.fraction >= mark

    def trim_upto(self, trim_above: float) -> int | None:
        """The stream seq to purge below (exclusive) so that the fill drops to `trim_above`, deleting only
        acknowledged messages, oldest first; None when nothing may or need go. Message sizes are taken as
        the stream's average: the next reading corrects an estimate that fell short."""
        if self.fraction <= trim_above or self.ack_floor < self.first_seq or self.msgs <= 0:
            return None
        excess = 0
        if self.max_bytes > 0:
            excess = math.ceil((self.bytes - trim_above * self.max_bytes) / (self.bytes / self.msgs))
        if self.max_msgs > 0:
            excess = max(excess, math.ceil(self.msgs - trim_above * self.max_msgs))
        upto = min(self.first_seq + max(excess, 1), self.ack_floor + 1)
        return upto if upto > self.first_seq else None


Crossing = Literal["crossed", "cleared"]


class HighWater:
    """Edge detector for the high-water mark: says "crossed" once when the fill reaches the mark and
    "cleared" once when it falls `hysteresis` below it, so a fill that hovers logs once per crossing."""

    def __init__(self, mark: float, hysteresis: float = 0.05):
        self.mark, self.hysteresis = mark, hysteresis
        self.high = False

    def update(self, fraction: float) -> Crossing | None:
        if not self.high and fraction >= self.mark:
            self.high = True
            return "crossed"
        if self.high and fraction < self.mark - self.hysteresis:
            self.high = False
            return "cleared"
        return None


def backoff(attempt: int, base: float = 0.05, cap: float = 1.0, jitter: float = 0.25,
            rng: random.Random | None = None) -> float:
    """Seconds before retry `attempt` (0, 1, ...) of a publish: base doubling up to cap, with up to
    `jitter` of it taken off at random so replicas retrying together spread out. Never above cap."""
    delay = min(cap, base * 2 ** min(attempt, 32))
    return delay * (1 - jitter * (rng or random).random())


def is_stream_full(e: Exception) -> bool:
    """A JetStream publish refused because a limit is reached (err_code 10077, 'maximum bytes/messages
    exceeded', with DiscardPolicy.NEW)."""
    return getattr(e, "err_code", None) == STREAM_FULL_ERR_CODE


STREAM_FULL_ERR_CODE = 10077  # JSStreamStoreFailedF: the store refused the message (limits with discard new)


async def read_fill(js: JetStreamContext, stream: str, consumer: str, now: float, timeout: float = 2.0) -> Fill:
    """The stream's state and the trainer consumer's position. Raises if the stream cannot be read; a
    missing consumer only leaves its figures at -1."""
    info = await js.stream_info(stream)
    st, cfg = info.state, info.config
    fill = Fill(bytes=st.bytes, msgs=st.messages, max_bytes=cfg.max_bytes or -1, max_msgs=cfg.max_msgs or -1,
                first_seq=st.first_seq, read_at=now)
    try:
        ci = await js.consumer_info(stream, consumer, timeout=timeout)
    except Exception:  # no trainer consumer yet (or it was deleted): nothing counts as trained
        return fill
    return Fill(bytes=fill.bytes, msgs=fill.msgs, max_bytes=fill.max_bytes, max_msgs=fill.max_msgs,
                first_seq=fill.first_seq, ack_floor=ci.ack_floor.stream_seq if ci.ack_floor else 0,
                pending=int(ci.num_pending or 0), ack_pending=int(ci.num_ack_pending or 0), read_at=now)


async def trim(js: JetStreamContext, stream: str, fill: Fill, trim_above: float) -> int:
    """Delete acknowledged trajectories, oldest first, down to `trim_above`. Returns the seq purged below
    (0 if nothing). Idempotent: replicas trimming together purge the same prefix."""
    upto = fill.trim_upto(trim_above)
    if upto is None:
        return 0
    await js.purge_stream(stream, seq=upto)
    return upto
