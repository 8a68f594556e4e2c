"""Staleness admission end to end (real NATS JetStream and Redis; the SIMULATED engine in the real
rollout worker, since admission is the subject, not vLLM): with
max_staleness 0 and 2 sessions per version (declared in the trainer consumer's metadata), a
third session waits (HTTP 429 with Retry-After) while two are open; a finished but untrained
one still counts; once the trainer's durable consumer has taken it, sessions are admitted
again. Before the trainer's consumer exists, the backlog is unknown: 503, not admission."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from shared import bus, subjects
from shared.config import Connections
from tests.integration.stack_fixture import make_stack

pytestmark = [pytest.mark.integration]


def test_sessions_wait_while_the_staleness_bound_is_reached(tmp_path, tiny_model, redis_url):
    from seamlessflow.stack import servers

    nats_port = servers.free_port()
    nats = servers.start_nats(nats_port, tmp_path / "nats")
    nats_url = f"nats://127.0.0.1:{nats_port}"
    # its own Redis database: open sessions of other tests' stacks must not count here
    stack = make_stack(tmp_path, tiny_model, nats_url, redis_url.rsplit("/", 1)[0] + "/7", workers=1,
                       simulated=True,  # SIMULATED engine: admission is the subject, not vLLM
                       extra_env={"SF_TRAJECTORY_MAX_STALENESS": "0"})
    try:
        asyncio.run(scenario(stack, nats_url))
    finally:
        stack.stop()
        servers.stop(nats)


async def scenario(stack, nats_url: str) -> None:
    nc = await bus.connect(Connections(nats_url=nats_url), name="test-trainer")
    js = nc.jetstream()
    await bus.ensure_streams(js, subjects.STREAMS)
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    try:
        async with httpx.AsyncClient(base_url=stack.gateway_url, headers=headers, timeout=60) as http:
            # no trainer consumer yet: the backlog is unknown, so nothing is admitted (fail closed)
            unknown = await http.post("/sessions", json={})
            assert unknown.status_code == 503 and "backlog" in unknown.json()["error"]["message"], unknown.text
            # the trainer's consumer, as the trainer declares it: 2 sessions per version
            await js.add_consumer(subjects.TRAJECTORIES_STREAM, subjects.trainer_consumer(subjects.TRAINER_DURABLE, 2))
            trainer = await js.pull_subscribe(subjects.TRAJ_COMPLETED, durable=subjects.TRAINER_DURABLE,
                                              stream=subjects.TRAJECTORIES_STREAM)
            a = (await http.post("/sessions", json={})).json()
            b = (await http.post("/sessions", json={})).json()
            refused = await http.post("/sessions", json={})
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] and "staleness bound" in refused.json()["error"]["message"]

            # a finishes; its sample is not trained yet: still 1 open + 1 untrained
            client = openai.AsyncOpenAI(base_url=stack.gateway_url, api_key=a["api_key"], max_retries=0)
            await client.chat.completions.create(model="seamlessflow-tiny", max_tokens=4,
                                                 messages=[{"role": "user", "content": "hi"}])
            await client.close()
            assert (await http.post(f"/sessions/{a['id']}/finish", json={"reward": 1.0})).status_code == 200
            assert (await http.post("/sessions", json={})).status_code == 429

            # the trainer takes it: 1 open + 0 untrained, so one more session fits
            msgs = await trainer.fetch(1, timeout=10)
            assert len(msgs) == 1
            c = await http.post("/sessions", json={})
            assert c.status_code == 200, c.text
            assert (await http.post("/sessions", json={})).status_code == 429  # b and c are open
            assert b["id"] != c.json()["id"]
    finally:
        await bus.wait_closed(nc)
