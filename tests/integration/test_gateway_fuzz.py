"""Schema fuzzing: schemathesis (`st run --checks all`, as a new user would run it) against the
gateway's own /openapi.json, on the agent port and on the admin port.

The gateway is real (uvicorn, nats-py, redis-py); only the trajectory manager is faked, at the
NATS edge (test_gateway_api.FakeTrajectory). Every check must pass and no answer may be a 5xx.
The document names the served model and what the gateway serves (openapi.served_subset), so
schema-valid cases reach the (fake) trajectory manager; `positive_data_acceptance` holds them to
it, and `negative_data_rejection` holds every refusal the schema states to the gateway. The rules
JSON Schema cannot state are hooks, each with its reason (fuzz_hooks.UNSTATABLE).

Bounded: five fixed seeds, 20 examples per operation and phase: ~1,850 cases a seed on the agent
port (~10 s on 2 cores), ~270 on the admin port (~3 s).

    .venv/bin/pytest tests/integration/test_gateway_fuzz.py -s        # -s prints each run's count
    SF_FUZZ_SEEDS=21,22 .venv/bin/pytest tests/integration/test_gateway_fuzz.py   # other seeds
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import pytest

from shared.config import Connections
from tests.integration.test_gateway_api import ADMIN_KEY, USER_KEY, FakeTrajectory, run_gateway

pytestmark = pytest.mark.integration

ST = Path(sys.executable).with_name("st")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 20  # per operation and phase: enough to find today's bugs, bounded in time
RUN_TIMEOUT = 120  # seconds for one `st run`; it takes ~10 s on 2 cores
# several seeds: each draws ~1,850 cases, and a rule one seed's cases never touch another's do
SEEDS = [int(s) for s in os.environ.get("SF_FUZZ_SEEDS", "1,2,3,4,5").split(",")]
# `just test-fast` runs the first seed; `just test` runs them all (~14 s a seed, both ports)
SEED_PARAMS = [pytest.param(s, marks=[pytest.mark.slow] if i else []) for i, s in enumerate(SEEDS)]
_CASES = re.compile(r"^\s*(\d+ generated, .*)$", re.MULTILINE)


@pytest.fixture(scope="module")
async def gw(private_nats, redis_url):
    fake = await FakeTrajectory(private_nats).start()
    try:
        async with run_gateway(Connections(nats_url=private_nats, redis_url=redis_url), first_token_timeout=5,
                               idle_timeout=5, silence_timeout=1.0, resend_attempts=1) as running:
            yield running
    finally:
        await fake.stop()


async def st_run(base: str, key: str, tmp: Path, seed: int) -> tuple[int, str]:
    """`st run` against `base`/openapi.json; (exit code, its output)."""
    proc = await asyncio.create_subprocess_exec(
        str(ST), "run", f"{base}/openapi.json", "--checks", "all", "--header", f"Authorization: Bearer {key}",
        "--max-examples", str(EXAMPLES), "--seed", str(seed), "--generation-database", "none", "--no-color",
        "--workers", "1", "--request-timeout", "20", "--report-dir", str(tmp),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp,
        env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.integration.fuzz_hooks", "PYTHONPATH": str(ROOT)})
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    text = out.decode(errors="replace")
    cases = _CASES.search(text)
    print(f"seed {seed} {base}: {cases.group(1) if cases else 'no count'}")  # shown with -s
    return proc.returncode, text


@pytest.mark.parametrize("seed", SEED_PARAMS)
async def test_agent_api_passes_every_schemathesis_check(gw, tmp_path, seed):
    code, out = await st_run(gw.agent, USER_KEY, tmp_path, seed)
    assert code == 0, out  # a 5xx fails the not_a_server_error check, so the run too


@pytest.mark.parametrize("seed", SEED_PARAMS)
async def test_admin_api_passes_every_schemathesis_check(gw, tmp_path, seed):
    code, out = await st_run(gw.admin, ADMIN_KEY, tmp_path, seed)
    assert code == 0, out


async def test_a_wrong_method_is_405_with_allow(gw):
    """What `st run` found first: RFC 9110 requires `Allow` on a 405."""
    async with gw.http() as http:
        r = await http.request("TRACE", "/v1/sessions")
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
        assert r.json()["error"]["code"] == "method_not_allowed"
        r = await http.delete("/v1/models")
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}
