"""Fixtures shared by the integration modules."""

from __future__ import annotations

import pytest

from seamlessflow.stack import servers
from tests.integration.stack_fixture import make_stack


@pytest.fixture(scope="module")
def modules():
    """The trainer's modules (engine, batching, dp_check, policy_loss, TrainerConfig) for the
    DeepSpeed engine tests: imported in the fixture so collection stays cheap when they are deselected."""
    from services.trainer import batching, dp_check, engine
    from services.trainer.algorithms import policy_loss
    from services.trainer.config import TrainerConfig

    return engine, batching, dp_check, policy_loss, TrainerConfig


@pytest.fixture(scope="session")
def vllm_stack(tmp_path_factory, tiny_model, nats_url, redis_url):
    """One stack with one vLLM-CPU worker and default settings, for every module that only
    drives agent turns through it (data plane, examples, Responses API): a vLLM engine start
    is the suite's largest fixed cost. A module that changes a stack's settings, or leaves it
    changed, starts its own. An idle stack costs ~2.5% of a core while later modules run."""
    s = make_stack(tmp_path_factory.mktemp("vllm-stack"), tiny_model, nats_url, redis_url, workers=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(tiny_model):
    """The tiny model in transformers, with its tokenizer: the reference for token-exact checks."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def private_nats(tmp_path_factory):
    """A NATS server of the module's own: for modules whose fake trajectory manager answers on
    subjects the session's real services also serve, or whose published weight versions must not
    reach other modules' workers."""
    port = servers.free_port()
    proc = servers.start_nats(port, tmp_path_factory.mktemp("private-nats"))
    yield f"nats://127.0.0.1:{port}"
    servers.stop(proc)


@pytest.fixture
async def store(redis_url):
    """The trajectory manager's Redis store on the session's Redis, for modules that test it directly."""
    from services.trajectory.store import Store

    s = Store.connect(redis_url, ttl=60)
    yield s
    await s.close()


async def begin_request(store, rid: str, state, owner: str, lease_ms: int) -> bool:
    """Begin a new request as a trajectory replica does: its lookup takes the lease, its state goes
    with its first tokens (none here). False if another handling holds it or began it."""
    look = await store.lookup(rid, "", owner=owner, lease_ms=lease_ms)
    return look.leased and await store.append_deltas(rid, [], owner, begin=state)
