"""The transfer plan (shared/weightwire.py): layer groups and buckets, pure; and the byte layout
(shared/weightxfer.py pack/unpack) of fp32 and bf16 tensors, without a socket."""

from __future__ import annotations

import pytest
import torch

import msgspec

from shared.weightwire import ALIGN, ALONE_BYTES, ParamSpec, TransferPlan, layer_groups, make_plan, messages, offsets, plan_buckets
from shared.weightxfer import pack, param_specs, unpack

NAMES = ["model.embed_tokens.weight", "model.layers.0.attn.q.weight", "model.layers.0.mlp.up.weight",
         "model.layers.1.attn.q.weight", "model.layers.1.mlp.up.weight", "model.norm.weight", "lm_head.weight"]


def test_layer_groups_are_embeddings_then_each_layer_then_the_tail():
    assert layer_groups(NAMES) == [[0], [1, 2], [3, 4], [5, 6]]


def test_layer_groups_order_layers_by_index_and_keep_a_moe_layer_whole():
    names = ["model.layers.10.x", "model.layers.2.mlp.experts.0.w", "model.layers.2.mlp.experts.1.w",
             "visual.blocks.0.w", "model.norm.weight"]
    assert layer_groups(names) == [[1, 2], [0], [3], [4]]  # stacks in first-seen order, index ascending
    assert layer_groups(["a", "b"]) == [[0, 1]]  # no layers: one group
    assert layer_groups([]) == []


def specs(*sizes: int, dtype: str = "float32", first: int = 0) -> list[ParamSpec]:
    return [ParamSpec(f"p{first + i}", dtype, (n,)) for i, n in enumerate(sizes)]


def test_buckets_fill_up_to_the_limit_never_span_groups_and_a_large_tensor_goes_alone():
    params = specs(10, 10, 10, 100, 10)  # 40 bytes each, one of 400
    buckets = plan_buckets(params, [[0, 1, 2, 3], [4]], bucket_bytes=80)
    assert [(b.group, b.params, b.nbytes) for b in buckets] == [
        (0, (0, 1), 80), (0, (2,), 40), (0, (3,), 400), (1, (4,), 40)]
    with pytest.raises(ValueError):
        plan_buckets(params, [[0]], 0)


def test_every_tensor_starts_aligned_and_the_plan_covers_every_param_once():
    params = specs(3, 5, 1, dtype="bfloat16") + specs(7, first=3)  # 6, 10, 2 bytes: padded to 8, 16, 8
    plan = make_plan(4, params, bucket_bytes=1 << 20)
    (bucket,) = plan.buckets
    assert [lo for _, lo, _ in offsets(plan, bucket)] == [0, 8, 24, 32]
    assert all(lo % ALIGN == 0 for _, lo, _ in offsets(plan, bucket))
    assert bucket.nbytes == 64 and plan.nbytes == 64
    assert sorted(i for b in make_plan(1, params, 8).buckets for i in b.params) == [0, 1, 2, 3]


def test_a_large_tensor_is_a_message_alone_and_each_run_of_small_ones_is_one_message():
    # 40, 400, 8 (padded to 8), 6 (padded to 8), 400, 0, 40 bytes
    params = specs(10, 100, 2, dtype="float32") + specs(3, dtype="bfloat16", first=3) + specs(100, 0, 10, first=4)
    plan = make_plan(1, params, bucket_bytes=1 << 20, alone_bytes=400)
    (bucket,) = plan.buckets
    assert [lo for _, lo, _ in offsets(plan, bucket)] == [0, 40, 440, 448, 456, 856, 856]
    assert messages(plan, bucket) == [((0,), 0, 40), ((1,), 40, 440), ((2, 3), 440, 454), ((4,), 456, 856),
                                      ((5, 6), 856, 896)]
    # only alignment padding is left out, and every param is in exactly one message
    assert sum(hi - lo for _, lo, hi in messages(plan, bucket)) == sum(p.nbytes for p in params)
    assert [i for m, _, _ in messages(plan, bucket) for i in m] == list(range(7))


def test_a_plan_without_alone_bytes_sends_each_bucket_as_one_message():
    params = specs(10, 100, 2)
    plan = make_plan(1, params, bucket_bytes=200, alone_bytes=0)
    assert [messages(plan, b) for b in plan.buckets] == [[(b.params, 0, b.nbytes)] for b in plan.buckets]
    # a plan encoded before the field existed decodes to that (array_like: the field came last, defaulted)
    old = msgspec.msgpack.encode([plan.version, plan.params, plan.groups, plan.buckets])
    assert msgspec.msgpack.decode(old, type=TransferPlan) == plan
    assert make_plan(1, params).alone_bytes == ALONE_BYTES
    assert messages(make_plan(1, specs(0, 0)), make_plan(1, specs(0, 0)).buckets[0]) == []  # nothing to send


def test_a_plan_refuses_duplicate_names_and_unknown_dtypes():
    with pytest.raises(ValueError, match="duplicate"):
        make_plan(1, [ParamSpec("a", "float32", (1,))] * 2)
    with pytest.raises(ValueError, match="dtypes"):
        make_plan(1, [ParamSpec("a", "complex64", (1,))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_then_unpack_gives_back_every_tensor_in_the_wire_dtype(dtype):
    torch.manual_seed(0)
    named = [(n, torch.randn(3, 5) if "norm" not in n else torch.randn(7)) for n in NAMES]
    plan = make_plan(1, param_specs(named, dtype), bucket_bytes=100)
    got = {}
    for b in plan.buckets:
        got.update((n, t.clone()) for n, t in unpack(plan, b, pack(plan, b, {i: named[i][1] for i in b.params})))
    assert list(got) == NAMES
    assert all(got[n].dtype == dtype and torch.equal(got[n], t.to(dtype)) for n, t in named)


def test_pack_refuses_a_tensor_whose_shape_differs_from_the_plan():
    plan = make_plan(1, specs(4))
    with pytest.raises(ValueError, match="shape"):
        pack(plan, plan.buckets[0], {0: torch.zeros(5)})
