"""services/rollout/adapters.py (the adapter table) and the engine's adapter guard, no vLLM."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
from safetensors.numpy import save_file

from services.rollout.adapters import AdapterTable, lora_id
from shared.checkpoint import CheckpointError, check_checkpoint
from shared.messages.rollout import Sampling
from tests.unit.test_rollout_engine import FakeLLM, make, model  # noqa: F401 (fixtures)


def adapter_dir(path, rank=4):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((rank, 8), np.float32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((8, rank), np.float32)},
              str(path / "adapter_model.safetensors"))
    return path


def test_new_requests_take_the_newest_and_in_flight_keep_theirs():
    t = AdapterTable()
    assert t.acquire() == 0 and t.path(0) is None  # the base
    t.add(1, "/w/v1")
    a = t.acquire()
    t.add(2, "/w/v2")
    b = t.acquire()
    assert (a, b) == (1, 2) and t.path(a) == "/w/v1"
    assert t.stale(max_staleness=1) == [0] and t.stale(max_staleness=2) == [] and t.stale(-1) == []
    assert t.unloadable() == []  # v1 has a request in flight
    t.release(a)
    assert t.unloadable() == [1]
    t.remove(1)
    assert set(t.paths) == {2} and lora_id(2) == 3
    with pytest.raises(ValueError):
        t.add(2, "/w/v2-again")


def test_an_adapter_dir_is_checked_as_an_adapter(tmp_path):
    d = adapter_dir(tmp_path / "v1")
    assert len(check_checkpoint(d, reference={"other": ("F32", (1,))})) == 2
    (d / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    with pytest.raises(CheckpointError, match="rank 2"):
        check_checkpoint(d)


async def test_a_full_weights_worker_refuses_an_adapter_and_serves_on(make, tmp_path):  # noqa: F811
    e = await make()
    with pytest.raises(CheckpointError, match="SF_ROLLOUT_LORA"):
        await e.load_weights(adapter_dir(tmp_path / "v1"), 1)
    assert not e.dead and e.version == 0 and not any(c[0] == "collective_rpc" for c in e._llm.calls)


# -- multi-LoRA: one adapter per agent role in each version ------------------------------------

def role_version(path, roles=("planner", "solver")):
    for role in roles:
        adapter_dir(path / role)
    return path


def test_a_role_version_holds_one_adapter_per_role_with_ids_of_its_own():
    t = AdapterTable()
    t.add(1, "/w/v1", ("solver", "planner"))
    t.add(2, "/w/v2")  # a single-adapter version beside it keeps version + 1
    assert t.adapter(1, "planner") == (lora_id(1, 0), "/w/v1/planner")
    assert t.adapter(1, "solver") == (lora_id(1, 1), "/w/v1/solver")
    assert t.adapter(1, "critic") is None and t.adapter(0, "planner") is None
    assert t.adapter(2, "planner") == (3, "/w/v2")
    ids = [lora_id(1, 0), lora_id(1, 1), lora_id(2), lora_id(3, 0), lora_id(3, 1)]
    assert len(set(ids)) == len(ids) and 0 not in ids
    assert t.ids(1) == [lora_id(1, 0), lora_id(1, 1)] and t.ids(2) == [3]
    t.remove(1)
    assert t.adapter(1, "planner") is None and 1 not in t.roles


def test_a_role_version_dir_is_checked_role_by_role(tmp_path):
    from shared.checkpoint import is_adapter_version, role_adapters

    d = role_version(tmp_path / "v1")
    assert sorted(role_adapters(d)) == ["planner", "solver"] and is_adapter_version(d)
    assert len(check_checkpoint(d, reference={"other": ("F32", (1,))})) == 4
    assert role_adapters(tmp_path / "v1" / "planner") == {}  # an adapter dir itself is not a role set
    ckpt = tmp_path / "ckpt"  # a LoRA trainer's checkpoint root: tag dirs that are adapter dirs, and `latest`
    adapter_dir(ckpt / "step-00000002")
    (ckpt / "latest").write_text("step-00000002")
    assert role_adapters(ckpt) == {} and not is_adapter_version(ckpt)
    tag = role_version(tmp_path / "tag")  # a multi-LoRA checkpoint's tag dir: DeepSpeed's files beside the roles
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert role_adapters(tag) == {} and sorted(role_adapters(tag, files_ok=True)) == ["planner", "solver"]
    (d / "solver" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4,
                                                                  "target_modules": ["q_proj"]}))
    with pytest.raises(CheckpointError, match="rank 2"):
        check_checkpoint(d)


class LoraLLM(FakeLLM):
    """FakeLLM with vLLM's LoRA calls: which adapter each request ran with."""

    def __init__(self):
        super().__init__()
        self.loras: dict[int, str] = {}
        self.used: dict[str, object] = {}

    async def add_lora(self, req):
        self.loras[req.lora_int_id] = req.lora_path
        return True

    async def remove_lora(self, lora_id):
        self.loras.pop(lora_id, None)

    def generate(self, prompt, params, request_id, lora_request=None):
        self.used[request_id] = lora_request
        return super().generate(prompt, params, request_id)


async def test_each_role_runs_on_its_own_adapter_and_old_versions_unload(make, tmp_path):  # noqa: F811
    from services.rollout.engine import Engine  # noqa: F401 (the fixture builds one)
    from shared.messages.rollout import Sampling

    llm = LoraLLM()
    e = await make(llm=llm, lora=True)
    v1 = role_version(tmp_path / "v1")
    await e.load_weights(v1, 1)
    assert llm.loras == {lora_id(1, 0): str(v1 / "planner"), lora_id(1, 1): str(v1 / "solver")}
    for rid, role in (("a", "planner"), ("b", "solver"), ("c", "critic"), ("d", "")):
        ds = [d async for d in e.generate(rid, [1, 2, 3], Sampling(max_tokens=2), adapter=role)]
        assert {d.version for d in ds} == {1}
    assert (llm.used["a"].lora_path, llm.used["a"].lora_int_id) == (str(v1 / "planner"), lora_id(1, 0))
    assert (llm.used["b"].lora_path, llm.used["b"].lora_int_id) == (str(v1 / "solver"), lora_id(1, 1))
    assert llm.used["c"] is None and llm.used["d"] is None  # no adapter for that role: the base
    v2 = role_version(tmp_path / "v2")
    await e.load_weights(v2, 2)
    assert sorted(llm.loras) == [lora_id(2, 0), lora_id(2, 1)]  # v1's two adapters unloaded, nothing in flight
    assert e.version == 2


class OldGenerate(msgspec.Struct, tag="Generate", array_like=True, omit_defaults=True):
    """Generate as senders and workers from before `adapter` have it."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    session_id: str = ""
    hold_s: float = 0.0


def test_generate_carries_the_role_and_stays_readable_both_ways():
    from shared.codec import decode, encode
    from shared.messages.rollout import Generate

    new = Generate("r", [1, 2], Sampling(), "s", adapter="solver")
    assert decode(encode(new), Generate).adapter == "solver"
    assert decode(encode(new), OldGenerate).hold_s == 0.0  # an older worker reads it, role ignored
    assert decode(encode(OldGenerate("r", [1, 2], Sampling(), "s")), Generate).adapter == ""
    # without a role it costs one byte on the wire (msgspec writes an array_like Struct's trailing defaults), and
    # one more for `receipt`, appended after it
    assert len(encode(Generate("r", [1, 2], Sampling(), "s"))) == len(encode(OldGenerate("r", [1, 2], Sampling(), "s"))) + 2
