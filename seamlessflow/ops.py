"""Operator commands over NATS: list and steer rollout workers, publish and list weight versions.

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

from shared import bus, subjects, weightstore
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
        except msgspec.ValidationError:
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
