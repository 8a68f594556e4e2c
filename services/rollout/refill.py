"""Getting weights back after a level-2 wake when the version came over the network.

A level-2 sleep discards the weights. With the disk transport the wake reloads them from the
path they came from; a version received over the network is on no disk of this host
(shared-nothing), so the engine `needs_refill` and the same version must be received again,
from the trainer (sf.weights.fetch: a round of its own, the catch-up of a worker that missed
one). Until then the engine serves nothing (`Engine.resume` raises WeightsGone).

This module owns the rule for which offer fills the engine and the bounded retry. It knows
nothing of NATS: `ask` is the service's request to the trainer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from services.rollout.engine import EngineAsleep, EngineDead, TransferMissed, WeightsGone
from shared.messages.weights import WeightsPublished, WeightTransfer

log = logging.getLogger(__name__)

TRIES = 3  # fetches before a refill gives up
WAIT = 8.0  # seconds one fetch waits for the trainer's reply
GAP = 1.0  # seconds between tries (a trainer that said "not now" is not asked again at once)

Ask = Callable[[int, float], Awaitable[WeightsPublished]]  # (version, timeout) -> the trainer's offer


class Refillable(Protocol):
    version: int
    sleeping: bool

    @property
    def needs_refill(self) -> bool: ...

    async def receive_weights(self, transfer: WeightTransfer, version: int) -> None: ...


def refusal(offer: WeightsPublished, current: int, refill: bool) -> str:
    """Why `offer` cannot be received by an engine at version `current` ("" if it can). A refill
    takes the version it had back (the same number); anything else only a newer one."""
    if offer.transfer is None:
        return f"the trainer offers no round now (its version {offer.version})"
    if offer.version < current or (offer.version == current and not refill):
        return f"the trainer offers version {offer.version}, not newer than {current}"
    return ""


async def refill(engine: Refillable, ask: Ask) -> None:
    """Receive the engine's weights again from the trainer, at most TRIES times. Returns when
    they are back (or the engine went back to sleep: the next wake refills); raises WeightsGone
    with the last reason when they could not be had. EngineDead (a receive failed halfway) passes."""
    tries, wait, gap = TRIES, WAIT, GAP  # read at call time (tests shorten GAP)
    why = ""
    for attempt in range(1, tries + 1):
        if engine.sleeping or not engine.needs_refill:
            return
        version = engine.version
        try:
            offer = await ask(version, wait)
            why = refusal(offer, version, refill=True)
            if not why:
                await engine.receive_weights(offer.transfer, offer.version)
                log.info("refilled: version %d received again after a level-2 wake", offer.version)
                return
        except EngineAsleep:
            return
        except TransferMissed as e:
            why = f"missed the round: {e}"
        except EngineDead:
            raise
        except Exception as e:  # no trainer, a timeout, a reply we cannot read
            why = f"{type(e).__name__}: {e}"
        log.warning("refill of version %d, try %d/%d: %s", version, attempt, tries, why)
        if attempt < tries:
            await asyncio.sleep(gap)
    raise WeightsGone(f"version {engine.version}: the level-2 sleep discarded its weights, no path holds them, "
                      f"and the trainer sent none in {tries} tries of {wait:g}s ({why}); serving nothing until "
                      "a round brings them")
