"""`seamlessflow dead`: the dead letters, copies of stored bus messages a service could not read
(the DEAD stream, shared/deadletter.py).

    seamlessflow dead list [--limit 20] [--json]    # newest first: time, service, subject, error, size
    seamlessflow dead purge                         # delete them all

Connections come from SF_NATS_URL (and SF_NATS_* credentials), else the stack `seamlessflow up`
runs from --data-dir. Every step is bounded by --timeout: NATS down is an error, not a hang.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from shared import bus, deadletter
from shared.config import Connections
from shared.deadletter import DeadLetter


async def _with_js(conn: Connections, timeout: float, fn):
    nc = await asyncio.wait_for(bus.connect(conn, name="sf-dead", connect_timeout=timeout), timeout)
    try:
        return await fn(nc.jetstream())
    finally:
        await bus.wait_closed(nc, timeout)


async def list_dead(conn: Connections, limit: int = 20, timeout: float = 5.0) -> list[DeadLetter]:
    return await _with_js(conn, timeout, lambda js: deadletter.recent(js, limit, timeout))


async def purge_dead(conn: Connections, timeout: float = 5.0) -> int:
    return await _with_js(conn, timeout, lambda js: deadletter.purge(js, timeout))


def to_json(letters: list[DeadLetter]) -> str:
    return msgspec.json.encode(letters).decode()


def format_letters(letters: list[DeadLetter], width: int = 80) -> str:
    if not letters:
        return "no dead letters"
    rows = [f"{'TIME':<19} {'SERVICE':<10} {'SUBJECT':<24} {'SIZE':>7}  ERROR"]
    for d in letters:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.time)) if d.time else "?"
        error = d.error if len(d.error) <= width else d.error[:width - 3] + "..."
        rows.append(f"{at:<19} {d.service:<10} {d.subject:<24} {d.size:>7}  {error}")
    return "\n".join(rows)
