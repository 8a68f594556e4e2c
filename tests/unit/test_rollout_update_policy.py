"""The worker's update policies (services/rollout/service.py: _update), against a stand-in
engine: the service code stays real; only the engine (vLLM) edge is faked."""

from __future__ import annotations

import asyncio

from services.rollout.config import RolloutConfig
from services.rollout.service import RolloutService
from shared.config import Connections
from shared.messages.weights import WeightsPublished


class RecordingEngine:
    """Records when loads happen relative to the requests in flight."""

    def __init__(self):
        self.version, self.dead, self.vacated, self.updating = 0, "", False, False
        self.events: list[str] = []

    async def load_weights(self, path, version):
        self.events.append(f"load v{version}")
        self.version = version


def service(policy: str) -> RolloutService:
    cfg = RolloutConfig(model="m", worker_id="w", update_policy=policy, drain_timeout=5.0)
    svc = RolloutService(cfg, Connections(), engine=RecordingEngine())

    async def no_status():
        pass

    svc._publish_status = no_status  # no NATS in a unit test
    return svc


async def until(cond, turns: int = 1000) -> None:
    """Give the event loop turns until `cond()` holds (bounded; no wall-clock sleeps)."""
    for _ in range(turns):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def test_drain_holds_new_requests_and_loads_after_in_flight_ones_finish():
    svc = service("drain")
    engine = svc.engine
    finish = asyncio.Event()

    async def in_flight():
        await finish.wait()
        engine.events.append("in-flight done")

    svc.tasks["r1"] = asyncio.create_task(in_flight())
    update = asyncio.create_task(svc._update(WeightsPublished(version=3, path="/x", published_at=0.0)))
    await until(lambda: not svc._admit.is_set())  # a new request would wait here
    for _ in range(20):
        await asyncio.sleep(0)
    assert not update.done() and engine.events == []  # the load waits for the request in flight
    finish.set()
    await asyncio.wait_for(update, 5)
    assert engine.events == ["in-flight done", "load v3"]
    assert svc._admit.is_set() and engine.version == 3


async def test_immediate_loads_without_waiting_for_in_flight_requests():
    svc = service("immediate")
    engine = svc.engine
    never = asyncio.Event()
    svc.tasks["r1"] = asyncio.create_task(never.wait())
    await asyncio.wait_for(svc._update(WeightsPublished(version=4, path="/x", published_at=0.0)), 5)
    assert engine.events == ["load v4"] and not svc.tasks["r1"].done()
    svc.tasks["r1"].cancel()
