"""What the namespace-cluster test modules share: the data plane on a host, the NATS watcher, the
audit log's reading, and one bounded wait for everything a cluster starts at once.

A module starts every process of its cluster without waiting on any (the trainer, the vLLM
workers, the trajectory manager and the gateway import and start side by side), then
`until_ready` polls all their readiness checks under one deadline, failing early, with the
process's log, where a process exits before it is ready.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from seamlessflow.stack.processes import ENGINE_ENV
from services.trainer import audit
from shared import subjects
from shared.codec import decode
from shared.messages.rollout import WorkerStatus
from shared.messages.scheduler import HostHeartbeat, HostModeChanged, TrainerStatus
from tests.cluster.netns import Host

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
SERVED = "seamlessflow-tiny"
MAX_MODEL_LEN = 512
GATEWAY_PORT, ADMIN_PORT = 8000, 8001
API_KEY = "sk-cluster-" + uuid.uuid4().hex


def service_env(h: Host, urls: dict[str, str]) -> dict[str, str]:
    return urls | ENGINE_ENV | {"PYTHONPATH": str(ROOT), "VLLM_CACHE_ROOT": str(h.root / "var" / "cache" / "vllm"),
                                "TORCHINDUCTOR_CACHE_DIR": str(h.root / "var" / "cache" / "inductor")}


def wait_log(h: Host, log: str, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while line not in h.log(log):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{h.name} {log}: no {line!r} within {timeout:g}s:\n{h.log(log)[-3000:]}")
        time.sleep(0.2)


def listening(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), 0.5).close()
        return True
    except OSError:
        return False


@dataclass
class Started:
    """A process started on a host, with its log: what `until_ready` watches for an early exit."""

    host: Host
    proc: subprocess.Popen
    log: str


@dataclass
class DataPlane:
    """The trajectory manager and the gateway on one host, started, not yet waited for."""

    host: Host
    procs: list[Started]

    @property
    def url(self) -> str:
        """The gateway's OpenAI base URL."""
        return f"http://{self.host.addr}:{GATEWAY_PORT}/v1"

    def checks(self) -> dict[str, Callable[[], bool]]:
        """Ready once both say so and the gateway listens (it answers 503 until a trajectory manager serves)."""
        h = self.host
        return {"trajectory manager ready": lambda: "trajectory manager ready" in h.log("trajectory.log"),
                "gateway ready": lambda: "gateway ready" in h.log("gateway.log") and listening(h.addr, GATEWAY_PORT)}


def start_data_plane(h0: Host, urls: dict[str, str], model: Path) -> DataPlane:
    """The trajectory manager and the gateway on `h0`; returns at once (wait with `until_ready`)."""
    env = service_env(h0, urls)
    traj = h0.popen([PY, "-m", "services.trajectory", "--model", str(model)],
                    env=env | {"SF_TRAJECTORY_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}, log="trajectory.log", cwd=ROOT)
    gw = h0.popen([PY, "-m", "services.gateway"], env=env | {
        "SF_GATEWAY_HOST": h0.addr, "SF_GATEWAY_PORT": str(GATEWAY_PORT), "SF_GATEWAY_ADMIN_PORT": str(ADMIN_PORT),
        "SF_GATEWAY_MODEL": SERVED, "SF_GATEWAY_API_KEYS": API_KEY, "SF_GATEWAY_ADMIN_KEY": "sk-admin-" + API_KEY,
        "SF_GATEWAY_MAX_CONTEXT": str(MAX_MODEL_LEN)}, log="gateway.log", cwd=ROOT)
    return DataPlane(h0, [Started(h0, traj, "trajectory.log"), Started(h0, gw, "gateway.log")])


async def until_ready(checks: dict[str, Callable[[], bool]], procs: list[Started], timeout: float) -> dict[str, float]:
    """Poll every check until all hold, under one deadline; returns the seconds each took. Fails at
    once, with its log, where a process in `procs` exits first, and at the deadline naming what
    is not ready."""
    t0, done = time.monotonic(), {}
    while len(done) < len(checks):
        for name, check in checks.items():
            if name not in done and check():
                done[name] = time.monotonic() - t0
        if dead := [s for s in procs if s.proc.poll() is not None]:
            s = dead[0]
            pytest.fail(f"{s.host.name} {s.log}: exited with {s.proc.returncode} before the cluster was ready:\n"
                        f"{s.host.log(s.log)[-3000:]}")
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"not ready within {timeout:g}s: {sorted(set(checks) - set(done))} (ready: {done})")
        await asyncio.sleep(0.2)
    return done


class Watch:
    """What the cluster says on NATS: the trainer's status, workers' and hosts' heartbeats, mode changes."""

    def __init__(self):
        self.trainer: TrainerStatus | None = None
        self.offloaded: set[tuple[str, ...]] = set()  # every TrainerStatus.offloaded seen
        self.changed: list[HostModeChanged] = []
        self.workers: dict[str, list[tuple[float, WorkerStatus]]] = collections.defaultdict(list)  # (seen at, beat)
        self.hosts: dict[str, HostHeartbeat] = {}

    async def attach(self, nc) -> None:
        async def on_status(m):
            self.trainer = decode(m.data, TrainerStatus)
            self.offloaded.add(tuple(self.trainer.offloaded))

        async def on_changed(m):
            self.changed.append(decode(m.data, HostModeChanged))

        async def on_worker(m):
            st = decode(m.data, WorkerStatus)
            self.workers[st.worker_id].append((time.monotonic(), st))

        async def on_host(m):
            hb = decode(m.data, HostHeartbeat)
            self.hosts[hb.host] = hb

        await nc.subscribe(subjects.TRAINER_STATUS, cb=on_status)
        await nc.subscribe(subjects.SCHED_CHANGED, cb=on_changed)
        await nc.subscribe(subjects.ROLLOUT_STATUS, cb=on_worker)
        await nc.subscribe(subjects.SCHED_HOST, cb=on_host)

    def worker(self, wid: str) -> WorkerStatus | None:
        beats = self.workers.get(wid)
        return beats[-1][1] if beats else None

    def switches(self, host: str) -> list[HostModeChanged]:
        return [x for x in self.changed if x.host == host]

    def applied(self, host: str, mode: str, after: int = 0) -> HostModeChanged | None:
        """The first switch of `host` into `mode` with an epoch above `after`, once reported (it must be ok)."""
        done = next((x for x in self.switches(host) if x.mode == mode and x.epoch > after), None)
        if done is not None:
            assert done.ok, done.error
        return done

    def serving(self, wid: str, version: int) -> bool:
        st = self.worker(wid)
        return st is not None and st.state == "serving" and st.version == version

    async def until(self, what: str, check, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (got := check()) is not None and got is not False:
                return got
            await asyncio.sleep(0.2)
        last = {w: self.worker(w) for w in self.workers}
        pytest.fail(f"{what}: not within {timeout:g}s (trainer status {self.trainer}, changes {self.changed[-4:]}, "
                    f"workers {last})")


def trained_ids(audit_log: Path) -> list[str]:
    """Every session id the trainer's audit log says a step trained, repeats kept."""
    return [i for r in audit.read(audit_log) if r["event"] == "step" for i in r["ids"]] if audit_log.exists() else []


def trained_steps(audit_log: Path) -> int:
    return sum(r["event"] == "step" for r in audit.read(audit_log)) if audit_log.exists() else 0


def dump_logs(hosts: list[Host]) -> None:
    for h in hosts:
        for log in sorted((h.root / "logs").glob("*.log")):
            print(f"--- {h.name} {log.name}\n{log.read_text(errors='replace')[-3000:]}")
