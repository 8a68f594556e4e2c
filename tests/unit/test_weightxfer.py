"""The transfer's buffering (shared/weightxfer.py): packing into reused buffers, one bucket in flight
while the next is packed, a one-tensor bucket sent as it is, and a whole round over gloo on
127.0.0.1 (sender and receiver in two threads), bit-exact in fp32 and bf16, to a receiver that copies
(its buffers come back) and to one that keeps every view (as vLLM's layerwise reload does)."""

from __future__ import annotations

import threading

import pytest
import torch

from shared.weightwire import make_plan
from shared.weightxfer import (BucketBuffers, RecvBuffers, WeightSender, join, pack, param_specs, receive, stream,
                               unpack)

NAMES = ["model.embed_tokens.weight", "model.layers.0.attn.q.weight", "model.layers.0.mlp.up.weight",
         "model.layers.0.norm.weight", "model.layers.1.attn.q.weight", "model.layers.1.mlp.up.weight",
         "model.layers.1.norm.weight", "model.norm.weight", "lm_head.weight"]


def model(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(seed)
    return [(n, torch.randn(7) if "norm" in n else torch.randn(6, 5)) for n in NAMES]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for a bit-exact comparison (NaN-safe)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


class FakeWork:
    """A send 'on the wire': it snapshots the buffer when handed on and checks, when waited, that
    nobody wrote into it meanwhile."""

    def __init__(self, log: list, buf: torch.Tensor):
        self.log, self.buf, self.at_send = log, buf, buf.clone()
        log.append(("send", buf.data_ptr()))

    def wait(self) -> None:
        assert torch.equal(self.buf, self.at_send), "a buffer was overwritten while its bucket was on the wire"
        self.log.append(("wait", self.buf.data_ptr()))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_keeps_one_bucket_in_flight_and_never_packs_over_it(dtype):
    named = model(1)
    plan = make_plan(1, param_specs(named, dtype), bucket_bytes=100)
    events: list = []
    received = {}

    def on_bucket(buf):
        b = plan.buckets[sum(1 for e in events if e[0] == "send")]
        received.update((n, t.clone()) for n, t in unpack(plan, b, buf))
        return FakeWork(events, buf)

    timings: dict[str, float] = {}
    sent = stream(plan, lambda idx: {i: named[i][1] for i in idx}, on_bucket, timings=timings)
    assert sent == plan.nbytes
    kinds = [k for k, _ in events]
    assert kinds == ["send"] + ["wait", "send"] * (len(plan.buckets) - 1) + ["wait"]  # one in flight, all waited
    assert all(same_bits(received[n], t.to(dtype)) for n, t in named)
    assert set(timings) == {"gather", "pack", "wait"} and all(v >= 0 for v in timings.values())


def test_a_bucket_of_one_tensor_in_its_wire_form_goes_without_a_copy():
    named = [("model.embed_tokens.weight", torch.randn(64, 4, dtype=torch.bfloat16)),
             ("model.layers.0.q.weight", torch.randn(3, 3, dtype=torch.bfloat16)),  # 18 bytes: padded, copied
             ("lm_head.weight", torch.randn(64, 4).t())]  # non-contiguous: copied
    plan = make_plan(1, param_specs(named, torch.bfloat16), bucket_bytes=256)
    ptrs = []

    def on_bucket(buf):
        ptrs.append(buf.data_ptr())

    stream(plan, lambda idx: {i: named[i][1] for i in idx}, on_bucket)
    assert len(ptrs) == 3
    assert ptrs[0] == named[0][1].data_ptr()
    assert ptrs[1] != named[1][1].data_ptr() and ptrs[2] != named[2][1].data_ptr()


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


def round_trip(named, dtype, keep_views: bool, rounds: int = 2):
    """`rounds` rounds over gloo on 127.0.0.1; what the receiver kept from each (the views themselves
    until the round ends, as vLLM's layerwise reload does, or copies) and how many distinct buffers
    the buckets came in."""
    plan = make_plan(3, param_specs(named, dtype), bucket_bytes=100)
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
                assert receive(join("127.0.0.1", sender.port, group, timeout=30), consume) == plan.nbytes
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        th = threading.Thread(target=recv)
        th.start()
        rnd = sender.close_joins(group, expected=1, window=20)
        timings: dict[str, float] = {}
        assert sender.send(rnd, plan, lambda idx: {i: tensors[i] for i in idx}, timings=timings) == plan.nbytes
        th.join(30)
        assert not th.is_alive() and not errors, errors
        results.append((dict(kept), len(ptrs)))
        tensors = {i: t + 1 for i, t in tensors.items()}  # the next version
    return plan, results


@pytest.mark.parametrize("keep_views", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_round_over_gloo_delivers_every_tensor_bit_exact(dtype, keep_views):
    named = model(2)
    plan, results = round_trip(named, dtype, keep_views)
    for r, (got, buffers) in enumerate(results):
        assert list(got) == NAMES
        assert all(same_bits(got[n], (t + r).to(dtype)) for n, t in named), f"round {r}"
        if keep_views:
            assert buffers == len(plan.buckets)  # none overwritten
        else:
            assert buffers < len(plan.buckets)  # the copying consumer's buffers came back
