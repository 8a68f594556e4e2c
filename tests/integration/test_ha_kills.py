"""Issue 30: the stack on servers without a single point of failure, with those servers killed under
load. A 3-server NATS JetStream cluster (every stream at 3 replicas) and a Redis primary + replica +
3 sentinels, given to the stack as external servers (`up --nats-url URLS --redis-url URL`): the
gateway, a trajectory manager, one rollout worker (the SIMULATED engine inside the real worker:
vLLM is not the subject here) and the real DeepSpeed trainer. 16 openai-SDK agents (8 GRPO groups
of 2, trying retryable answers again up to RETRIES times) run while, in turn,

1. the TRAJECTORIES stream's leader is SIGKILLed, and started again once another leads;
2. a second server is SIGKILLed once the first has caught up, and started again;
3. the Redis primary is SIGKILLed: Sentinel promotes the replica, and the old primary comes back
   as a replica of the new one.

Then: 0 failed agent requests (retryable answers tried again are counted, not failed), every session
an agent finished is trained exactly once (the trainer's audit log), and the trainer's consumer has
nothing left pending.
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from seamlessflow.demo.workload import GroupAgents, Load
from seamlessflow.stack import servers
from seamlessflow.stack.processes import Stack, StackOptions
from services.trainer import audit
from shared import bus, subjects
from shared.config import Connections
from tests.integration.stack_fixture import simulated_worker_cmd
from tests.integration.test_nats_cluster import all_current

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed, pytest.mark.slow]

AGENTS = 16
# retryable answers (503 with Retry-After, each under 5 s: docs/reliability.md) an agent tries again: a
# leader election or a Sentinel failover takes a few seconds, and a finish waits for its publication
RETRIES = 10
# one group a step: a last lone group would otherwise wait for a partner that never comes
TRAINER = {"group_size": 2, "groups_per_step": 1, "checkpoint_every": 2, "lr": 1e-5, "ack_wait": 10}


async def until(what: str, check, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if got := await check():
                return got
        except Exception:  # a server is down or a leader is moving: look again
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:g}s")


def trained_ids(stack: Stack) -> list[str]:
    path = stack.data / "trainer" / "trained.jsonl"
    return [i for r in audit.read(path) if r["event"] == "step" for i in r["ids"]] if path.exists() else []


@pytest.fixture
def ha_stack(tmp_path, tiny_model):
    nats = servers.NatsCluster(tmp_path / "nats", 3, log_dir=tmp_path).start()
    redis = servers.RedisSentinels(tmp_path / "redis").start()
    stack = None
    try:
        stack = Stack(StackOptions(
            model=tiny_model, data_dir=tmp_path / "stack", gateway_port=servers.free_port(),
            admin_port=servers.free_port(), external_nats=nats.url, external_redis=redis.url,
            worker_cmd=simulated_worker_cmd(step_ms=20.0), train=True, trainer_settings=TRAINER,
            extra_env={"SF_JETSTREAM_REPLICAS": "3"}, ready_timeout=300))
        stack.start()
        yield stack, nats, redis
    finally:
        if stack is not None:
            stack.stop()
        nats.stop()
        redis.stop()


async def stream_leader(js) -> str:
    info = await js.stream_info(subjects.TRAJECTORIES_STREAM)
    return info.cluster.leader if info.cluster and info.cluster.leader else ""


def test_nats_leader_then_another_server_then_the_redis_primary_killed_under_load(ha_stack):
    stack, nats, redis = ha_stack
    agents = GroupAgents(stack.gateway_url, stack.api_key, Load(group_size=2, lanes=AGENTS // 2, seed=3,
                                                                min_tokens=8, max_tokens=32, retries=RETRIES))
    done = asyncio.Event()
    log: list[str] = []

    async def scenario():
        nc = await bus.connect(Connections(nats_url=nats.url), name="ha-kills-test")
        js = nc.jetstream()
        run = asyncio.create_task(agents.run(done.is_set, 400))
        t0 = time.monotonic()

        def note(what: str) -> None:
            log.append(f"{time.monotonic() - t0:5.1f}s {agents.ok:4d} turns: {what}")

        async def more_turns(n: int, what: str, seconds: float = 5.0) -> None:
            """At least `n` more turns and `seconds` more of load (the servers' changes take effect meanwhile)."""
            at, since = agents.ok, time.monotonic()
            await until(what, lambda: asyncio.sleep(0, result=run.done() or (
                agents.ok >= at + n and time.monotonic() - since >= seconds)), 90)
            assert not run.done(), f"the agents stopped: {run.exception()!r}"

        try:
            await more_turns(20, "traffic")
            # 1. the stream's leader
            first = await until("a TRAJECTORIES leader", lambda: stream_leader(js), 30)
            nats.kill(int(first[1:]))  # names are n0, n1, n2
            note(f"killed NATS {first}, the TRAJECTORIES leader")
            new = await until("another leader", lambda: _other_leader(js, first), 30)
            note(f"{new} leads")
            await more_turns(20, "turns after the leader's loss")
            nats.start(int(first[1:]))
            await until(f"{first} caught up", lambda: all_current(js), 90)
            note(f"{first} back and current")
            # 2. another server
            second = next(i for i in range(3) if f"n{i}" != first)
            nats.kill(second)
            note(f"killed NATS n{second}")
            await more_turns(20, "turns after the second server's loss")
            nats.start(second)
            await until(f"n{second} caught up", lambda: all_current(js), 90)
            note(f"n{second} back and current")
            # 3. the Redis primary
            old = redis.primary()
            redis.kill(old[1])
            note(f"killed the Redis primary :{old[1]}")
            await until("a new primary", lambda: asyncio.sleep(0, result=redis.primary() != old), 30)
            note(f"Redis primary now :{redis.primary()[1]}")
            await more_turns(20, "turns after the failover")
            redis.restart(old[1])
            await more_turns(20, "turns with the old primary back as a replica")
            note("done")
        finally:
            done.set()
            await asyncio.wait_for(run, 300)
            print("\n".join(log))
            print(f"{AGENTS} agents: {agents.ok} turns, {len(agents.sessions)} sessions, {agents.retried} session "
                  f"calls retried, {len(agents.failures)} failed: {agents.failures[:5]}")
        # a failed session leaves its GRPO group incomplete, and the other member is never trained
        assert agents.failures == [], agents.failures[:5]
        # every finished session trained exactly once, and nothing left on the trainer's consumer
        try:
            await until("every finished session trained",
                        lambda: asyncio.sleep(0, result=set(trained_ids(stack)) >= set(agents.sessions)), 120)
        except AssertionError:
            missing = sorted(set(agents.sessions) - set(trained_ids(stack)))
            raise AssertionError(f"{len(missing)} of {len(agents.sessions)} finished sessions not trained: "
                                 f"{missing[:6]}") from None
        info = await until("the trainer's consumer", lambda: js.consumer_info(subjects.TRAJECTORIES_STREAM,
                                                                               "trainer"), 30)
        await nc.close()
        return info

    info = asyncio.run(scenario())
    print(f"trainer consumer: {info.num_pending} pending, {info.num_ack_pending} unacknowledged")
    assert agents.sessions and agents.ok == 2 * len(agents.sessions)
    counts = collections.Counter(trained_ids(stack))
    assert [s for s, k in counts.items() if k != 1] == []
    assert info.num_pending == 0


async def _other_leader(js, old: str) -> str:
    leader = await stream_leader(js)
    return leader if leader and leader != old else ""
