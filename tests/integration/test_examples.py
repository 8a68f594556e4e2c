"""examples/*.py, each run as a user runs it (its own process, SF_BASE_URL and SF_API_KEY) against
one running stack; then the trajectories they left are checked through the sessions API."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest


pytestmark = [pytest.mark.integration, pytest.mark.vllm]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def stack(vllm_stack):
    return vllm_stack  # the session's shared stack (conftest.py)


def _run(stack, name: str) -> list[dict]:
    """Run one example; the sessions it names in its output, as the gateway returns them."""
    env = {**os.environ, "SF_BASE_URL": stack.gateway_url, "SF_API_KEY": stack.api_key}
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    ids = re.findall(r"session (\S+?)[: ]", done.stdout)
    assert ids, done.stdout
    user = {"Authorization": f"Bearer {stack.api_key}"}
    sessions = [httpx.get(f"{stack.gateway_url}/sessions/{i}", headers=user).json() for i in ids]
    for s in sessions:
        assert s["status"] == "finished" and s["reward"] in (0.0, 1.0), s
        assert s["samples"] and all(sum(x["loss_mask"]) > 0 for x in s["samples"])  # tokens the model sampled
    return sessions


def test_minimal_agent(stack):
    (s,) = _run(stack, "minimal_agent.py")
    assert len(s["turns"]) == 1 and s["group_id"] == "minimal"


def test_tool_agent(stack):
    (s,) = _run(stack, "tool_agent.py")
    assert s["turns"] and s["group_id"] == "calc"


def test_openai_agents_sdk(stack):
    (s,) = _run(stack, "openai_agents_sdk.py")
    assert s["turns"] and s["group_id"] == "agents-sdk"


def test_two_agents_share_one_reward_group(stack):
    solver, critic = _run(stack, "two_agents.py")
    assert solver["group_id"] == critic["group_id"] and solver["id"] != critic["id"]
    assert solver["metadata"] == {"role": "solver"} and critic["metadata"] == {"role": "critic"}
    assert solver["samples"][0]["token_ids"] != critic["samples"][0]["token_ids"]  # two token streams
