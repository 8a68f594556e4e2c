"""deploy/compose/docker-compose.yml, proven without a Docker engine.

Every service's command runs as a local process with that service's environment (the
Dockerfile's ENV, then the file's, credentials included), `rollout` and `trajectory` scaled
to 2; hostnames map to 127.0.0.1 and ports to free ones (compose_local.py says exactly what
changes). NATS and Redis run the file's own arguments, so they require the credentials the
services are given. Then one agent turn goes through the port the gateway publishes.
A wrong command, an unknown SF_* name or a missing setting fails here.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.compose_local import ComposeError, LocalCompose, load

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.deepspeed]

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "deploy" / "compose" / "docker-compose.yml"
CACHES = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "DS_ACCELERATOR")


def _variables() -> dict[str, str]:
    return {"SF_API_KEY": "sk-" + secrets.token_hex(8), "SF_ADMIN_KEY": "sk-admin-" + secrets.token_hex(8),
            "SF_NATS_PASSWORD": secrets.token_hex(8), "SF_REDIS_PASSWORD": secrets.token_hex(8)}


@pytest.fixture(scope="module")
def compose(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("compose")
    variables = _variables()
    # The model service's command runs for real (`test -f ... || seamlessflow init-model`); the
    # volume is seeded with the suite's tiny model so vLLM's compile cache is shared with the
    # other tests. test_model_service_builds_a_model runs the build itself.
    shutil.copytree(tiny_model, tmp / "volumes" / "model", dirs_exist_ok=True)
    base = {k: os.environ[k] for k in CACHES if k in os.environ}
    with LocalCompose(FILE, variables, tmp, scale={"rollout": 2, "trajectory": 2}, base_env=base) as c:
        yield c, variables


def test_one_agent_turn_through_the_published_gateway_port(compose):
    c, v = compose
    port = c.published("gateway", 8000)
    agent = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=v["SF_API_KEY"], max_retries=0, timeout=120)
    reply = agent.chat.completions.create(model="seamlessflow-tiny", max_tokens=8,
                                          messages=[{"role": "user", "content": "reverse 123"}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0


def test_scaled_services_all_run(compose):
    c, v = compose
    assert sorted(n for n, p, _ in c.procs if p.poll() is None and n in ("rollout", "trajectory")) == \
        ["rollout", "rollout", "trajectory", "trajectory"]
    admin = f"http://127.0.0.1:{c.published('gateway', 8001)}"
    workers = httpx.get(f"{admin}/admin/workers", headers={"authorization": f"Bearer {v['SF_ADMIN_KEY']}"}).json()
    assert len(workers["workers"]) == 2, workers


def test_infrastructure_requires_the_credentials(compose):
    import redis

    c, v = compose
    port = c.published("redis", 6379)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    assert redis.Redis(port=port, password=v["SF_REDIS_PASSWORD"]).ping()


def test_missing_secret_is_named():
    variables = _variables()
    del variables["SF_NATS_PASSWORD"]
    with pytest.raises(ComposeError, match="SF_NATS_PASSWORD"):
        load(FILE, variables)


def test_model_service_builds_a_model(tmp_path):
    """The `model` service's own command on an empty volume: it builds the checkpoint."""
    c = LocalCompose(FILE, _variables(), tmp_path)
    import subprocess

    proc = subprocess.run(c.argv_of("model"), env=c.env_of("model"), cwd=tmp_path, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "volumes" / "model" / "config.json").exists()
