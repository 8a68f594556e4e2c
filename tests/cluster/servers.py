"""NATS and Redis on a cluster host, bound to its address (never 0.0.0.0: other hosts reach it over the bridge)."""

from __future__ import annotations

import socket
import subprocess
import time

from tests.cluster.netns import Host

NATS_PORT, REDIS_PORT = 4222, 6379


def wait_port(addr: str, port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((addr, port), 1.0).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server for {addr}:{port} exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{addr}:{port} not listening after {timeout:g}s") from None
            time.sleep(0.1)


def start_nats(host: Host, port: int = NATS_PORT) -> str:
    store = host.root / "var" / "nats"
    store.mkdir(parents=True, exist_ok=True)
    p = host.popen(["nats-server", "-a", host.addr, "-p", str(port), "-js", "-sd", str(store)], log="nats.log")
    wait_port(host.addr, port, proc=p)
    return f"nats://{host.addr}:{port}"


def start_redis(host: Host, port: int = REDIS_PORT) -> str:
    data = host.root / "var" / "redis"
    data.mkdir(parents=True, exist_ok=True)
    p = host.popen(["redis-server", "--bind", host.addr, "--port", str(port), "--save", "", "--appendonly", "no",
                    "--dir", str(data), "--protected-mode", "no"], log="redis.log")
    wait_port(host.addr, port, proc=p)
    return f"redis://{host.addr}:{port}/0"
