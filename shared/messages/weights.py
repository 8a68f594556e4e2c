"""sf.weights.published (JetStream WEIGHTS, last value): a new policy version exists.
sf.weights.fetch (request/reply): a worker that missed a version's round asks the trainer for
one of its own (WeightsWanted -> WeightsPublished; `transfer` None: not now, wait for the next).

It names where to get it: `transfer`, the rendezvous of a network round (shared/weightxfer.py),
or `path`, an HF safetensors directory every rollout host can read (the shared-disk path,
`SF_WEIGHTS_TRANSPORT=disk`). A reader of an older release reads a network announcement as a
path event with an empty path and rejects that version (shared/checkpoint.py), it never loads
a wrong one.
"""

from __future__ import annotations

from typing import Literal

import msgspec

TransferBackend = Literal["sf_gloo", "nccl", "ipc"]


class WeightTransfer(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where a receiver joins the version's transfer round."""

    address: str  # the sender's (trainer rank 0's) address, reachable from rollout hosts
    port: int  # its TCPStore port
    group: str  # the round's name inside that store: one per version
    backend: TransferBackend = "sf_gloo"  # services/rollout/engine.py transfer_backend
    nbytes: int = 0  # bytes on the wire, for logs and timeouts


class WeightsPublished(msgspec.Struct, tag=True, omit_defaults=True):
    version: int
    path: str  # an HF safetensors directory every rollout host can read; "" when `transfer` is set
    published_at: float
    step: int = 0
    # Appended: the network path. None: load `path` from the shared disk.
    transfer: WeightTransfer | None = None


class WeightsWanted(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    """A worker that missed `version`'s round (it started late, restarted, or woke up) asks for it."""

    worker_id: str
    version: int
