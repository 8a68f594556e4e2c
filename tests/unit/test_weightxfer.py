"""The transfer's buffering (shared/weightxfer.py): packing into reused buffers, the next bucket queued
while one is on the wire (never a third), a lone tensor in its wire form sent from its own memory, and a whole round over gloo on
127.0.0.1 (sender and receiver in two threads), bit-exact in fp32 and bf16, to a receiver that copies
(its buffers come back) and to one that keeps every view (as vLLM's layerwise reload does)."""

from __future__ import annotations

import threading

import pytest
import torch

from shared.weightwire import make_plan, messages
from shared.weightxfer import (BucketBuffers, RecvBuffers, WeightSender, join, pack, param_specs, receive, stream,
                               unpack)

NAMES = ["model.embed_tokens.weight",
         *(f"model.layers.{i}.{n}" for i in range(5) for n in ("attn.q.weight", "mlp.up.weight", "norm.weight")),
         "model.norm.weight", "lm_head.weight"]


def model(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(seed)
    return [(n, torch.randn(7) if "norm" in n else torch.randn(6, 5)) for n in NAMES]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for a bit-exact comparison (NaN-safe)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


class FakeWork:
    """A message 'on the wire': it snapshots the buffer when handed on and checks, when waited, that
    nobody wrote into it meanwhile."""

    def __init__(self, log: list, buf: torch.Tensor, bucket: int):
        self.log, self.buf, self.at_send, self.bucket = log, buf, buf.clone(), bucket
        log.append(("send", bucket))

    def wait(self) -> None:
        assert torch.equal(self.buf, self.at_send), "a buffer was overwritten while its message was on the wire"
        self.log.append(("wait", self.bucket))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_into_two_buffers_in_turn_gives_back_every_tensor_bit_exact(dtype):
    named = model()
    plan = make_plan(1, param_specs(named, dtype), bucket_bytes=100)
    assert len(plan.buckets) > 4  # several buckets per group: the buffers come round again
    bufs = BucketBuffers(plan, 2)
    assert len({b.data_ptr() for b in bufs.buffers}) == 2
    assert all(b.numel() == max(k.nbytes for k in plan.buckets) for b in bufs.buffers)
    got = {}
    for b in plan.buckets:
        out = pack(plan, b, {i: named[i][1] for i in b.params}, bufs.take(b.nbytes))
        assert out.numel() == b.nbytes and out.data_ptr() in {x.data_ptr() for x in bufs.buffers}
        got.update((n, t.clone()) for n, t in unpack(plan, b, out))
    assert list(got) == NAMES
    assert all(same_bits(got[n], t.to(dtype)) for n, t in named)


def test_pack_casts_and_copies_a_non_contiguous_tensor_in_one_pass():
    t = torch.randn(5, 6).t()  # non-contiguous fp32
    plan = make_plan(1, param_specs([("w", t)], torch.bfloat16))
    [(name, got)] = unpack(plan, plan.buckets[0], pack(plan, plan.buckets[0], {0: t}))
    assert name == "w" and same_bits(got, t.to(torch.bfloat16))


def test_a_buffer_too_small_for_the_bucket_is_refused():
    named = model()
    plan = make_plan(1, param_specs(named), bucket_bytes=100)
    big = max(plan.buckets, key=lambda b: b.nbytes)
    with pytest.raises(ValueError, match="bytes"):
        pack(plan, big, {i: named[i][1] for i in big.params}, torch.empty(big.nbytes - 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bytes"):
        BucketBuffers(plan, 2).take(big.nbytes + 1)


def in_flight(events: list) -> list[int]:
    """How many buckets had a message not yet waited, at each send."""
    sent: dict[int, int] = {}
    out = []
    for kind, bucket in events:
        sent[bucket] = sent.get(bucket, 0) + (1 if kind == "send" else -1)
        if kind == "send":
            out.append(sum(1 for n in sent.values() if n > 0))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_queues_the_next_bucket_while_one_is_on_the_wire_and_never_packs_over_it(dtype):
    named = model(1)
    plan = make_plan(1, param_specs(named, dtype), bucket_bytes=300, alone_bytes=100)
    wire = [(k, m) for k, b in enumerate(plan.buckets) for m in messages(plan, b)]
    lone = [plan.params[m[0][0]].nbytes >= plan.alone_bytes for _, m in wire]
    assert any(lone) == (dtype == torch.float32) and not all(lone)  # packed runs, and lone tensors in fp32
    events: list = []
    bufs = {k: torch.zeros(b.nbytes, dtype=torch.uint8) for k, b in enumerate(plan.buckets)}

    def on_message(buf):
        k, (_, lo, hi) = wire[sum(1 for e in events if e[0] == "send")]
        bufs[k][lo:hi] = buf  # what the receiver gets, at its place in the bucket
        return FakeWork(events, buf, k)

    timings: dict[str, float] = {}
    sent = stream(plan, lambda idx: {i: named[i][1] for i in idx}, on_message, timings=timings)
    assert sent == plan.nbytes
    assert [e for e in events if e[0] == "send"] == [("send", k) for k, _ in wire]  # in plan order
    assert sorted(events) == sorted([("send", k) for k, _ in wire] + [("wait", k) for k, _ in wire])  # all waited
    assert max(in_flight(events)) == 2  # bucket k+1 queued while k is on the wire, never a third
    received = {n: t for k, b in enumerate(plan.buckets) for n, t in unpack(plan, b, bufs[k])}
    assert all(same_bits(received[n], t.to(dtype)) for n, t in named)
    assert set(timings) == {"gather", "pack", "wait"} and all(v >= 0 for v in timings.values())


def test_a_tensor_alone_in_its_wire_form_goes_from_its_own_memory():
    big = torch.randn(64, 4, dtype=torch.bfloat16)  # 512 bytes, contiguous: as it is
    odd = torch.randn(3, 3, dtype=torch.bfloat16)  # 18 bytes: its padding never travels, so as it is too
    named = [("model.embed_tokens.weight", big), ("model.layers.0.q.weight", odd),
             ("model.layers.0.k.weight", torch.randn(64, 4).t()),  # non-contiguous: copied
             ("model.layers.0.n1.weight", torch.randn(4, dtype=torch.bfloat16)),  # small neighbours: packed together
             ("model.layers.0.n2.weight", torch.randn(4, dtype=torch.bfloat16)),
             ("lm_head.weight", torch.randn(64, 4))]  # fp32: cast, so copied
    plan = make_plan(1, param_specs(named, torch.bfloat16), bucket_bytes=4096, alone_bytes=16)
    ptrs = []
    stream(plan, lambda idx: {i: named[i][1] for i in idx}, lambda buf: ptrs.append((buf.data_ptr(), buf.numel())))
    assert len(ptrs) == 5  # embeddings | q | k | n1+n2 | lm_head
    assert ptrs[0] == (big.data_ptr(), 512) and ptrs[1] == (odd.data_ptr(), 18)
    own = {t.data_ptr() for _, t in named}
    assert all(p not in own for p, _ in ptrs[2:]) and ptrs[3][1] == 16 and ptrs[4][1] == 512


def test_stream_without_a_sender_walks_every_group():
    named = model()
    plan = make_plan(1, param_specs(named), bucket_bytes=100)
    seen = []
    assert stream(plan, lambda idx: seen.append(idx) or {}, None) == 0
    assert seen == list(plan.groups)


def test_a_receive_buffer_comes_back_only_when_no_view_of_it_is_left():
    pool = RecvBuffers(keep=2)
    a = pool.take(4096)
    a_ptr = a.data_ptr()
    b = pool.take(4096)
    b_ptr = b.data_ptr()
    assert b_ptr != a_ptr  # a is held by its taker
    kept = a[8:16].view(torch.float32)  # a consumer keeps a view of a
    del a, b
    c = pool.take(1024)
    assert c.data_ptr() == b_ptr  # b's memory came back (for a smaller bucket too); a is still kept
    del kept
    d = pool.take(4096)
    assert d.data_ptr() == a_ptr  # the last view of a is gone: a comes back
    e = pool.take(4096)
    assert e.data_ptr() not in (a_ptr, b_ptr)  # both held: a new one, in place of the oldest (a)
    assert len(pool._pool) == 2
    del c
    assert pool.take(4096).data_ptr() == b_ptr
    held = [pool.take(4096) for _ in range(3)]
    assert len({h.data_ptr() for h in held} | {d.data_ptr(), e.data_ptr()}) == 5 and len(pool._pool) == 2


def round_trip(named, dtype, keep_views: bool, rounds: int = 2, alone_bytes: int = 32,
               pool: RecvBuffers | None = None):
    """`rounds` rounds over gloo on 127.0.0.1; what the receiver kept from each (the views themselves
    until the round ends, as vLLM's layerwise reload does, or copies) and the distinct buffers the
    buckets came in. `pool`: the receiver's buffers for every round (None: its own per round)."""
    plan = make_plan(3, param_specs(named, dtype), bucket_bytes=300, alone_bytes=alone_bytes)
    sender = WeightSender("127.0.0.1", 0, timeout=30)
    tensors = dict(enumerate(t for _, t in named))
    results, errors = [], []
    for r in range(rounds):
        group = f"r{r}-{keep_views}"
        sender.open(plan, group)
        kept: list[tuple[str, torch.Tensor]] = []
        ptrs: set[int] = set()

        def consume(pairs, kept=kept, ptrs=ptrs):
            ptrs.add(pairs[0][1].untyped_storage().data_ptr())
            kept.extend((n, t if keep_views else t.clone()) for n, t in pairs)

        def recv(group=group, consume=consume):
            try:
                joined = join("127.0.0.1", sender.port, group, timeout=30)
                assert receive(joined, consume, buffers=pool) == plan.nbytes
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        th = threading.Thread(target=recv)
        th.start()
        rnd = sender.close_joins(group, expected=1, window=20)
        timings: dict[str, float] = {}
        assert sender.send(rnd, plan, lambda idx: {i: tensors[i] for i in idx}, timings=timings) == plan.nbytes
        th.join(30)
        assert not th.is_alive() and not errors, errors
        results.append((dict(kept), ptrs))
        tensors = {i: t + 1 for i, t in tensors.items()}  # the next version
    return plan, results


@pytest.mark.parametrize("alone_bytes", [32, 0])  # lone and packed messages; a bucket as one message
@pytest.mark.parametrize("keep_views", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_round_over_gloo_delivers_every_tensor_bit_exact(dtype, keep_views, alone_bytes):
    named = model(2)
    plan, results = round_trip(named, dtype, keep_views, alone_bytes=alone_bytes)
    assert (len(plan.buckets) < sum(len(messages(plan, b)) for b in plan.buckets)) == (alone_bytes > 0)
    for r, (got, buffers) in enumerate(results):
        assert list(got) == NAMES
        assert all(same_bits(got[n], (t + r).to(dtype)) for n, t in named), f"round {r}"
        if keep_views:
            assert len(buffers) == len(plan.buckets)  # none overwritten
        else:
            assert len(buffers) < len(plan.buckets)  # the copying consumer's buffers came back


def test_a_copying_consumer_with_one_pool_gets_the_same_two_buffers_every_round():
    named = model(3)
    largest = max(b.nbytes for b in make_plan(3, param_specs(named), bucket_bytes=300).buckets)
    pool = RecvBuffers(keep=2, min_bytes=largest)
    plan, results = round_trip(named, torch.float32, keep_views=False, rounds=3, pool=pool)
    assert len({b.nbytes for b in plan.buckets}) > 1  # buckets of several sizes, all in the same buffers
    want = dict(named)
    for r, (got, _) in enumerate(results):
        assert all(same_bits(got[n], want[n]) for n in NAMES), f"round {r}"
        want = {n: t + 1 for n, t in want.items()}  # as round_trip makes the next version
    assert len(set().union(*(ptrs for _, ptrs in results))) == 2
    assert all(buf.numel() == largest for buf, _ in pool._pool)
