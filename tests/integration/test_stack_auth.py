"""`seamlessflow up` secures the NATS and Redis it starts: generated logins (credentials.json, 0600),
every service authenticates, an anonymous client is refused, and no secret appears in stack.json,
a process title or any log of a whole run (a simulated engine: the subject is not vLLM).

    .venv/bin/pytest tests/integration/test_stack_auth.py
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time

import httpx
import nats
import pytest
import redis

from seamlessflow.stack import client_env, servers
from tests.integration.stack_fixture import make_stack, one_turn

pytestmark = pytest.mark.integration


def test_servers_with_a_password_refuse_anonymous_clients_and_keep_it_off_the_command_line(tmp_path):
    pn, pr = servers.free_port(), servers.free_port()
    n = servers.start_nats(pn, tmp_path / "nats", user="sf", password="nats-secret-1")
    r = servers.start_redis(pr, tmp_path / "redis", password="redis-secret-2")
    try:
        async def nats_checks() -> None:
            with pytest.raises(Exception, match="Authorization Violation"):
                await nats.connect(f"nats://127.0.0.1:{pn}", connect_timeout=2, allow_reconnect=False,
                                   max_reconnect_attempts=0)
            nc = await nats.connect(f"nats://sf:nats-secret-1@127.0.0.1:{pn}", connect_timeout=2)
            await nc.close()

        asyncio.run(nats_checks())
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=pr).ping()
        assert redis.Redis.from_url(f"redis://:redis-secret-2@127.0.0.1:{pr}/0").ping()
        for proc in (n, r):
            assert b"secret" not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
        for conf in (tmp_path / "nats" / "auth.conf", tmp_path / "redis" / "auth.conf"):
            assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    finally:
        servers.stop(n)
        servers.stop(r)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = make_stack(tmp_path_factory.mktemp("auth-stack"), tiny_model, "", "", workers=1, simulated=True,
                   nats_port=servers.free_port(), redis_port=servers.free_port())
    yield s
    s.stop()


def test_a_whole_run_authenticates_and_shows_no_secret(stack):
    creds = json.loads((stack.data / "credentials.json").read_text())
    assert stat.S_IMODE((stack.data / "credentials.json").stat().st_mode) == 0o600
    secrets = [creds[k] for k in ("api_key", "admin_key", "nats_password", "redis_password")]

    # every service logged in: an agent turn goes through gateway, trajectory manager and worker
    secrets.append(one_turn(stack)["api_key"])

    # anonymous clients are refused; the CLI's way in (stack.json + credentials.json) is not
    port_n, port_r = stack.o.nats_port, stack.o.redis_port

    async def nats_checks() -> None:
        with pytest.raises(Exception, match="Authorization Violation"):
            await nats.connect(f"nats://127.0.0.1:{port_n}", connect_timeout=2, allow_reconnect=False,
                               max_reconnect_attempts=0)
        nc = await nats.connect(client_env(stack.data)["SF_NATS_URL"], connect_timeout=2)
        await nc.close()

    asyncio.run(nats_checks())
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port_r).ping()
    assert redis.Redis.from_url(client_env(stack.data)["SF_REDIS_URL"]).ping()

    # no secret in stack.json, in a process title, or in any log of the run
    public = (stack.data / "stack.json").read_text()
    texts = {"stack.json": public}
    for p in stack.procs:
        if p.popen.poll() is None:
            texts[f"cmdline of {p.name}"] = open(f"/proc/{p.popen.pid}/cmdline", "rb").read().decode(errors="replace")
    for log in [*stack.logs.rglob("*"), *(stack.data / "redis").glob("*.log"), *(stack.data / "nats").glob("*.log")]:
        if log.is_file():
            texts[str(log)] = log.read_text(errors="replace")
    assert len(texts) > 4, texts.keys()
    leaks = [(where, secret[:6] + "...") for where, text in texts.items() for secret in secrets if secret in text]
    assert not leaks, leaks
    assert json.loads(public)["nats_url"] == f"nats://127.0.0.1:{port_n}" and os.sep in json.loads(public)["weights_dir"]


def test_a_restarted_redis_and_nats_keep_their_logins(stack):
    """The fault suite restarts them with `Stack.respawn` (same argv): the login is in the config
    file the argv names, so it survives, and the services log in again."""
    for name in ("redis", "nats"):
        p = next(p for p in stack.procs if p.name == name)
        servers.stop(p.popen)
        p = stack.respawn(p)
        servers.wait_port(p.port, p.popen, name)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=stack.o.redis_port).ping()
    user = {"Authorization": f"Bearer {stack.api_key}"}
    for _ in range(60):  # the services reconnect by themselves (30 s at most)
        r = httpx.post(f"{stack.gateway_url}/sessions", headers=user, timeout=10)
        if r.status_code == 200:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text


def test_every_process_serves_its_metrics_on_a_port_of_its_own(stack):
    """stack.json's `metrics` names each process's /metrics; each answers with the malformed-message
    counter (so a default stack's bus errors are scrapeable) and shows no secret."""
    urls = json.loads((stack.data / "stack.json").read_text())["metrics"]
    expected = {p.name for p in stack.procs if p.name.startswith(("trajectory-", "rollout-", "trainer", "scheduler"))}
    assert expected and expected <= set(urls), (expected, urls)
    assert len(set(urls.values())) == len(urls)  # no two processes share a port
    creds = json.loads((stack.data / "credentials.json").read_text())
    for name in expected:
        r = httpx.get(urls[name], timeout=10)
        assert r.status_code == 200 and "sf_bus_malformed_total" in r.text, (name, r.status_code, r.text[:200])
        assert creds["nats_password"] not in r.text and creds["redis_password"] not in r.text
