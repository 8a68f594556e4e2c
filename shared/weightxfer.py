"""Weights over the network: one sender (trainer rank 0) broadcasts a TransferPlan's buckets
to the receivers (rollout workers) that joined the round, over torch.distributed gloo on TCP.

A ROUND is one published version. Its rendezvous is the sender's TCPStore (address, port)
and a group name; the NATS announcement carries them (shared/messages/weights.py):

    sender                                      each receiver
    1. store[group/plan] = the plan             a. plan = store[group/plan] (waits for it)
    2. announce (the caller)                    b. rank = store.add(group/joined, 1)
    3. wait for `expected` joins or the window  c. world = store[group/world] (waits)
    4. store[group/world] = joined + 1          d. rank >= world: too late for this round
    5. gloo group over PrefixStore(group/pg), rank 0; broadcast every bucket in plan order
                                                e. gloo group, rank `rank`; receive every bucket

The joins close at step 4 atomically enough: a receiver whose `add` came after the sender read
the count gets a rank outside the world and leaves (`LateForRound`); it takes the next round or
asks for a catch-up round of its own (docs/architecture.md, "Weights over the network").

Gloo's broadcast sends from the root to each receiver, so the sender's link carries N copies;
on GPU the same plan rides NCCL (a ring) or CUDA IPC (services/rollout/vllm_ext.py selects).
Each group is built on its own store and its own device bound to the interface that reaches
the peer, so it never touches a process's default group (DeepSpeed's, or vLLM's own).
This module knows torch and sockets; it knows nothing of NATS, vLLM or DeepSpeed.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist

from shared.weightwire import Bucket, ParamSpec, TransferPlan, offsets

log = logging.getLogger(__name__)

JOIN_POLL = 0.01  # seconds between looks at the join count


class LateForRound(RuntimeError):
    """The receiver joined after the sender closed the round's joins."""


def local_address_towards(address: str, port: int) -> str:
    """The local IP the kernel routes `address` from: the interface gloo must bind (in a network
    namespace the hostname may resolve to an address no peer can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, port))  # UDP: no packet is sent
        return s.getsockname()[0]


def _gloo(store: dist.Store, group: str, rank: int, world: int, bind: str, timeout: float) -> dist.ProcessGroupGloo:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    opts._timeout = datetime.timedelta(seconds=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"{group}/pg", store), rank, world, opts)


def _broadcast(pg: dist.ProcessGroupGloo, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([buf], opts).wait()


def param_specs(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> list[ParamSpec]:
    """ParamSpecs of (name, tensor) pairs; `dtype` casts them on the wire (None: as they are)."""
    return [ParamSpec(n, str(dtype or t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]


def pack(plan: TransferPlan, bucket: Bucket, tensors: dict[int, torch.Tensor]) -> torch.Tensor:
    """The bucket's flat byte buffer; `tensors` maps param index -> tensor (any dtype: cast here)."""
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
    for i, lo, hi in offsets(plan, bucket):
        spec = plan.params[i]
        t = tensors[i].detach().to("cpu", getattr(torch, spec.dtype)).contiguous().reshape(-1)
        if tuple(tensors[i].shape) != spec.shape:
            raise ValueError(f"{spec.name}: shape {tuple(tensors[i].shape)}, the plan says {spec.shape}")
        buf[lo:hi].copy_(t.view(torch.uint8))
    return buf


def unpack(plan: TransferPlan, bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each param in a received bucket: views into `buf`, no copy."""
    out = []
    for i, lo, hi in offsets(plan, bucket):
        spec = plan.params[i]
        out.append((spec.name, buf[lo:hi].view(getattr(torch, spec.dtype)).view(spec.shape)))
    return out


def stream(plan: TransferPlan, group_tensors: Callable[[tuple[int, ...]], dict[int, torch.Tensor]],
           on_bucket: Callable[[torch.Tensor], None] | None) -> int:
    """Walk the plan one layer group at a time: `group_tensors(indices)` gives that group's tensors
    (under ZeRO-3 a gather every rank runs, so every rank calls this; only the sender passes
    `on_bucket`), each bucket of it is packed and handed on, then the group is dropped. Returns
    the bytes handed on."""
    sent = 0
    by_group: dict[int, list[Bucket]] = {}
    for b in plan.buckets:
        by_group.setdefault(b.group, []).append(b)
    for g, indices in enumerate(plan.groups):
        tensors = group_tensors(indices)
        if on_bucket is not None:
            for bucket in by_group.get(g, []):
                buf = pack(plan, bucket, tensors)
                on_bucket(buf)
                sent += buf.numel()
        del tensors
    return sent


@dataclass
class Round:
    group: str
    receivers: int  # joined before the close


class WeightSender:
    """The trainer's end: one TCPStore for its lifetime, one round per published version."""

    def __init__(self, bind: str = "127.0.0.1", port: int = 0, timeout: float = 120.0):
        self.bind, self.timeout = bind, timeout
        self.store = dist.TCPStore(bind, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        self.port = self.store.port

    def open(self, plan: TransferPlan, group: str) -> None:
        """Step 1: receivers can read the plan (and join) from now on."""
        self.store.set(f"{group}/plan", msgspec.msgpack.encode(plan))

    def close_joins(self, group: str, expected: int, window: float) -> Round:
        """Steps 3-4: wait until `expected` receivers joined or `window` seconds passed; the world
        is fixed at whoever joined."""
        deadline = time.monotonic() + window
        while (n := self.store.add(f"{group}/joined", 0)) < expected and time.monotonic() < deadline:
            time.sleep(JOIN_POLL)
        self.store.set(f"{group}/world", str(n + 1))
        return Round(group, n)

    def send(self, rnd: Round, plan: TransferPlan,
             group_tensors: Callable[[tuple[int, ...]], dict[int, torch.Tensor]]) -> int:
        """Step 5: broadcast every bucket to the round's receivers; returns the bytes sent (0 with no receiver:
        the groups are still walked, so a ZeRO-3 gather on other ranks stays in step)."""
        if rnd.receivers == 0:
            return stream(plan, group_tensors, None)
        pg = _gloo(self.store, rnd.group, 0, rnd.receivers + 1, self.bind, self.timeout)
        try:
            return stream(plan, group_tensors, lambda buf: _broadcast(pg, buf))
        finally:
            pg.shutdown()


@dataclass
class Joined:
    plan: TransferPlan
    rank: int
    world: int
    store: dist.Store
    group: str
    bind: str
    timeout: float


def join(address: str, port: int, group: str, timeout: float = 120.0) -> Joined:
    """Steps a-d. Raises LateForRound, or a torch DistStoreError when the sender is unreachable."""
    store = dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    plan = msgspec.msgpack.decode(store.get(f"{group}/plan"), type=TransferPlan)
    rank = store.add(f"{group}/joined", 1)
    world = int(store.get(f"{group}/world"))
    if rank >= world:
        raise LateForRound(f"joined round {group} as receiver {rank}, after it closed at {world - 1}")
    return Joined(plan, rank, world, store, group, local_address_towards(address, port), timeout)


def receive(joined: Joined, on_tensors: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
    """Step e: every bucket of the plan, in order, handed to `on_tensors` as (name, tensor) views
    that live until it returns. Returns the bytes received."""
    pg = _gloo(joined.store, joined.group, joined.rank, joined.world, joined.bind, joined.timeout)
    got = 0
    try:
        for bucket in joined.plan.buckets:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
            _broadcast(pg, buf)
            on_tensors(unpack(joined.plan, bucket, buf))
            got += bucket.nbytes
    finally:
        pg.shutdown()
    return got
