"""The host agent: one per host, under the scheduler's control.

    SF_HOST_ID=host-0 SF_HOST_TAGS=train,rollout,cpu SF_HOST_MODEL=var/model SF_HOST_TRAINER=true \\
        python -m services.scheduler.host

What it does:
- keeps the host's rollout worker **resident** (`python -m services.rollout`, started
  vacated, and asleep on a `train` host, where the trainer's ranks hold the device until a
  lend; a benchmark may run another command line, `SF_HOST_WORKER_CMD`): switching
  modes is vacate/sleep and wake/load/resume, never a restart, since a vLLM engine
  takes many seconds to start. A worker that exits is restarted with a doubling back-off
  (0.5 s up to `restart_backoff_max`); the restart is logged and counted in the heartbeat,
  and the scheduler then assigns the host afresh;
- applies each `HostAssignment` newer than the last one it applied, as the ordered steps
  of `policy.transition_steps` (a lend loads the current version before it resumes; a
  reclaim vacates before the trainer rank reloads), and answers `HostModeChanged` with the
  time the switch took;
- on a `train` host (`SF_HOST_TRAINER`), asks the trainer to offload or reload around lends
  (sf.trainer.ctl, `TrainerControl.host` = this host: the trainer acts on the ranks on this
  host only; a trainer that is not running is skipped);
- sends `HostHeartbeat` every `heartbeat` seconds.

The host's last assignment is the last value of its subject on the HOSTS stream, so a
restarted agent applies it again.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import shlex
import signal
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
from nats.aio.msg import Msg

from services.scheduler import leader
from services.scheduler.config import HostConfig, load_host, parse_cpu_list
from services.scheduler.policy import Step, transition_steps
from shared import bus, subjects
from shared.codec import decode, encode
from shared.config import Connections, connections
from shared.deadletter import Malformed
from shared.lifecycle import run_until_signalled, setup_logging
from shared.messages.rollout import RolloutControl, WorkerStatus
from shared.messages.scheduler import (
    HostAssignment,
    HostHeartbeat,
    HostMode,
    HostModeChanged,
    SchedulerLeader,
    TrainerControl,
)

log = logging.getLogger("sf.host")

RESTART_BACKOFF = 0.5  # seconds before the first restart of a crashed worker
HEALTHY_RUN = 60.0  # a worker that ran this long resets the back-off
STOP_WAIT = 20.0  # seconds a stopping worker gets before SIGKILL


class SwitchFailed(RuntimeError):
    pass


class HostAgent:
    def __init__(self, cfg: HostConfig, conn: Connections, worker_argv: list[str] | None = None):
        self.cfg, self.conn = cfg, conn
        self.tags = cfg.tag_list()
        if worker_argv is None and cfg.worker_cmd and cfg.model:  # benchmarks: a simulated engine, say
            worker_argv = [*shlex.split(cfg.worker_cmd), "--model", cfg.model, "--worker-id", cfg.worker_id]
        self.has_worker = "rollout" in self.tags and bool(cfg.model or worker_argv)
        self.worker_argv = worker_argv or [sys.executable, "-m", "services.rollout", "--model", cfg.model,
                                           "--worker-id", cfg.worker_id]
        self.mode: HostMode = "idle"
        self.epoch = 0
        self.term = 0  # the newest scheduler term seen (leader.py): older terms' assignments are ignored
        self.switching = False
        self.restarts = 0
        self.worker: WorkerStatus | None = None  # its latest heartbeat
        self.worker_started = 0.0  # wall clock of the current worker process's start
        self.proc: asyncio.subprocess.Process | None = None
        self._assignments: list[HostAssignment] = []
        self._wake = asyncio.Event()
        self.malformed = Malformed("host")

    async def run(self, quit: asyncio.Event) -> None:
        async with AsyncExitStack() as stack:
            # 1. connect, learn the worker's heartbeats and the host's assignments
            self.nc = await bus.connect(self.conn, name=f"host-{self.cfg.id}")
            stack.push_async_callback(bus.wait_closed, self.nc)
            js = self.nc.jetstream()
            streams = subjects.STREAMS
            await bus.ensure_streams(js, streams)
            self.malformed.enter(stack, self.nc, streams, self.cfg.metrics_port, self.cfg.metrics_host)
            await self.nc.subscribe(subjects.ROLLOUT_STATUS, cb=self._on_worker)
            await self.nc.subscribe(subjects.sched_assign(self.cfg.id), cb=self._on_assignment)
            await self.nc.subscribe(subjects.SCHED_LEADER, cb=self._on_leader)
            subject = subjects.sched_assign(self.cfg.id)
            last = await bus.last_value(js, subjects.HOSTS_STREAM, subject)
            if last is not None:  # a restarted agent keeps its last assignment (one it can read)
                self._on_assignment_data(Msg(self.nc, subject=subject, data=last))

            # 2. the resident worker, the heartbeat and the assignments, until told to stop
            tasks = [asyncio.create_task(self._heartbeat_loop(quit)), asyncio.create_task(self._apply_loop(quit))]
            if self.has_worker:
                tasks.append(asyncio.create_task(self._supervise(quit)))
            log.info("host agent %s ready: tags %s, capacity %g, worker %s%s", self.cfg.id, ",".join(self.tags),
                     self.cfg.capacity, self.cfg.worker_id if self.has_worker else "none",
                     ", trainer rank here" if self.cfg.trainer else "")
            await quit.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._stop_worker()

    # -- heartbeats ------------------------------------------------------------------------------

    def heartbeat(self) -> HostHeartbeat:
        return HostHeartbeat(self.cfg.id, self.tags, self.cfg.capacity, self.mode, self.epoch, time.time(),
                             self.cfg.worker_id if self.has_worker else "", self.cfg.cores or self.cfg.cpus,
                             self.switching,
                             self.restarts, ready=not self.has_worker or self._worker_is_up())

    def _worker_is_up(self) -> bool:
        return self.worker is not None and self.worker.ts >= self.worker_started > 0

    async def _heartbeat_loop(self, quit: asyncio.Event) -> None:
        while not quit.is_set():
            await self._publish(subjects.SCHED_HOST, self.heartbeat())
            await asyncio.sleep(self.cfg.heartbeat)

    async def _publish(self, subject: str, msg: msgspec.Struct) -> None:
        try:
            await self.nc.publish(subject, encode(msg))
        except Exception as e:  # reconnecting: the next beat goes out
            log.warning("publish to %s failed: %s", subject, e)

    async def _on_worker(self, msg: Msg) -> None:
        st = self.malformed.decode(msg, WorkerStatus, subjects.ROLLOUT_STATUS)
        if st is None:
            return
        if st.worker_id == self.cfg.worker_id:
            self.worker = st

    # -- assignments -----------------------------------------------------------------------------

    async def _on_leader(self, msg: Msg) -> None:
        ev = self.malformed.decode(msg, SchedulerLeader, subjects.SCHED_LEADER)
        if ev is not None and ev.term > self.term:
            log.info("scheduler term %d leads (%s)", ev.term, ev.instance)
            self.term = ev.term

    async def _on_assignment(self, msg: Msg) -> None:
        self._on_assignment_data(msg)

    def _on_assignment_data(self, msg: Msg) -> None:
        # one it cannot read was stored by the HOSTS stream, so it is dead-lettered; the last good one holds
        a = self.malformed.decode(msg, HostAssignment, subjects.sched_assign("*"))
        if a is not None:
            self._offer(a)

    def _offer(self, a: HostAssignment) -> None:
        if a.host == self.cfg.id:
            self._assignments.append(a)
            self._wake.set()

    async def _apply_loop(self, quit: asyncio.Event) -> None:
        while not quit.is_set():
            await self._wake.wait()
            self._wake.clear()
            if not self._assignments:
                continue
            a = max(self._assignments, key=lambda x: x.epoch)  # only the newest matters
            self._assignments.clear()
            if leader.term_of(a.epoch) < self.term:  # a deposed leader's late assignment (leader.py)
                log.warning("ignoring assignment epoch %d (%s): term %d, but term %d leads", a.epoch, a.mode,
                            leader.term_of(a.epoch), self.term)
                continue
            if a.epoch <= self.epoch:
                log.info("ignoring assignment epoch %d (%s): epoch %d already applied", a.epoch, a.mode, self.epoch)
                continue
            await self._apply(a)

    async def _apply(self, a: HostAssignment) -> None:
        t0 = time.time()
        self.switching = True
        ok, error, migrated = True, "", 0
        took: dict[str, float] = {}  # per step, for the log: what a switch's time goes to
        steps = transition_steps(a.mode, a.hold, self.has_worker, self.cfg.trainer, self.mode)
        try:
            if self.has_worker:
                await self._worker_up()
            for step in steps:
                ts = time.time()
                migrated += await self._step(step, a)
                took[step] = time.time() - ts
        except (SwitchFailed, bus.ReplyTimeout, bus.BusUnavailable) as e:
            ok, error = False, f"{type(e).__name__}: {e}"
        finally:
            self.switching = False
        if ok:
            self.mode = a.mode
        self.epoch = a.epoch
        self.term = max(self.term, leader.term_of(a.epoch))
        t1 = time.time()
        log.info("epoch %d: %s -> %s in %.0f ms via %s (ms)%s", a.epoch, "ok" if ok else "FAILED", a.mode,
                 (t1 - t0) * 1000, "/".join(f"{s} {took[s] * 1000:.0f}" if s in took else s for s in steps) or "nothing",
                 f" ({error})" if error else "")
        await self._publish(subjects.SCHED_CHANGED, HostModeChanged(self.cfg.id, a.mode, a.epoch, t0, t1, ok, error,
                                                                    migrated))

    async def _step(self, step: Step, a: HostAssignment) -> int:
        """Run one step; returns how many requests it migrated."""
        match step:
            case "offload_trainer" | "reload_trainer":
                await self._trainer("offload" if step == "offload_trainer" else "reload")
            case "wake":
                await self._control(RolloutControl(op="wake"))
            case "load":
                # no path: the version travels over the network, and the worker's load asks the trainer
                # for a round of its own (sf.weights.fetch); a lent host never serves an old version either way
                if a.version > (self.worker.version if self.worker else -1):
                    st = await self._control(RolloutControl(op="load", version=a.version, path=a.path))
                    if st.version < a.version:
                        raise SwitchFailed(f"worker still serves version {st.version} after loading {a.version}")
            case "resume":
                st = await self._control(RolloutControl(op="resume", lent_until=a.lent_until))
                if st.state == "paused":  # dead, stopping, or woken without weights it could not get back
                    raise SwitchFailed(f"worker {self.cfg.worker_id} is paused after resume, not serving (see its log)")
            case "vacate":
                running = self.worker.running if self.worker else 0
                await self._control(RolloutControl(op="vacate", scheduled=True))
                return running
            case "hold":
                await self._control(RolloutControl(op="sleep", keep=True))
            case "sleep":
                await self._control(RolloutControl(op="sleep"))
        return 0

    async def _control(self, ctl: RolloutControl) -> WorkerStatus:
        data = await bus.request(self.nc, subjects.rollout_ctl(self.cfg.worker_id), encode(ctl),
                                 self.cfg.step_timeout)
        st = decode(data, WorkerStatus)
        self.worker = st
        return st

    async def _trainer(self, op: str) -> None:
        try:
            await bus.request(self.nc, subjects.TRAINER_CTL, encode(TrainerControl(op=op, host=self.cfg.id)),
                              self.cfg.step_timeout)
        except bus.BusUnavailable:
            log.debug("no trainer serves %s; %s skipped", subjects.TRAINER_CTL, op)

    # -- the resident worker ---------------------------------------------------------------------

    async def _worker_up(self) -> None:
        """Wait until the current worker process has sent a heartbeat (bounded)."""
        deadline = time.monotonic() + self.cfg.worker_ready_timeout
        while not self._worker_is_up():
            if time.monotonic() > deadline:
                raise SwitchFailed(f"worker {self.cfg.worker_id} not up after {self.cfg.worker_ready_timeout:.0f}s")
            await asyncio.sleep(0.1)

    async def _supervise(self, quit: asyncio.Event) -> None:
        backoff = RESTART_BACKOFF
        env = dict(os.environ) | {"SF_ROLLOUT_START_VACATED": "true", "SF_ROLLOUT_HOST": self.cfg.id}
        if self.cfg.trainer:  # the trainer's ranks own the device until a lend: the worker sleeps from the start
            env["SF_ROLLOUT_START_ASLEEP"] = "true"
        cores = self.cfg.cores or ",".join(map(str, sorted(parse_cpu_list(self.cfg.cpus))))
        if cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        while not quit.is_set():
            out = None
            if self.cfg.log_dir:
                Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
                out = open(Path(self.cfg.log_dir) / f"{self.cfg.worker_id}.log", "ab")
            self.worker_started = time.time()
            # its own process group: vLLM's engine processes outlive a SIGKILLed worker, and are
            # killed with the group once the worker is gone
            self.proc = await asyncio.create_subprocess_exec(*self.worker_argv, env=env, stdout=out, stderr=out,
                                                             preexec_fn=_die_with_parent, start_new_session=True)
            if out:
                out.close()
            started = time.monotonic()
            rc = await self.proc.wait()
            _kill_group(self.proc.pid)
            if quit.is_set():
                return
            self.restarts += 1
            self.mode, self.worker = "idle", None  # a restarted worker starts vacated
            if time.monotonic() - started > HEALTHY_RUN:
                backoff = RESTART_BACKOFF
            where = Path(self.cfg.log_dir) / f"{self.cfg.worker_id}.log" if self.cfg.log_dir else "the agent's log"
            log.warning("worker %s exited with code %s; restart %d in %.1fs (log: %s)", self.cfg.worker_id, rc,
                        self.restarts, backoff, where)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.restart_backoff_max)

    async def _stop_worker(self) -> None:
        p = self.proc
        if p is None or p.returncode is not None:
            return
        p.terminate()
        try:
            await asyncio.wait_for(p.wait(), STOP_WAIT)
        except TimeoutError:
            p.kill()
            await p.wait()
        _kill_group(p.pid)


def _kill_group(pgid: int) -> None:
    """SIGKILL whatever is left of a worker's process group (vLLM engine processes)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the agent dies, so a killed agent leaves no orphan worker."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def pin(cfg: HostConfig) -> None:
    """Run this agent, and so its worker (affinity is inherited), on the host's CPU set (SF_HOST_CPUS)."""
    cpus = parse_cpu_list(cfg.cpus)
    if not cpus:
        return
    os.sched_setaffinity(0, cpus)
    log.info("host %s pinned to CPUs %s", cfg.id, cfg.cpus)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.scheduler.host")
    ap.add_argument("--id")
    ap.add_argument("--tags")
    ap.add_argument("--model")
    args = ap.parse_args()
    setup_logging()
    cfg = load_host(id=args.id, tags=args.tags, model=args.model)
    pin(cfg)
    run_until_signalled(HostAgent(cfg, connections()).run)


if __name__ == "__main__":
    main()
