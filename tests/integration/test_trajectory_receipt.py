"""Issue 30: a Generate that core NATS drops reaches no worker, and the worker's heartbeats go on; the
worker's receipt (shared/messages/rollout.py) lets the trajectory manager re-dispatch it within seconds
instead of the 120 s first-token timeout (docs/reliability.md).

Real NATS; the real rollout worker around the SIMULATED engine (services/rollout/simulated.py, which
sends the receipt through the same service code), as its `run()` coroutine in this process; the real
trajectory manager's transport (`TrajectoryService._call`, its worker table fed by the worker's real
heartbeats) under the real generation loop (services/trajectory/generation.py). The stand-in for the
loss: a worker that receives one Generate and discards it, as a subscription that moves between
cluster members drops what is in flight. Redis, the renderer and the gateway are not the subject.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from services.rollout.config import RolloutConfig
from services.rollout.service import RolloutService
from services.rollout.simulated import SimulatedEngine
from services.trajectory.config import TrajectoryConfig
from services.trajectory.generation import Job, generate
from services.trajectory.service import TrajectoryService
from services.trajectory.tokenpath import TokenPath
from shared import bus, subjects
from shared.config import Connections
from shared.messages import Sampling
from shared import timeouts

pytestmark = pytest.mark.integration

WORKER = "w-receipt"
RECEIPT_S = 1.0


class DropsOne(RolloutService):
    """Receives the first `drop` Generates and discards them (no reply at all); serves the rest."""

    def __init__(self, *a, drop: int = 1, **kw):
        super().__init__(*a, **kw)
        self.drop, self.dropped = drop, []

    async def _on_generate(self, msg) -> None:
        if len(self.dropped) < self.drop:
            self.dropped.append(time.monotonic())
            return
        await super()._on_generate(msg)


async def until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        await asyncio.sleep(0.05)


async def turn(traj: TrajectoryService, rid: str, max_tokens: int = 8):
    async def pick(exclude):
        return WORKER

    async def on_tokens(delta, worker, first, final):
        return None

    return await generate(traj._call, pick, Job(rid, "s", TokenPath.of([69, 70]), Sampling(max_tokens=max_tokens)),
                          on_tokens, traj.cfg.max_redispatch)


@pytest.mark.parametrize("drop", [1, 2])
async def test_a_dropped_generate_is_re_dispatched_after_the_receipt_timeout(nats_url, drop):
    conn = Connections(nats_url=nats_url)
    quit = asyncio.Event()
    worker = DropsOne(RolloutConfig(model="m", worker_id=WORKER, follow_weights=False), conn,
                      SimulatedEngine(capacity=4, step_ms=1.0), drop=drop)
    running = asyncio.create_task(worker.run(quit))
    # a 1 s receipt timeout (the default is 5 s: timeouts.WORKER_RECEIPT), so that the two cases cost
    # `just test-fast` 3 s rather than 15; the first-token timeout stays the default 120 s
    traj = TrajectoryService(TrajectoryConfig(receipt_timeout=RECEIPT_S), conn)
    traj.nc = await bus.connect(conn, name="traj-receipt")
    try:
        await traj.nc.subscribe(subjects.ROLLOUT_STATUS, cb=traj._on_status)
        await until(lambda: traj.table.sends_receipts(WORKER), 30, "heartbeat saying the worker sends receipts")
        t0 = time.monotonic()
        out = await asyncio.wait_for(turn(traj, f"r{drop}"), 60)
        took = time.monotonic() - t0
        assert len(worker.dropped) == drop and out.dispatches == drop + 1
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
        # each lost Generate cost the receipt timeout (plus the re-dispatch's back-off from the second on),
        # not the first-token timeout
        receipt = traj.cfg.receipt_timeout
        assert receipt < traj.cfg.first_token_timeout == timeouts.WORKER_FIRST_REPLY
        assert drop * receipt <= took < drop * receipt + 2.0, took
        print(f"\n{drop} dropped Generate(s): the turn finished in {took:.2f} s (receipt timeout {receipt:g} s)")
        # a receipt followed by the first token: served at once, one dispatch
        t0 = time.monotonic()
        assert (await asyncio.wait_for(turn(traj, f"ok{drop}"), 30)).dispatches == 1
        assert time.monotonic() - t0 < 1.0
    finally:
        quit.set()
        await asyncio.wait_for(running, 30)
        await bus.wait_closed(traj.nc)
