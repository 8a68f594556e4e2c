"""The demo's telemetry: waiting for rollout workers to serve (with --policy the host agents
start them after the stack is up, and the rounds must not begin before)."""

import asyncio
import types

import pytest

from seamlessflow.demo.telemetry import Telemetry
from shared.codec import encode
from shared.config import Connections
from shared.messages import WorkerStatus


def heartbeat(tel: Telemetry, worker: str, state: str) -> None:
    msg = types.SimpleNamespace(data=encode(WorkerStatus(worker, state, 0, 0, 8, "m", 2048, 1e9)))
    asyncio.get_running_loop().create_task(tel._on_status(msg))


async def test_wait_serving_returns_once_enough_workers_serve():
    tel = Telemetry(Connections())
    heartbeat(tel, "host-0-rollout", "paused")
    heartbeat(tel, "host-1-rollout", "serving")

    async def later():
        await asyncio.sleep(0.05)
        heartbeat(tel, "host-0-rollout", "serving")

    asyncio.get_running_loop().create_task(later())
    assert await tel.wait_serving(2, timeout=2.0, every=0.01) == {"host-0-rollout", "host-1-rollout"}


async def test_wait_serving_times_out_saying_how_many_serve():
    tel = Telemetry(Connections())
    heartbeat(tel, "host-0-rollout", "serving")
    heartbeat(tel, "host-1-rollout", "updating")
    with pytest.raises(TimeoutError, match="1 of 2 rollout workers serving"):
        await tel.wait_serving(2, timeout=0.05, every=0.01)


async def test_a_worker_that_stops_serving_no_longer_counts():
    tel = Telemetry(Connections())
    heartbeat(tel, "w", "serving")
    await asyncio.sleep(0)
    assert tel.serving() == {"w"}
    heartbeat(tel, "w", "sleeping")
    await asyncio.sleep(0)
    assert tel.serving() == set()
