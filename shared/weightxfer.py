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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist

from shared.weightwire import Bucket, ParamSpec, TransferPlan, messages, offsets

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


def _broadcast(pg: dist.ProcessGroupGloo, buf: torch.Tensor) -> dist.Work:
    """Start broadcasting `buf` from rank 0 (gloo runs it on its own thread); the caller waits."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return pg.broadcast([buf], opts)


def param_specs(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> list[ParamSpec]:
    """ParamSpecs of (name, tensor) pairs; `dtype` casts them on the wire (None: as they are)."""
    return [ParamSpec(n, str(dtype or t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]


class BucketBuffers:
    """`n` flat byte buffers, each as large as the plan's largest bucket, handed out in turn: with 2, the
    sender packs bucket k+1 into one while bucket k is on the wire from the other. Whoever takes a buffer
    must be done with it (its broadcast waited) before it comes round again, `n` takes later."""

    def __init__(self, plan: TransferPlan, n: int = 2):
        if n < 1:
            raise ValueError(f"need at least one buffer, got {n}")
        size = max((b.nbytes for b in plan.buckets), default=0)
        self.buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(n)]
        self._turn = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """The next buffer's first `nbytes` (a view)."""
        buf = self.buffers[self._turn]
        self._turn = (self._turn + 1) % len(self.buffers)
        if nbytes > buf.numel():
            raise ValueError(f"a bucket of {nbytes} bytes, the buffers hold {buf.numel()}")
        return buf[:nbytes]


def _wire_form(plan: TransferPlan, i: int, t: torch.Tensor) -> torch.Tensor | None:
    """Param `i`'s bytes without a copy, where `t` is already as the wire wants it (on the CPU, contiguous,
    in the wire dtype and shape); else None."""
    spec = plan.params[i]
    if (t.device.type != "cpu" or t.dtype != getattr(torch, spec.dtype) or not t.is_contiguous()
            or tuple(t.shape) != spec.shape):
        return None
    return t.detach().reshape(-1).view(torch.uint8)


def _pack_into(plan: TransferPlan, at: list[tuple[int, int, int]], tensors: dict[int, torch.Tensor],
               buf: torch.Tensor) -> None:
    """Cast and copy each (param index, start, end) of `at` into `buf[start:end]`, in one pass each."""
    for i, lo, hi in at:
        spec = plan.params[i]
        if tuple(tensors[i].shape) != spec.shape:
            raise ValueError(f"{spec.name}: shape {tuple(tensors[i].shape)}, the plan says {spec.shape}")
        buf[lo:hi].view(getattr(torch, spec.dtype)).view(spec.shape).copy_(tensors[i].detach())


def pack(plan: TransferPlan, bucket: Bucket, tensors: dict[int, torch.Tensor],
         out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's flat byte buffer; `tensors` maps param index -> tensor (any dtype and device: cast
    and copied here in one pass, straight into the buffer). `out`: a uint8 buffer of at least
    `bucket.nbytes` to pack into (its first `bucket.nbytes` are returned); None: a new one."""
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8) if out is None else out[:bucket.nbytes]
    if buf.numel() != bucket.nbytes:
        raise ValueError(f"a bucket of {bucket.nbytes} bytes, the buffer holds {buf.numel()}")
    _pack_into(plan, offsets(plan, bucket), tensors, buf)
    return buf


def _message(plan: TransferPlan, msg: tuple[tuple[int, ...], int, int], where: dict[int, tuple[int, int]],
             tensors: dict[int, torch.Tensor], staging: torch.Tensor) -> torch.Tensor:
    """One message's bytes (`weightwire.messages`): a lone tensor already in its wire form as it is,
    else its tensors packed into `staging` at their places in the bucket (`where`: index -> start, end)."""
    params, lo, hi = msg
    if len(params) == 1 and hi - lo == plan.params[params[0]].nbytes:
        own = _wire_form(plan, params[0], tensors[params[0]])
        if own is not None:
            return own
    _pack_into(plan, [(i, *where[i]) for i in params], tensors, staging)
    return staging[lo:hi]


def unpack(plan: TransferPlan, bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each param in a received bucket: views into `buf`, no copy."""
    out = []
    for i, lo, hi in offsets(plan, bucket):
        spec = plan.params[i]
        out.append((spec.name, buf[lo:hi].view(getattr(torch, spec.dtype)).view(spec.shape)))
    return out


class _Timer:
    """Adds each stage's seconds into `timings` (when given)."""

    def __init__(self, timings: dict[str, float] | None):
        self.timings = timings
        self.t = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[stage] = self.timings.get(stage, 0.0) + now - self.t
        self.t = now


def _wait_all(sends: list) -> None:
    """Wait every one of `sends` (none left running on its buffer), then raise the first error."""
    error: Exception | None = None
    for w in sends:
        try:
            w.wait()
        except Exception as e:  # noqa: BLE001 - raised below, once all are waited
            error = error or e
    if error is not None:
        raise error


def stream(plan: TransferPlan, group_tensors: Callable[[tuple[int, ...]], dict[int, torch.Tensor]],
           on_message: Callable[[torch.Tensor], dist.Work | None] | None, *,
           buffers: BucketBuffers | None = None, timings: dict[str, float] | None = None) -> int:
    """Walk the plan one layer group at a time: `group_tensors(indices)` gives that group's tensors
    (under ZeRO-3 a gather every rank runs, so every rank calls this; only the sender passes
    `on_message`), each bucket of it is handed on message by message (`weightwire.messages`), then
    the group is dropped. Returns the bytes of the buckets handed on.

    A message that is one tensor already in its wire form goes as it is (its memory, no copy); the
    others are packed into the bucket's staging buffer from `buffers` (default: two of the largest
    bucket's size, reused). `on_message` may return a pending send (anything with `wait()`): the sender
    goes on while it is on the wire, and before a staging buffer is taken again every message of the
    bucket that last took it is waited, so with two buffers bucket k+1 is packed and queued while
    bucket k is on the wire. `timings` adds up seconds per stage: "gather" (group_tensors), "pack"
    (packing and handing on), "wait" (sends still on the wire when their buffer was wanted, and at the end)."""
    if on_message is None:
        for indices in plan.groups:
            tensors = group_tensors(indices)
            del tensors
        return 0
    bufs = buffers if buffers is not None else BucketBuffers(plan, 2)
    sent = 0
    in_flight: deque[list] = deque()  # per bucket handed on, oldest first: its messages' pending sends
    by_group: dict[int, list[Bucket]] = {}
    for b in plan.buckets:
        by_group.setdefault(b.group, []).append(b)
    clock = _Timer(timings)
    try:
        for g, indices in enumerate(plan.groups):
            tensors = group_tensors(indices)
            clock.lap("gather")
            for bucket in by_group.get(g, []):
                while len(in_flight) >= len(bufs.buffers):  # the buffer taken next is still that bucket's
                    _wait_all(in_flight.popleft())
                    clock.lap("wait")
                staging = bufs.take(bucket.nbytes)
                where = {i: (lo, hi) for i, lo, hi in offsets(plan, bucket)}
                sends = []
                for msg in messages(plan, bucket):
                    pending = on_message(_message(plan, msg, where, tensors, staging))
                    if pending is not None:
                        sends.append(pending)
                in_flight.append(sends)
                sent += bucket.nbytes
                clock.lap("pack")
            del tensors
        while in_flight:
            _wait_all(in_flight.popleft())
        clock.lap("wait")
    finally:
        while in_flight:  # an error mid-stream: leave no send running on a buffer
            try:
                _wait_all(in_flight.popleft())
            except Exception:  # noqa: BLE001 - the first error is the one raised
                log.debug("a pending send failed while another error unwound the stream", exc_info=True)
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
        self._buffers: BucketBuffers | None = None  # the send buffers, reused round after round

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
             group_tensors: Callable[[tuple[int, ...]], dict[int, torch.Tensor]],
             timings: dict[str, float] | None = None) -> int:
        """Step 5: broadcast every bucket to the round's receivers; returns the bytes sent (0 with no receiver:
        the groups are still walked, so a ZeRO-3 gather on other ranks stays in step). Bucket k+1 is
        gathered and packed while bucket k is on the wire (`stream`); `timings` as there."""
        if rnd.receivers == 0:
            return stream(plan, group_tensors, None)
        pg = _gloo(self.store, rnd.group, 0, rnd.receivers + 1, self.bind, self.timeout)
        try:
            if self._buffers is None or self._buffers.buffers[0].numel() < max(b.nbytes for b in plan.buckets):
                self._buffers = BucketBuffers(plan, 2)  # kept for the next round: its pages stay mapped
            return stream(plan, group_tensors, lambda buf: _broadcast(pg, buf), buffers=self._buffers,
                          timings=timings)
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


def _storage_refs(t: torch.Tensor) -> int:
    """How many tensors (views included) hold `t`'s memory, plus one for the look itself."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class RecvBuffers:
    """The receiver's bucket buffers, each taken again only when nothing but this pool holds it: a
    consumer that copies a bucket and lets go of its views gets the same pages back bucket after bucket
    (no page faults on a new buffer); one that keeps the views, as vLLM's layerwise reload does (what
    `load_weights` is given waits until its layer is whole, attention layers until the finish), keeps
    the buffer, and the next bucket gets a new one. At most `keep` buffers are pooled.

    A new page costs about as much as copying it several times over (it is faulted in and zeroed), so a
    copying consumer that receives round after round keeps one pool for all of them, with `min_bytes`
    the plan's largest bucket: every buffer then fits every bucket, and no round faults a page in.
    A consumer that keeps the views leaves `min_bytes` at 0: its kept buffers are each their bucket's size."""

    def __init__(self, keep: int = 2, min_bytes: int = 0):
        self.keep, self.min_bytes = keep, min_bytes
        self._pool: list[tuple[torch.Tensor, int]] = []  # (buffer, its reference count when free)

    def take(self, nbytes: int) -> torch.Tensor:
        for buf, free in self._pool:
            if buf.numel() >= nbytes and _storage_refs(buf) == free:
                return buf[:nbytes]
        buf = torch.empty(max(nbytes, self.min_bytes), dtype=torch.uint8)
        if len(self._pool) >= self.keep:
            self._pool.pop(0)  # the oldest: if someone still holds it, it is theirs now
        self._pool.append((buf, _storage_refs(buf)))
        return buf[:nbytes]  # a view, never the pooled tensor itself: the taker's hold counts


LET_GO_WAIT = 0.05  # seconds a finished receive's buffer may stay held by gloo's worker thread


def _let_go(buf: torch.Tensor, alone: int) -> None:
    """Wait, at most LET_GO_WAIT, until nothing but `buf` holds its memory (`alone` references): gloo's
    worker thread signals a receive done a moment before it drops its hold of the buffer, and a buffer
    still held then would never be taken again (`RecvBuffers`). Past the bound the pool allocates anew."""
    deadline = time.monotonic() + LET_GO_WAIT
    while _storage_refs(buf) > alone and time.monotonic() < deadline:
        time.sleep(0.0001)


def receive(joined: Joined, on_tensors: Callable[[list[tuple[str, torch.Tensor]]], None], *,
            buffers: RecvBuffers | None = None, timings: dict[str, float] | None = None) -> int:
    """Step e: every bucket of the plan, in order, handed to `on_tensors` as (name, tensor) views into
    that bucket's buffer, each of its messages (`weightwire.messages`) received straight into its place
    there. Bucket k+1's receives are posted as soon as bucket k is in, so it is on the wire while
    `on_tensors` takes bucket k. Returns the bytes of the buckets received.

    The consumer may keep the views as long as it likes: a buffer is received into again only once no
    view of it is left (`buffers`, default: a new `RecvBuffers` for this round). `timings` adds up seconds per stage: "wait" (for a bucket still
    on the wire) and "consume" (in `on_tensors`)."""
    plan = joined.plan
    bufs = buffers if buffers is not None else RecvBuffers()
    pg = _gloo(joined.store, joined.group, joined.rank, joined.world, joined.bind, joined.timeout)

    def post(bucket: Bucket) -> tuple[torch.Tensor, list[dist.Work], int]:
        buf = bufs.take(bucket.nbytes)
        alone = _storage_refs(buf)  # this view's hold alone
        return buf, [_broadcast(pg, buf[lo:hi]) for _, lo, hi in messages(plan, bucket)], alone

    got = 0
    nxt: tuple[torch.Tensor, list[dist.Work], int] | None = None  # the one bucket posted ahead
    try:
        clock = _Timer(timings)
        if plan.buckets:
            nxt = post(plan.buckets[0])
        for k, bucket in enumerate(plan.buckets):
            buf, works, alone = nxt
            nxt = None
            _wait_all(works)
            del works
            _let_go(buf, alone)
            clock.lap("wait")
            if k + 1 < len(plan.buckets):  # bucket k's buffer is held here: never the one this takes
                nxt = post(plan.buckets[k + 1])
            on_tensors(unpack(plan, bucket, buf))
            del buf  # only the consumer's views (if it kept any) hold it now
            clock.lap("consume")
            got += bucket.nbytes
    finally:
        if nxt is not None:  # an error mid-round: gloo must not write into a buffer after we leave
            try:
                _wait_all(nxt[1])
            except Exception:  # noqa: BLE001 - the first error is the one raised
                log.debug("a pending receive failed while another error unwound the round", exc_info=True)
        pg.shutdown()
    return got
