"""services/rollout/engine.py: the settings vLLM reads from the environment come from the
rollout config, whatever the launcher's environment says (bug: SF_ROLLOUT_KV_CACHE_GIB had
no effect under `seamlessflow up`, which put VLLM_CPU_KVCACHE_SPACE=1 into every child)."""

from __future__ import annotations

import os

from seamlessflow.stack import ENGINE_ENV
from services.rollout import engine as engine_mod
from services.rollout.config import RolloutConfig
from services.rollout.engine import Engine
from tests.unit.test_rollout_engine import FakeLLM, write_ckpt


async def test_kv_cache_gib_reaches_vllm_even_when_the_environment_has_another_value(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # what the stack launcher used to force
    seen = {}

    def build(cfg):
        seen["kv"] = os.environ["VLLM_CPU_KVCACHE_SPACE"]
        return FakeLLM()

    monkeypatch.setattr(engine_mod, "_build_llm", build)
    e = Engine(RolloutConfig(model=str(write_ckpt(tmp_path / "m")), worker_id="w", kv_cache_gib=4))
    await e.start(warmup=False)
    assert seen["kv"] == "4"


def test_the_launcher_leaves_the_kv_cache_to_the_worker():
    assert "VLLM_CPU_KVCACHE_SPACE" not in ENGINE_ENV
