"""The plan of one weight transfer: which tensors travel, in which layer group and which bucket.

A trainer streams its parameters to rollout workers over the network (shared/weightxfer.py),
never materialising the whole model at once: it walks the model one LAYER GROUP at a time
(the embeddings, then each decoder layer, then the final norm and head; under ZeRO-3 one
group is gathered, sent and released before the next), and cuts each group into BUCKETS of
at most `bucket_bytes`, each one flat byte buffer at the receiver. A tensor larger than a
bucket is a bucket alone. A bucket never spans two groups, so the sender holds one group.

On the wire a bucket is one or more MESSAGES (`messages`): each tensor of at least the plan's
`alone_bytes` is a message of its own, which the sender hands to the socket from the tensor's
own memory (no packing copy); each run of smaller neighbours is one message, packed.

Both ends compute nothing from the model: the sender builds the plan from its tensor specs
and hands it to every receiver, which sizes its buffers from it. This module is pure data
(no torch, no sockets); a dtype is its torch name ("float32", "bfloat16").
"""

from __future__ import annotations

import msgspec

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024  # vLLM's packed NCCL default is 1 GiB in 2 buffers; 256 MiB halves peak memory on CPU

ALONE_BYTES = 1 << 20  # a tensor this large is a message of its own: a message costs a rendezvous (~0.1 ms), 1 MiB ~1 ms on 10 Gbit/s

ALIGN = 8  # each tensor starts on an 8-byte boundary of its bucket, so it can be viewed as its dtype in place

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


class ParamSpec(msgspec.Struct, array_like=True, frozen=True):
    name: str  # checkpoint (HF) name, what vLLM's load_weights takes
    dtype: str  # wire dtype, a torch dtype's name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    @property
    def padded(self) -> int:
        """Its room in a bucket: `nbytes` rounded up to ALIGN."""
        return -(-self.nbytes // ALIGN) * ALIGN


class Bucket(msgspec.Struct, array_like=True, frozen=True):
    group: int  # index into TransferPlan.groups
    params: tuple[int, ...]  # indices into TransferPlan.params, in order
    nbytes: int  # the flat buffer's size: the params back to back, each padded to ALIGN


class TransferPlan(msgspec.Struct, array_like=True, frozen=True):
    version: int
    params: tuple[ParamSpec, ...]
    groups: tuple[tuple[int, ...], ...]  # layer groups: indices into params, in send order
    buckets: tuple[Bucket, ...]
    # a tensor of at least this many bytes travels as a message of its own; 0 (a plan written before
    # there were messages): each bucket is one message
    alone_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def _layer_index(name: str) -> tuple[str, int] | None:
    """(prefix, index) of a name's outermost integer segment: `model.layers.3.mlp.w` -> ("model.layers", 3).
    Outermost keeps a MoE layer whole (vLLM's `layerwise_groups` uses the same rule)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def layer_groups(names: list[str]) -> list[list[int]]:
    """Indices of `names` grouped per layer: the un-indexed names before the first layer (the
    embeddings), one group per (stack, index) in first-seen stack order and ascending index, then
    every un-indexed name seen after a layer (final norm, LM head). No group is empty."""
    pre: list[int] = []
    post: list[int] = []
    stacks: dict[tuple[str, int], list[int]] = {}
    for i, name in enumerate(names):
        key = _layer_index(name)
        if key is None:
            (post if stacks else pre).append(i)
        else:
            stacks.setdefault(key, []).append(i)
    stack_rank: dict[str, int] = {}
    for prefix, _ in stacks:
        stack_rank.setdefault(prefix, len(stack_rank))
    ordered = sorted(stacks, key=lambda k: (stack_rank[k[0]], k[1]))
    return [g for g in [pre, *(stacks[k] for k in ordered), post] if g]


def plan_buckets(params: list[ParamSpec], groups: list[list[int]], bucket_bytes: int) -> list[Bucket]:
    """Cut each group, in order, into buckets of at most `bucket_bytes` (a larger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    out: list[Bucket] = []
    for g, group in enumerate(groups):
        cur: list[int] = []
        size = 0
        for i in group:
            n = params[i].padded
            if cur and size + n > bucket_bytes:
                out.append(Bucket(g, tuple(cur), size))
                cur, size = [], 0
            cur.append(i)
            size += n
        if cur:
            out.append(Bucket(g, tuple(cur), size))
    return out


def make_plan(version: int, params: list[ParamSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              alone_bytes: int = ALONE_BYTES) -> TransferPlan:
    """The plan for `params` (in the sender's iteration order). Raises ValueError on a duplicate
    name or an unknown dtype: both ends would disagree on the byte layout."""
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise ValueError("duplicate parameter names in a transfer plan")
    unknown = sorted({p.dtype for p in params} - set(DTYPE_BYTES))
    if unknown:
        raise ValueError(f"no wire size for dtypes {unknown}")
    groups = layer_groups(names)
    return TransferPlan(version, tuple(params), tuple(tuple(g) for g in groups),
                        tuple(plan_buckets(params, groups, bucket_bytes)), alone_bytes)


def offsets(plan: TransferPlan, bucket: Bucket) -> list[tuple[int, int, int]]:
    """(param index, start byte, end byte) of each tensor inside the bucket's flat buffer."""
    out, at = [], 0
    for i in bucket.params:
        spec = plan.params[i]
        out.append((i, at, at + spec.nbytes))
        at += spec.padded
    return out


def messages(plan: TransferPlan, bucket: Bucket) -> list[tuple[tuple[int, ...], int, int]]:
    """(param indices, start byte, end byte) of each message the bucket travels as, in order: a tensor of
    at least `plan.alone_bytes` alone (exactly its bytes), each run of smaller ones together (from the
    first one's start to the last one's end; none for a run of empty tensors). Both ends cut the same
    messages from the same plan; the bytes between messages (alignment padding) never travel."""
    if plan.alone_bytes <= 0:
        return [(bucket.params, 0, bucket.nbytes)]
    out: list[tuple[tuple[int, ...], int, int]] = []
    run: list[int] = []
    run_lo = run_hi = 0
    for i, lo, hi in offsets(plan, bucket):
        if plan.params[i].nbytes >= plan.alone_bytes:
            if run:
                out.append((tuple(run), run_lo, run_hi))
                run = []
            out.append(((i,), lo, hi))
            continue
        if not run:
            run_lo = lo
        run.append(i)
        run_hi = hi
    if run:
        out.append((tuple(run), run_lo, run_hi))
    return [m for m in out if m[2] > m[1]]  # a run of empty tensors has nothing to send
