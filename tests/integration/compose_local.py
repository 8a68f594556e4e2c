"""Run a docker-compose file's services as local processes, without a Docker engine (tests only).

    with LocalCompose(FILE, variables, tmp, scale={"rollout": 2}) as c:
        port = c.published("gateway", 8000)     # where the gateway's published port 8000 went

What it keeps from the file, so that a wrong command, an unknown SF_* name or a missing
setting fails here as it would in a container:
- each service's `command`, run as written: `python` and `seamlessflow` are this venv's;
  images `nats:*` and `redis:*` are the venv's nats-server and the OS redis-server, given the
  service's own arguments (credentials, persistence);
- the environment: the Dockerfile's `ENV`, then the service's `environment` (YAML merge
  keys resolved as compose resolves them), with `${VAR}`, `${VAR:-default}` and
  `${VAR:?message}` filled from `variables`;
- `depends_on` order; a `service_completed_successfully` dependency runs to its end first;
- `--scale`: N processes of one service.

What it changes, and only this: service hostnames become 127.0.0.1; every port a service
listens on (its SF_*_PORT settings with their config defaults, NATS's 4222, Redis's 6379)
becomes a free local port, and `host:port` references are rewritten to match; bind
addresses 0.0.0.0 become 127.0.0.1; named volumes become directories under `tmp`
(container paths in arguments and values are rewritten).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from seamlessflow.stack import servers

VENV_BIN = Path(sys.executable).parent
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
# The settings through which our services listen, with their defaults (from the config classes).
_READY = {"services.gateway": "gateway ready", "services.trajectory": "trajectory manager ready",
          "services.rollout": "ready", "services.trainer": "trainer ready", "services.scheduler": "scheduler ready",
          "services.scheduler.host": "ready"}


class ComposeError(RuntimeError):
    pass


def interpolate(value: str, variables: dict[str, str]) -> str:
    """Compose's variable syntax: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}."""
    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        val = variables.get(name)
        unset = val is None or (op.startswith(":") and val == "")
        if op.endswith("?") and unset:
            raise ComposeError(f"required variable {name} is missing: {arg}")
        if op.endswith("-") and unset:
            return arg
        return val or ""
    return _VAR.sub(one, value)


def _walk(node, variables):
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, list):
        return [_walk(x, variables) for x in node]
    if isinstance(node, dict):
        return {k: _walk(v, variables) for k, v in node.items()}
    return node


def load(path: Path, variables: dict[str, str]) -> dict:
    """The file with merge keys resolved (PyYAML does what compose does) and variables filled."""
    return _walk(yaml.safe_load(path.read_text()), variables)


def dockerfile_env(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().replace("\\\n", " ").splitlines():
        if line.startswith("ENV "):
            env.update(kv.split("=", 1) for kv in line[4:].split())
    return env


def listen_settings(command: list[str]) -> dict[str, int]:
    """SF_* port settings of the service this command runs, with their defaults."""
    from services.gateway.config import GatewayConfig
    from services.trainer.config import TrainerConfig

    module = command[2] if command[:2] == ["python", "-m"] else ""
    if module == "services.gateway":
        return {"SF_GATEWAY_PORT": GatewayConfig().port, "SF_GATEWAY_ADMIN_PORT": GatewayConfig().admin_port}
    if module == "services.trainer":
        return {"SF_TRAINER_METRICS_PORT": TrainerConfig().metrics_port}
    return {}


def _order(services: dict) -> list[str]:
    done: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in done:
            return
        if name in path:
            raise ComposeError(f"depends_on cycle: {' -> '.join(path + (name,))}")
        for dep in _deps(services[name]):
            visit(dep, path + (name,))
        done.append(name)

    for name in services:
        visit(name, ())
    return done


def _deps(svc: dict) -> dict[str, str]:
    d = svc.get("depends_on") or {}
    return {k: "service_started" for k in d} if isinstance(d, list) else {k: (v or {}).get("condition", "service_started")
                                                                          for k, v in d.items()}


class LocalCompose:
    def __init__(self, file: Path, variables: dict[str, str], tmp: Path, scale: dict[str, int] | None = None,
                 base_env: dict[str, str] | None = None, ready_timeout: float = 420.0) -> None:
        self.file, self.tmp, self.scale = file, tmp, scale or {}
        self.spec = load(file, variables)
        self.services: dict = self.spec["services"]
        self.image_env = dockerfile_env(file.parent / "Dockerfile")
        self.base_env = {"PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "HOME": os.environ.get("HOME", "/root"),
                         **(base_env or {})}
        self.ready_timeout = ready_timeout
        self.ports: dict[tuple[str, int], int] = {}  # (service, container port) -> local port
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._plan_ports()

    # 1. where things go ------------------------------------------------------------------------

    def _plan_ports(self) -> None:
        for name, svc in self.services.items():
            image = svc.get("image", "")
            listen = ([4222] if image.startswith("nats:") else [6379] if image.startswith("redis:") else
                      [int(self._env(name).get(k, d)) for k, d in listen_settings(svc.get("command", [])).items()])
            for p in listen:
                self.ports[(name, p)] = servers.free_port()
            for spec in svc.get("ports", []):
                container = int(str(spec).rsplit(":", 1)[-1].split("/")[0])
                if (name, container) not in self.ports:
                    raise ComposeError(f"{name} publishes port {container}, but listens on "
                                       f"{sorted(p for s, p in self.ports if s == name) or 'no port'}")

    def published(self, service: str, container_port: int) -> int:
        return self.ports[(service, container_port)]

    def _volumes(self, name: str) -> dict[str, Path]:
        out = {}
        for v in self.services[name].get("volumes", []):
            src, dst = str(v).split(":")[:2]
            out[dst] = self.tmp / "volumes" / src
            out[dst].mkdir(parents=True, exist_ok=True)
        return out

    def _rewrite(self, name: str, value: str) -> str:
        for dst, local in self._volumes(name).items():
            value = re.sub(rf"(?<![\w/]){re.escape(dst)}(?=/|\b|$)", str(local), value)
        for (svc, port), local in self.ports.items():
            value = re.sub(rf"(?<=[/@]){re.escape(svc)}:{port}\b", f"127.0.0.1:{local}", value)
        return "127.0.0.1" if value == "0.0.0.0" else value

    def _env(self, name: str) -> dict[str, str]:
        env = self.services[name].get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        return {k: "" if v is None else str(v) for k, v in env.items()}

    def env_of(self, name: str) -> dict[str, str]:
        env = {**self.base_env, **self.image_env, **{k: self._rewrite(name, v) for k, v in self._env(name).items()}}
        for key, default in listen_settings(self.services[name].get("command", [])).items():
            env[key] = str(self.ports[(name, int(env.get(key, default)))])
        return env

    def argv_of(self, name: str) -> list[str]:
        svc = self.services[name]
        args = [self._rewrite(name, str(a)) for a in svc.get("command", [])]
        image = svc.get("image", "")
        if image.startswith("nats:"):
            return [servers.find_binary("nats-server"), *args, "-a", "127.0.0.1", "-p", str(self.ports[(name, 4222)])]
        if image.startswith("redis:"):
            return [servers.find_binary("redis-server"), *args[1:], "--bind", "127.0.0.1", "--port",
                    str(self.ports[(name, 6379)]), "--save", ""]
        if args[:1] == ["python"]:
            args[0] = sys.executable
        return args

    # 2. running --------------------------------------------------------------------------------

    def __enter__(self) -> "LocalCompose":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        started: list[tuple[str, subprocess.Popen, Path]] = []
        for name in _order(self.services):
            svc = self.services[name]
            run_to_end = any(c == "service_completed_successfully" and d == name
                             for s in self.services.values() for d, c in _deps(s).items())
            for i in range(self.scale.get(name, 1)):
                log = self.logs / f"{name}-{i}.log"
                proc = subprocess.Popen(self.argv_of(name), env=self.env_of(name), stdout=open(log, "ab"),
                                        stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tmp)
                self.procs.append((name, proc, log))
                if run_to_end:
                    if proc.wait(self.ready_timeout) != 0:
                        raise ComposeError(f"{name} exited with {proc.returncode}:\n{_tail(log)}")
                elif svc.get("image", "").split(":")[0] in ("nats", "redis"):
                    port = 4222 if svc["image"].startswith("nats") else 6379
                    servers.wait_port(self.ports[(name, port)], proc, name)
                else:
                    started.append((name, proc, log))
        for name, proc, log in started:
            self._wait_ready(name, proc, log)

    def _wait_ready(self, name: str, proc: subprocess.Popen, log: Path) -> None:
        cmd = self.services[name].get("command", [])
        marker = _READY.get(cmd[2] if cmd[:2] == ["python", "-m"] else "", "")
        deadline = time.monotonic() + self.ready_timeout
        while marker and time.monotonic() < deadline:
            if marker in log.read_text(errors="replace"):
                return
            if proc.poll() is not None:
                raise ComposeError(f"{name} exited with {proc.returncode}:\n{_tail(log)}")
            time.sleep(0.2)
        if marker:
            raise ComposeError(f"{name} not ready in {self.ready_timeout:.0f}s:\n{_tail(log)}")

    def down(self) -> None:
        for _, proc, _ in reversed(self.procs):
            servers.stop(proc, timeout=15)
        self.procs.clear()


def _tail(log: Path, n: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
