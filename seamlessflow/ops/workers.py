"""Operator commands over NATS: list and steer rollout workers, publish and list weight versions,
the trajectory stream's fill and the trainer's lag (part of `seamlessflow status`).

    seamlessflow workers list
    seamlessflow workers vacate rollout-0      # abort in-flight work (it resumes elsewhere), take no more
    seamlessflow workers resume rollout-0
    seamlessflow weights publish DIR           # prints the new version
    seamlessflow weights list
    seamlessflow weights gc [--keep 2]         # delete versions no live worker serves

Connections come from SF_NATS_URL (and SF_NATS_* credentials); the weight store from
SF_WEIGHTS_DIR (default var/weights).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec

from shared import backpressure, bus, subjects, weightstore
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages import RolloutControl, WeightsPublished, WorkerStatus


async def worker_statuses(conn: Connections, listen: float = 1.5) -> list[WorkerStatus]:
    """Every worker that sent a heartbeat within `listen` seconds, latest status each."""
    nc = await bus.connect(conn, name="sf-ops")
    seen: dict[str, WorkerStatus] = {}

    async def on(msg):
        try:
            s = decode(msg.data, WorkerStatus)
        except msgspec.DecodeError:  # undecodable, or another type (ValidationError is a DecodeError)
            return
        seen[s.worker_id] = s

    try:
        await nc.subscribe(subjects.ROLLOUT_STATUS, cb=on)
        await asyncio.sleep(listen)
    finally:
        await bus.wait_closed(nc)
    return sorted(seen.values(), key=lambda s: s.worker_id)


async def control(conn: Connections, worker_id: str, op: str, timeout: float = 30.0) -> WorkerStatus:
    nc = await bus.connect(conn, name="sf-ops")
    try:
        data = await bus.request(nc, subjects.rollout_ctl(worker_id), encode(RolloutControl(op=op)), timeout)
    except bus.BusUnavailable:
        raise SystemExit(f"error: no rollout worker {worker_id!r} is listening") from None
    finally:
        await bus.wait_closed(nc)
    return decode(data, WorkerStatus)


async def publish(conn: Connections, store: Path, src: Path) -> WeightsPublished:
    nc = await bus.connect(conn, name="sf-ops")
    try:
        return await weightstore.publish_dir(nc.jetstream(), store, src)
    finally:
        await bus.wait_closed(nc)


async def collect_garbage(conn: Connections, store: Path, keep: int) -> tuple[list[int], set[int]]:
    """Delete the versions no live worker serves, keeping the newest `keep` and the current one."""
    statuses = await worker_statuses(conn)
    current = await current_version(conn)
    in_use = {s.version for s in statuses} | ({current.version} if current else set())
    removed = await asyncio.to_thread(weightstore.collect_garbage, store, in_use, keep)
    return removed, in_use


async def current_version(conn: Connections) -> WeightsPublished | None:
    nc = await bus.connect(conn, name="sf-ops")
    try:
        await bus.ensure_streams(nc.jetstream(), subjects.STREAMS)
        return await weightstore.current(nc.jetstream())
    finally:
        await bus.wait_closed(nc)


def format_workers(statuses: list[WorkerStatus]) -> str:
    rows = [f"{'WORKER':<20} {'STATE':<9} {'VERSION':>7} {'RUNNING':>7} {'CAP':>4} {'TOKENS':>9} {'AGE':>5}"]
    now = time.time()
    for s in statuses:
        rows.append(f"{s.worker_id:<20} {s.state:<9} {s.version:>7} {s.running:>7} {s.capacity:>4} "
                    f"{s.generated_tokens:>9} {now - s.ts:>4.1f}s")
    return "\n".join(rows) if statuses else "no rollout workers are sending heartbeats"


def format_weights(store: Path, current: WeightsPublished | None, statuses: list[WorkerStatus]) -> str:
    serving: dict[int, list[str]] = {}
    for s in statuses:
        serving.setdefault(s.version, []).append(s.worker_id)
    versions = sorted(set(weightstore.versions_on_disk(store)) | set(serving))
    rows = [f"{'VERSION':>7}  {'CURRENT':<7}  {'WORKERS':<30} PATH"]
    for v in versions:
        path = weightstore.version_dir(store, v) if v > 0 else "(the model the workers started with)"
        mark = "*" if current and current.version == v else ""
        rows.append(f"{v:>7}  {mark:<7}  {','.join(serving.get(v, [])) or '-':<30} {path}")
    return "\n".join(rows)


async def stream_status(conn: Connections, consumer: str = subjects.TRAINER_DURABLE, timeout: float = 3.0) -> dict:
    """The TRAJECTORIES stream's fill against its high-water mark and the trainer consumer's lag, as JSON;
    {"error": ...} when NATS cannot say (status must answer while NATS is down)."""
    try:
        nc = await asyncio.wait_for(bus.connect(conn, name="sf-ops", connect_timeout=timeout), timeout)
    except Exception as e:
        return {"error": f"NATS: {e}"}
    try:
        fill = await asyncio.wait_for(backpressure.read_fill(
            nc.jetstream(), subjects.TRAJECTORIES_STREAM, consumer, time.monotonic()), timeout)
    except Exception as e:
        return {"error": f"{subjects.TRAJECTORIES_STREAM}: {type(e).__name__}: {e}"}
    finally:
        await bus.wait_closed(nc, timeout)
    mark = backpressure.limits_from_env().high_water
    return {"fill": round(fill.fraction, 4), "high_water": mark, "above_high_water": fill.above(mark),
            "bytes": fill.bytes, "max_bytes": fill.max_bytes, "messages": fill.msgs, "max_messages": fill.max_msgs,
            "trainer_lag": fill.lag, "trainer_pending": fill.pending, "trainer_ack_pending": fill.ack_pending}


def format_stream(st: dict) -> str:
    if "error" in st:
        return f"trajectories: unknown ({st['error']})"
    state = "ABOVE the high-water mark: new sessions get 429" if st["above_high_water"] else "below the high-water mark"
    lag = (f"trainer lag {st['trainer_lag']} ({st['trainer_pending']} undelivered, {st['trainer_ack_pending']} "
           "awaiting a checkpoint)" if st["trainer_lag"] >= 0 else "no trainer consumer")
    return (f"trajectories: {st['fill']:.0%} full ({st['messages']} msgs, {st['bytes'] / 2**20:.1f} of "
            f"{st['max_bytes'] / 2**20:.1f} MiB), {state} ({st['high_water']:.0%}); {lag}")
