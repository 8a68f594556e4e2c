"""`seamlessflow export`: finished trajectories from the TRAJECTORIES stream as JSONL.

One line per sample (a root-to-leaf path of a session): session and group ids, reward,
token ids, loss mask, behaviour logprobs, per-token policy versions and the messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

import msgspec
from nats.js.errors import NotFoundError

from shared import bus
from shared.codec import decode
from shared.config import Connections
from shared.messages import TrajectoryCompleted


def rows(event: TrajectoryCompleted) -> list[dict]:
    out = []
    for i, s in enumerate(event.samples):
        row = {"session_id": event.session_id, "group_id": event.group_id, "sample": i, "reward": event.reward}
        row.update(msgspec.structs.asdict(s))
        row["metadata"] = event.metadata
        out.append(row)
    return out


async def export(conn: Connections, out: TextIO, timeout: float = 5.0) -> int:
    nc = await bus.connect(conn, name="sf-export")
    try:
        js = nc.jetstream()
        try:
            info = await js.stream_info("TRAJECTORIES")
        except NotFoundError:
            return 0
        n = 0
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                raw = await js.get_msg("TRAJECTORIES", seq)
            except NotFoundError:  # deleted or aged out
                continue
            for row in rows(decode(raw.data, TrajectoryCompleted)):
                out.write(json.dumps(row) + "\n")
                n += 1
        return n
    finally:
        await bus.wait_closed(nc, timeout)


async def export_file(conn: Connections, path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        n = await export(conn, f)
    tmp.replace(path)
    return n
