"""The fault suite's stack: the real services, each a process; only the engines are SIMULATED.

Real: nats-server (JetStream file store) and redis-server (AOF on), owned by this stack so
that a case may kill and restart them; the gateway; two trajectory replicas; the tag scheduler
(policy disaggregated) and two rollout hosts, each a host agent keeping a resident worker (and
restarting it when it dies); the DeepSpeed trainer (gloo on CPU) on the suite's tiny model,
checkpointing and publishing real weights. SIMULATED, because vLLM is not what these cases test
(and a worker starts in a second instead of minutes): each resident worker is the real
RolloutService around services/rollout/simulated.py's calibrated stand-in (SF_HOST_WORKER_CMD),
which follows each published version as a version bump.

`seamlessflow/stack/processes.py` does the launching (spawn, respawn, tiered stop, process groups);
this module only chooses the commands and adds the fault helpers: kill, restart, pause, and
the `Fault` window each injection records for the invariant checker (invariants.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from seamlessflow.stack import Proc, Stack, StackOptions, servers
from shared.config import connections


# One GRPO "group" per session and one group per step: every finished session is trained
# without waiting for its group mates (a session a fault ended early would leave its group
# incomplete until the 900 s group timeout). A version every 2 steps; a checkpoint every 2; what
# a killed trainer held comes back after ack_wait (6 s here, 60 s by default).
TRAINER = {"group_size": 1, "groups_per_step": 1, "publish_every": 2, "checkpoint_every": 2, "ack_wait": 6,
           "keep_versions": 2, "fetch_timeout": 0.5, "metrics_port": 0, "tensorboard_dir": ""}
# A slow simulated engine (20 ms per step, ~1 token per 20 ms): a turn generates for a while,
# so a fault lands mid-generation, and the workers leave the CPU to the control plane.
ENGINE = ["--capacity", "16", "--step-ms", "20", "--per-seq-ms", "0.5", "--follow-weights"]


@dataclass
class Fault:
    """One injected fault: from its injection (t0) to the moment the system was whole again
    (t1: the process restarted and ready). Wall-clock seconds, as the agents' calls record."""

    name: str
    t0: float
    t1: float = float("inf")
    unreachable: bool = False  # the gateway itself was down: a refused connection is the answer


class FaultStack:
    HOSTS = ("host-0", "host-1")

    def __init__(self, tmp: Path, model: Path, trainer: dict | None = None):
        """`trainer`: settings over TRAINER's (the LoRA case: lora_rank)."""
        env = {f"SF_TRAINER_{k.upper()}": str(v) for k, v in (TRAINER | (trainer or {})).items()}
        env |= {"SF_TRAINER_AUDIT_LOG": str(tmp / "trainer" / "trained.jsonl"), "SF_LOG_LEVEL": "INFO"}
        engine = " ".join([sys.executable, "-m", "services.rollout.simulated", *ENGINE])
        self.opts = StackOptions(
            model=model, data_dir=tmp, trajectory_replicas=2, gateway_port=servers.free_port(),
            admin_port=servers.free_port(), nats_port=servers.free_port(), redis_port=servers.free_port(),
            max_model_len=512, ready_timeout=420, extra_env=env, policy="disaggregated",
            hosts=["rollout"] * len(self.HOSTS), worker_cmd=engine)
        self.stack = Stack(self.opts)
        self.model = model
        self.faults: list[Fault] = []
        self.conn = None  # shared.config.Connections, for cases that talk to NATS themselves

    # -- the stack -------------------------------------------------------------------------------

    def start(self) -> "FaultStack":
        """Spawn everything at once (NATS and Redis first), then wait until each is ready."""
        self.stack.start(wait=False)
        try:
            self.spawn_trainer()
            for p in list(self.stack.procs):
                self.stack.wait_ready(p)
        except BaseException:
            self.stop()
            raise
        self.conn = connections({"SF_NATS_URL": self.stack.nats_url, "SF_REDIS_URL": self.stack.redis_url})
        return self

    def stop(self) -> None:
        """Everything at once (no state worth a drain is left), then whatever is left of each group."""
        procs = list(self.stack.procs)
        for p in procs:  # a paused process would sit out its SIGTERM
            _signal(p, signal.SIGCONT)
        self.stack.terminate([p for p in procs if p.name not in ("nats", "redis")], timeout=5)
        self.stack.stop(timeout=5)

    def spawn_trainer(self) -> Proc:
        """The real DeepSpeed trainer (gloo on CPU), ungated: no host is tagged train here."""
        return self.stack.spawn_trainer()

    @property
    def gateway_url(self) -> str:
        return self.stack.gateway_url

    @property
    def api_key(self) -> str:
        return self.stack.api_key

    @property
    def audit_log(self) -> Path:
        return self.stack.data / "trainer" / "trained.jsonl"

    def log(self, name: str) -> str:
        return (self.stack.logs / f"{name}.log").read_text(errors="replace")

    def proc(self, name: str) -> Proc:
        return next(p for p in self.stack.procs if p.name == name)

    def child_pid(self, name: str) -> int:
        """The pid of a service's child process (a host agent's resident worker)."""
        parent = self.proc(name).popen.pid
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and int((d / "stat").read_text().rpartition(")")[2].split()[1]) == parent:
                    return int(d.name)
            except (OSError, ValueError, IndexError):
                continue
        raise AssertionError(f"{name} (pid {parent}) has no child process")

    # -- faults ----------------------------------------------------------------------------------

    def begin(self, name: str, unreachable: bool = False) -> Fault:
        fault = Fault(name, time.time(), unreachable=unreachable)
        self.faults.append(fault)
        return fault

    def kill(self, name: str, sig: int = signal.SIGKILL) -> Proc:
        """Send `sig` to a service's process group and wait for it to exit (10 s)."""
        p = self.proc(name)
        _signal(p, sig)
        p.popen.wait(10)
        return p

    def restart(self, p: Proc) -> Proc:
        """Start an exited service again with the same command and environment, and wait until
        it is ready (its ready line, or its port for NATS and Redis)."""
        new = self.stack.respawn(p)
        if new.port:
            servers.wait_port(new.port, new.popen, new.name)
        else:
            self.stack.wait_ready(new)
        return new

    def kill_and_restart(self, name: str, sig: int = signal.SIGKILL, down_s: float = 0.0,
                         unreachable: bool = False, wait: bool = True) -> Fault:
        """Kill, then start again. Without `wait` the restart runs on a thread while the agents go
        on (what the rest of the stack does meanwhile is the point); `fault.t1` is set once it is
        ready, and `whole` waits for that."""
        fault = self.begin(f"{signal.Signals(sig).name} {name}", unreachable)
        p = self.kill(name, sig)

        def restart() -> None:
            time.sleep(down_s)
            self.restart(p)
            fault.t1 = time.time()

        if wait:
            restart()
        else:
            threading.Thread(target=restart, daemon=True, name=f"restart-{name}").start()
        return fault

    @staticmethod
    def whole(fault: Fault, timeout: float = 90.0) -> None:
        """Wait until what the fault took down is ready again."""
        wait_for(lambda: fault.t1 != float("inf"), timeout, f"the end of {fault.name}", every=0.2)

    def pause(self, name: str, seconds: float) -> Fault:
        """SIGSTOP a service for `seconds`, then SIGCONT: alive, but silent meanwhile."""
        fault = self.begin(f"SIGSTOP {name} {seconds:g}s")
        p = self.proc(name)
        _signal(p, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            _signal(p, signal.SIGCONT)
        fault.t1 = time.time()
        return fault

    # -- what NATS and the trainer hold ------------------------------------------------------------

    def stream_state(self) -> dict:
        """The JetStream streams, the TRAJECTORIES stream's last sequence, and its trainer consumer."""
        import asyncio

        import nats

        from shared import subjects

        async def read() -> dict:
            nc = await nats.connect(self.stack.nats_url, connect_timeout=5, max_reconnect_attempts=20)
            try:
                js = nc.jetstream()
                streams = await js.streams_info()
                info = await js.stream_info(subjects.TRAJECTORIES_STREAM)
                consumer = await js.consumer_info(subjects.TRAJECTORIES_STREAM, subjects.TRAINER_DURABLE)
                return {"streams": len(streams), "last_seq": info.state.last_seq, "consumer": consumer.name,
                        "ack_floor": consumer.ack_floor.stream_seq}
            finally:
                await nc.close()

        return asyncio.run(read())


    def audit(self) -> list[dict]:
        from services.trainer.audit import read

        return read(self.audit_log) if self.audit_log.exists() else []


def wait_for(cond: Callable[[], object], timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _signal(p: Proc, sig: int) -> None:
    try:
        os.killpg(p.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
