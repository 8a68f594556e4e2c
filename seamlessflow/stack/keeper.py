"""The running `seamlessflow up`: keeps the stack's processes alive and answers the control
channel until Ctrl-C/SIGTERM, then stops the stack in order.

Each tick (0.2 s):
1. a process that exited unexpectedly is restarted after its back-off, or given up when it
   crash-loops (supervisor.RestartPolicy); giving up NATS or Redis stops the stack;
2. a starting process becomes running once it logs its ready line (or its port listens);
   one that is not ready within the stack's ready timeout is killed, which counts as a crash;
3. a restart that is due is spawned.

`scale` adds or removes one process at a time: a new worker or replica is ready before the
next is started; a worker leaving is vacated first (its requests migrate with their partial
tokens), then stopped; a replica leaving drains (it leaves the queue group and finishes its
turns). `status` answers from the keeper's records and the workers' heartbeats.

This module knows the stack only through stack.py (processes) and the rollout control
subject (vacate); what to do when is supervisor.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable

import msgspec

from seamlessflow.stack import control
from seamlessflow.stack.processes import Proc, Stack, log_tail
from seamlessflow.stack.supervisor import (
    GiveUp,
    RestartPolicy,
    ScaleError,
    Service,
    next_name,
    victims,
)
from shared import bus, subjects
from shared.codec import decode, encode
from shared.config import connections
from shared.heartbeats import Heartbeats
from shared.messages.rollout import RolloutControl, WorkerStatus

TICK = 0.2
VACATE_TIMEOUT = 30.0  # a vacate replies once its requests' GenerateDone went out (<= 10 s)
WORKER_LISTED_FOR = 30.0  # status lists workers heard from within this many seconds


class Keeper:
    def __init__(self, stack: Stack, policy: RestartPolicy, say: Callable[[str], None] = print,
                 on_up: Callable[[], None] = lambda: None):
        self.stack, self.policy, self.on_up = stack, policy, on_up
        self.say = lambda msg: say(f"{control.now_stamp()} {msg}")
        now = time.monotonic()
        self.services: dict[str, Service] = {}
        for p in stack.procs:
            self._track(p, now)
        self.workers: Heartbeats[WorkerStatus] = Heartbeats(WORKER_LISTED_FOR)
        self.nc = None
        self.scaling = ""  # what the scale in progress does ("" = none)
        self.scaling_since = 0.0
        self.fatal = ""  # why the stack must stop
        self.announced = False
        self._handlers: set[asyncio.Task] = set()
        self._overdue: set[int] = set()  # pids killed for not getting ready in time

    async def run(self, quit: asyncio.Event) -> int:
        """Supervise until `quit` (or an essential service is given up); then stop in order.
        Returns the exit code for `up`: 0, or 1 after a fatal give-up."""
        path = control.socket_path(self.stack.data)
        server = None
        try:
            server = await control.serve(path, self._handle)
        except OSError as e:
            self.say(f"warning: no control channel ({e}); scale and status will not reach this stack")
        watcher = asyncio.create_task(self._watch_workers(quit))
        try:
            while not quit.is_set() and not self.fatal:
                self.tick(time.monotonic())
                try:
                    await asyncio.wait_for(quit.wait(), TICK)
                except TimeoutError:
                    pass
        finally:
            if server is not None:
                server.close()
                path.unlink(missing_ok=True)
            for t in list(self._handlers):
                t.cancel()
            watcher.cancel()
            await asyncio.gather(watcher, *self._handlers, return_exceptions=True)
            if self.nc is not None:
                await self.nc.close()
            if self.fatal:
                self.say(f"error: {self.fatal}")
            self.say("stopping the stack in order: gateway, trajectory replicas, workers, Redis and NATS")
            for s in self.services.values():
                if s.state == "starting" and (p := self._proc(s.name)) is not None:
                    self.stack.clear_group(p)  # nothing in flight to drain: vLLM may not heed SIGTERM yet
                s.state = "stopping" if s.state in ("starting", "running") else s.state
            self.stack.stop(say=self.say)
            self.say("stopped; no service process is left")
        return 1 if self.fatal else 0

    # -- supervision ------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        for p in list(self.stack.procs):
            s = self.services.get(p.name)
            if s is None or s.state not in ("starting", "running"):
                continue
            if p.popen.poll() is not None:
                self._exited(p, s, now)
            elif s.state == "starting" and self.stack.is_ready(p):
                s.ready()
                if s.restarts:
                    self.say(f"{s.name} is back (pid {s.pid}, restart {s.restarts}, "
                             f"ready {now - s.started:.1f}s after its start)")
            elif s.state == "starting" and now - s.started > self.stack.o.ready_timeout and s.pid not in self._overdue:
                self._overdue.add(s.pid)
                self.say(f"{s.name} not ready after {self.stack.o.ready_timeout:.0f}s: killing it")
                self.stack.clear_group(p)  # SIGKILL to its group: the next tick sees the exit
        for s in self.services.values():
            if s.due(now):
                old = self._proc(s.name)
                if old is not None:
                    s.spawned(now, self.stack.respawn(old).popen.pid)
        if not self.announced and all(s.state in ("running", "given up") for s in self.services.values()):
            self.announced = True
            self.on_up()

    def _exited(self, p: Proc, s: Service, now: float) -> None:
        code = p.popen.returncode
        self.stack.clear_group(p)  # e.g. the engine process of a SIGKILLed worker
        decision = s.exited(now, code, self.policy)
        if not isinstance(decision, GiveUp):
            self.say(f"{s.name} exited with code {_code(code)}; restart {s.restarts} in {decision.delay:.1f}s "
                     f"(log: {p.log})")
            return
        tail = log_tail(p.log)
        if s.essential:
            self.fatal = (f"{s.name} {decision.reason}; nothing works without {s.name}, so the stack stops. "
                          f"Last lines of {p.log}:\n{tail}")
        else:
            self.say(f"error: giving up on {s.name}: {decision.reason}; the rest of the stack keeps running. "
                     f"Last lines of {p.log}:\n{tail}")

    def _track(self, p: Proc, now: float) -> Service:
        s = self.services[p.name] = Service(p.name, str(p.log))
        s.spawned(now, p.popen.pid)
        return s

    def _proc(self, name: str) -> Proc | None:
        return next((p for p in self.stack.procs if p.name == name), None)

    # -- the workers' heartbeats, and their control subject ---------------------------------------

    async def _watch_workers(self, quit: asyncio.Event) -> None:
        # this connection only follows heartbeats and sends vacates (whose failures are raised):
        # its reconnect chatter while NATS restarts, or on a starved CPU, is not for up's console
        logging.getLogger(bus.__name__).setLevel(logging.ERROR)
        conn = connections(dict(os.environ) | self.stack.client_settings())
        while self.nc is None and not quit.is_set():
            try:
                self.nc = await bus.connect(conn, name="sf-up")
            except bus.BusUnavailable:
                await asyncio.sleep(1.0)

        async def on_status(msg) -> None:
            try:
                st = decode(msg.data, WorkerStatus)
            except msgspec.DecodeError:
                return
            self.workers.beat(st.worker_id, st, time.time())

        if self.nc is not None:
            await self.nc.subscribe(subjects.ROLLOUT_STATUS, cb=on_status)

    async def _vacate(self, name: str) -> int:
        """Vacate worker `name`; returns how many requests it had running (they migrate)."""
        st = self.workers.get(name)
        if self.nc is None:
            raise ScaleError("not connected to NATS: cannot vacate a worker before stopping it")
        reply = await bus.request(self.nc, subjects.rollout_ctl(name), encode(RolloutControl(op="vacate")),
                                  VACATE_TIMEOUT)
        self.workers.beat(name, decode(reply, WorkerStatus), time.time())
        return st.running if st else 0

    # -- the control channel ----------------------------------------------------------------------

    async def _handle(self, request: dict, progress: control.Progress) -> dict | None:
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            match request.get("op"):
                case "status":
                    return self.status()
                case "scale":
                    return await self._scale_request(request.get("counts") or {}, progress)
            return None
        finally:
            self._handlers.discard(task)

    def status(self) -> dict:
        now, wall = time.monotonic(), time.time()
        workers = [{"worker_id": w.worker_id, "state": w.state, "version": w.version, "running": w.running,
                    "capacity": w.capacity, "load": round(w.running / max(1, w.capacity), 3), "host": w.host, "tokens": w.generated_tokens,
                    "age": round(self.workers.age(w.worker_id, wall) or 0.0, 1)}
                   for w in self.workers.fresh(wall)]
        return {"ok": True, "pid": os.getpid(), "data_dir": str(self.stack.data), "policy": self.stack.o.policy,
                "gateway_url": self.stack.gateway_url, "admin_url": self.stack.admin_url,
                "services": [s.row(now) for s in self.services.values()], "workers": workers,
                "scaling": self.scaling}

    async def _scale_request(self, counts: dict, progress: control.Progress) -> dict:
        if self.scaling:
            return {"ok": False, "error": f"a scale is already running ({self.scaling}, for "
                    f"{time.monotonic() - self.scaling_since:.0f}s); scaling is one at a time: "
                    "try again when it finishes"}
        if not isinstance(counts, dict) or not all(isinstance(v, int) for v in counts.values()):
            return {"ok": False, "error": "counts must map rollout/trajectory to a number"}
        if "rollout" in counts and self.stack.o.policy:
            return {"ok": False, "error": f"this stack runs the tag scheduler (--policy {self.stack.o.policy}): "
                    "its rollout workers belong to host agents, one per --hosts entry"}
        self.scaling = " ".join(f"{k}={v}" for k, v in counts.items())
        self.scaling_since = time.monotonic()
        try:
            for kind, n in counts.items():
                await self.scale(kind, n, progress)
        except (ScaleError, bus.BusUnavailable, bus.ReplyTimeout) as e:
            return {"ok": False, "error": str(e)}
        finally:
            self.scaling = ""
        return {"ok": True, "counts": {k: len(self._of(k)) for k in counts}}

    def _of(self, kind: str) -> list[Service]:
        return [s for s in self.services.values() if s.kind == kind and s.state != "stopped"]

    async def scale(self, kind: str, n: int, progress: control.Progress) -> None:
        """Bring `kind` to `n` processes, one at a time."""
        if kind not in ("rollout", "trajectory") or n < 0 or (kind == "trajectory" and n < 1):
            raise ScaleError(f"cannot scale {kind} to {n}")
        while len(self._of(kind)) < n:
            await self._add(kind, progress)
        for name in victims(self._of(kind), n):
            await self._remove(name, progress)
        if kind == "rollout":
            self.stack.o.workers = n
        else:
            self.stack.o.trajectory_replicas = n

    async def _add(self, kind: str, progress: control.Progress) -> None:
        name = next_name(kind, [s.name for s in self.services.values()])
        if kind == "rollout":
            self.stack.o.workers = max(self.stack.o.workers, len(self._of(kind)) + 1)  # its CPU share
            p = self.stack.spawn_rollout(name)
        else:
            p = self.stack.spawn_trajectory(name)
        s = self._track(p, time.monotonic())
        await self._tell(progress, f"{name} starting (pid {s.pid}, log {p.log})")
        deadline = s.started + self.stack.o.ready_timeout + 5
        while s.state == "starting" or s.state == "restarting":
            if time.monotonic() > deadline:
                raise ScaleError(f"{name} did not become ready; see {p.log}")
            await asyncio.sleep(TICK)
        if s.state == "given up":
            raise ScaleError(f"{name} was given up: {s.reason}; last lines of {p.log}:\n{log_tail(p.log)}")
        await self._tell(progress, f"{name} ready in {time.monotonic() - s.started:.1f}s")

    async def _remove(self, name: str, progress: control.Progress) -> None:
        s, p = self.services[name], self._proc(name)
        if p is not None and s.state in ("starting", "running"):
            if s.kind == "rollout" and s.state == "running":
                migrated = await self._vacate(name)
                await self._tell(progress, f"{name} vacated ({migrated} requests migrate)")
            s.state = "stopping"
            await self._tell(progress, f"stopping {name}" + (" (draining its turns)" if s.kind == "trajectory" else ""))
            await asyncio.to_thread(self.stack.terminate, [p])
        s.state = "stopped"
        if p is not None:
            self.stack.procs.remove(p)
        del self.services[name]
        self.workers.forget(name)
        await self._tell(progress, f"{name} stopped")

    async def _tell(self, progress: control.Progress, msg: str) -> None:
        self.say(f"scale: {msg}")
        try:
            await progress(msg)
        except ConnectionError:  # the asking CLI went away; the scale goes on
            pass


def _code(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)
