"""The control channel of a running `seamlessflow up`: a Unix socket, DATA_DIR/control.sock
(mode 0600: only its user can steer the stack). One JSON request per connection; the reply
is JSON lines: zero or more `{"progress": "..."}`, then the answer with `"ok"`.

    {"op": "status"}                                   -> {"ok": true, "services": [...], "workers": [...], ...}
    {"op": "scale", "counts": {"rollout": 3, "trajectory": 2}}
                                                       -> {"progress": ...}* {"ok": true} | {"ok": false, "error": ...}

A Unix socket, not NATS: status and scale must still answer while NATS itself is down or
restarting. This module knows the wire format and how to print a status; keeper.py
decides what the answers say.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

SOCKET = "control.sock"
MAX_PATH = 100  # AF_UNIX paths are limited to 107 bytes

Progress = Callable[[str], Awaitable[None]]
Handler = Callable[[dict, Progress], Awaitable[dict]]


class NotRunning(RuntimeError):
    pass


def socket_path(data_dir: Path) -> Path:
    return data_dir.resolve() / SOCKET


async def serve(path: Path, handle: Handler) -> asyncio.Server:
    """Answer requests on `path` with `handle(request, progress)` (a stale socket is replaced)."""
    if len(str(path)) > MAX_PATH:
        raise OSError(f"control socket path {path} is longer than {MAX_PATH} bytes; use a shorter --data-dir")
    path.unlink(missing_ok=True)

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def progress(msg: str) -> None:
            writer.write(json.dumps({"progress": msg}).encode() + b"\n")
            await writer.drain()

        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            try:
                request = json.loads(line)
                reply = await handle(request, progress) if isinstance(request, dict) else None
            except ValueError:
                reply = None
            reply = reply or {"ok": False, "error": "bad request: send one JSON object with an op"}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(on_client, path=str(path))
    os.chmod(path, 0o600)
    return server


def ask(data_dir: Path, request: dict, timeout: float = 10.0,
        on_progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Send one request to the `up` running in `data_dir`; `timeout` bounds each wait for a line."""
    path = socket_path(data_dir)
    if not path.exists():
        raise NotRunning(f"no `seamlessflow up` is running with data dir {data_dir.resolve()} (no {path})")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            raise NotRunning(f"no `seamlessflow up` answers on {path} (a stale socket?)") from None
        s.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        with s.makefile("rb") as f:
            for raw in f:
                buf = raw
                msg = json.loads(raw)
                if "progress" in msg:
                    on_progress(msg["progress"])
                    continue
                return msg
    raise NotRunning(f"`seamlessflow up` closed the control socket without an answer ({buf[:200]!r})")


def format_status(st: dict) -> str:
    rows = [f"stack: {st['data_dir']} (up pid {st['pid']}{', policy ' + st['policy'] if st.get('policy') else ''})",
            f"gateway: {st['gateway_url']}   admin: {st['admin_url']}",
            ""]
    rows.append(f"{'SERVICE':<16} {'PID':>7} {'STATE':<10} {'UPTIME':>8} {'RESTARTS':>8}  NOTE")
    for s in st["services"]:
        note = s["reason"] or (f"last exit {s['last_exit']}" if s["last_exit"] is not None else "")
        rows.append(f"{s['name']:<16} {s['pid'] or '-':>7} {s['state']:<10} {_duration(s['uptime']):>8} "
                    f"{s['restarts']:>8}  {note}")
    rows.append("")
    if st["workers"]:
        rows.append(f"{'WORKER':<16} {'STATE':<9} {'VERSION':>7} {'LOAD':>7} {'HOST':<8} {'AGE':>5}")
        for w in st["workers"]:
            rows.append(f"{w['worker_id']:<16} {w['state']:<9} {w['version']:>7} "
                        f"{w['running']:>3}/{w['capacity']:<3} {w['host'] or '-':<8} {w['age']:>4.1f}s")
    else:
        rows.append("no rollout worker heartbeats (yet)")
    if st.get("scaling"):
        rows.append(f"\nscaling: {st['scaling']}")
    return "\n".join(rows)


def _duration(seconds: float) -> str:
    if not seconds:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def now_stamp() -> str:
    return time.strftime("%H:%M:%S")
