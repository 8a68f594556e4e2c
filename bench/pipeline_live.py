"""Simulator fidelity: the same small workload on a live stack and in the simulator, side by side.

    .venv/bin/python bench/pipeline_live.py [--hosts 4] [--steps 20] [--warmup 4] [--policy seamless] [--pin]

Everything that computes is SIMULATED; everything that coordinates is real.
- Live: the real scheduler, host agents, NATS, Redis, trajectory manager and gateway. Each
  host agent's resident worker is the real RolloutService around services/rollout/simulated.py's
  stand-in engine (SF_HOST_WORKER_CMD); the trainer is the real TrainerService and Runner
  around bench/sim_trainer.py's engine, which sleeps per token. host-0 is {train, rollout},
  the others {rollout}. Agents (this process) keep sessions open as fast as the trajectory
  manager's staleness admission allows (SF_TRAJECTORY_MAX_STALENESS): one turn of
  --tokens tokens each, sessions filling GRPO groups in order.
- Simulated: services/scheduler/sim/simulator.py with Cluster.uniform(hosts, 1) and
  CALIBRATIONS["live-mini"] set to the engine's step costs, with switch costs (lend,
  reclaim: the host agents' measured p50), weight sync (the trainer's measured publish) and
  the train cost per token (the trainer's measured compute per token) taken from the live
  run; the engine's prefill as it runs (one step of the request's own, `prefill_one_step`) and its
  in-place weight load (a version number: `weight_load_s` 0); admission on the backlog as the live
  trajectory manager reads it (`--backlog heartbeat`: the trainer's holdings as of its last status);
  WORKLOADS["live-mini"] with the live prompt length; dt = the live scheduler tick. Its lend
  verdict and routing are the live stack's: the offer only with SF_SCHEDULER_LIVE_OFFER, the renewal
  SF_SCHEDULER_RENEW_S, rebalance on a lend SF_TRAJECTORY_REBALANCE and its worth test
  SF_TRAJECTORY_REBALANCE_WORTH (sim.Options offer, renew_s, rebalance, rebalance_worth; without them
  the simulator's policy read an offer the live one did not, and never lent).

Compared over the same steps (warmup+1 .. steps; the simulator is run to `warmup` and to
`steps` with one seed, and the difference taken): trained tokens/s (prompt + generated
tokens of the trained samples, per second) and the overall idle fraction (the scheduler's
timeline, shared/messages/scheduler.py `fractions`; policy.activity in both). Also the
live run's wall-clock overrun: its time for the same steps over the simulator's.

The live idle fraction is taken twice. "idle" is the scheduler's timeline, whose rollout/idle
split follows each worker's running count in its heartbeats (1 s apart): sampled. "idle live
(engine logs)" is exact: over the compared window [t_k, t_n], per host, the time the host is
neither training nor switching (the timeline's train and switch intervals, as above) and has no
request running in its engine (the union of the [t0, t1] intervals of every request that
host's engine logged, services/rollout/simulated.py --timing-dir), over t_n - t_k; overall = the
mean over hosts (`exact_idle`). Both are set against the simulator's idle, which is exact.

The simulator runs twice: as before, and "sim + control" with the control plane's CPU
(sim.Options.control_s_per_turn on control_cores): the CPU seconds per turn of every live
process but the trainer and the scheduler (agents, gateway, trajectory manager, NATS, Redis,
host agents with their workers), measured over the run (/proc), on the cores that other
processes left free meanwhile (/proc/stat). --control-ms and --control-cores set them instead
(e.g. the cost measured in another run).

A third simulator column, "sim + latency", adds the latency a turn spends outside the engine
(sim.Options.turn_latency_s), measured in the live run from two independent clocks: each
session's wall time as the agents see it (POST /sessions sent -> /finish answered: one turn,
its HTTP calls, the gateway, the trajectory manager's Redis and NATS hops, the streamed
deltas) and each request's time inside the simulated engine (generate() called -> last delta,
logged by the engine itself: services/rollout/simulated.py --timing-dir), both over the sessions
the compared steps' window opened; latency = mean of the first - mean of the second. Never
fitted: --turn-latency-ms sets it instead.

A fourth, "sim + split latency", places that latency where it falls: before the engine
(sim.Options.turn_latency_s) and after it (sim.Options.turn_latency_after_s: the session moves
on that much after its last token, its engine slot already free). Both parts come from the same
two clocks, both wall clock (time.time()) on this one machine, turn by turn: each agent turn is
paired with its engine requests by request id (the gateway's x-request-id, which the engine
logs as `<id>.<...>.<dispatch>`). Per paired turn, over the turns the compared window opened:
before = the first dispatch's t0 (generate() called) - POST /sessions sent (the open call, the
chat request through the gateway and the trajectory manager to the worker); after = /finish
answered - the t1 (last delta yielded) of the dispatch that finished (the deltas back through
the worker, trajectory manager and gateway to the agent, then /finish); the means over the
paired turns (`split_latency`). before + engine (last t1 - first t0) + after = the agents' time
per turn exactly, over the same turns. --split-latency-ms BEFORE,AFTER sets them instead.

A fifth, "sim + spread", is the fourth with each turn's latency drawn around those means
(sim.Options.turn_latency_cv: a gamma of the measured coefficient of variation of before + after
over the paired turns; --latency-cv sets it). With one fixed latency every turn of the
fixed-length workload stays in step with the sessions admitted beside it, and the simulated
rollout hosts idle between the bursts; live, the latency varies and the bursts spread.

Every variant's trainer has the live trainer's own time per step (`--trainer-overhead measured`,
the default; `none` leaves it out): `trainer_overhead` takes, per compared step, the gap from the
previous step's audit record (its version out) to this step's compute start, less the trainer's
wait for data (its log line's wait=) and the reclaim its gate waited for (the switch in the gate's
window, at most the simulator's reclaim cost). What is left is the trainer's bookkeeping (checkpoint,
metrics, status: host-0's timeline shows it as train, Calibration.bookkeeping_s, after the version is
out), the hand-off to the runner (train: Calibration.start_s, before the compute) and the rest of
its gate (host-0 idle: Calibration.gate_s).

`--replay JSON` runs the simulator side again on a saved run's live figures (no lock needed: no stack).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import heapq
import itertools
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.load import machine_busy  # noqa: E402
from scheduler_ab import switches  # noqa: E402

from seamlessflow.ops import hosts as hostops  # noqa: E402
from seamlessflow.stack import servers  # noqa: E402
from seamlessflow.modelgen import init_model  # noqa: E402
from seamlessflow.stack import Stack, StackOptions  # noqa: E402
from services.scheduler.config import load_scheduler  # noqa: E402
from services.scheduler.sim import Cluster, Simulator, Options  # noqa: E402
from services.scheduler.sim.result import ACTS  # noqa: E402
from services.scheduler.sim.workload import CALIBRATIONS, WORKLOADS  # noqa: E402
from services.trajectory.config import TrajectoryConfig  # noqa: E402
from shared.config import connections, load  # noqa: E402
from shared.messages.scheduler import Interval, fractions  # noqa: E402

WL = WORKLOADS["live-mini"]
LIVE = load_scheduler()  # the live scheduler's settings (SF_SCHEDULER_*): the simulator's policy reads the same
TRAJ = load(TrajectoryConfig, "SF_TRAJECTORY_")  # the live router's (SF_TRAJECTORY_REBALANCE): the simulator's routing too


class SimTrainerStack(Stack):
    """The stack with bench/sim_trainer.py in place of `python -m services.trainer`."""

    s_per_token = 1 / 17_123

    def spawn_trainer(self, name: str = "trainer", model: Path | None = None, **settings: object):
        env = self.env() | {f"SF_TRAINER_{k.upper()}": str(v) for k, v in settings.items()}
        env.setdefault("SF_TRAINER_METRICS_PORT", "0")
        env.setdefault("SF_TRAINER_AUDIT_LOG", str(self.data / "trainer" / "trained.jsonl"))
        return self._spawn(name, [sys.executable, str(ROOT / "bench" / "sim_trainer.py"), "--model", str(self.o.model),
                                  "--checkpoint-dir", str(self.data / "trainer" / "checkpoints"),
                                  "--weights-dir", str(self.weights_dir), "--s-per-token", str(self.s_per_token),
                                  "--log", str(self.data / "trainer" / "sim_steps.jsonl")], env, ready="trainer ready")


class Agents:
    """`slots` agents, each: open a session, one turn, finish. Sessions open concurrently while
    admission admits; once it answers 429 (or 503), one agent at a time probes it every 20 ms
    and the others queue behind it. Group ids are handed out in order, so sessions fill GRPO
    groups in order as in the simulator."""

    def __init__(self, base_url: str, api_key: str, tokens: int, group_size: int, slots: int):
        self.base_url, self.api_key, self.tokens, self.group_size, self.slots = base_url, api_key, tokens, group_size, slots
        self.prompt_tokens: list[int] = []
        # per turn: open sent, opened, reply, finished (time.time()), and the gateway's request id
        self.timings: list[tuple[float, float, float, float, str]] = []
        self.failures: list[str] = []
        self.closed = False
        self._probe = asyncio.Lock()
        self._free: list[int] = []  # session indexes handed back by a refusal
        self._next = 0
        self.rng = random.Random(0)

    async def _try(self, http: httpx.AsyncClient) -> dict | None:
        idx = heapq.heappop(self._free) if self._free else self._next
        self._next = max(self._next, idx + 1)
        sent = time.time()
        r = await http.post("/sessions", json={"group_id": f"g{idx // self.group_size}"})
        if r.status_code in (429, 503):  # admission paused, or the trainer not seen yet
            heapq.heappush(self._free, idx)
            return None
        r.raise_for_status()
        return r.json() | {"_sent": sent, "_opened": time.time()}

    async def _open(self, http: httpx.AsyncClient) -> dict:
        while True:
            if self.closed:
                async with self._probe:
                    while self.closed:
                        if (s := await self._try(http)) is not None:
                            self.closed = False
                            return s
                        await asyncio.sleep(0.02)
            if (s := await self._try(http)) is not None:
                return s
            self.closed = True

    async def _agent(self, http: httpx.AsyncClient, stop) -> None:
        while not stop():
            s = await self._open(http)
            body = {"model": "seamlessflow-tiny", "max_tokens": self.tokens, "temperature": 1.0,
                    "messages": [{"role": "user", "content": f"count {self.rng.randint(0, 999)}"}]}
            r = await http.post("/chat/completions", json=body, headers={"Authorization": f"Bearer {s['api_key']}"})
            replied = time.time()
            if r.status_code != 200:
                self.failures.append(f"{r.status_code}: {r.text[:200]}")
            else:
                self.prompt_tokens.append(r.json()["usage"]["prompt_tokens"])
            f = await http.post(f"/sessions/{s['id']}/finish", json={"reward": self.rng.random()})
            f.raise_for_status()
            if r.status_code == 200:
                self.timings.append((s["_sent"], s["_opened"], replied, time.time(), r.headers.get("x-request-id", "")))

    async def run(self, stop, timeout: float) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, headers={"Authorization": f"Bearer {self.api_key}"},
                                     timeout=120) as http:
            tasks = [asyncio.create_task(self._agent(http, stop)) for _ in range(self.slots)]
            done, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in done:
                if t.exception():
                    self.failures.append(repr(t.exception()))


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cpu_s(pid: int, tree: bool = True) -> float:
    """utime + stime of a process, and with `tree` of its waited-for children and its live
    descendants (a host agent's resident worker: RolloutService and the simulated engine), in
    seconds (/proc); 0 once it is gone."""
    try:
        own = _stat(pid)
    except OSError:
        return 0.0
    total = sum(int(x) for x in own[11:15 if tree else 13])
    if tree:
        children: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    children.setdefault(int(_stat(int(d.name))[1]), []).append(int(d.name))
                except OSError:
                    pass
        todo = list(children.get(pid, []))
        while todo:
            c = todo.pop()
            todo += children.get(c, [])
            try:
                total += sum(int(x) for x in _stat(c)[11:15])
            except OSError:
                pass
    return total / os.sysconf("SC_CLK_TCK")


def merged(intervals: list[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    """The intervals clipped to [t0, t1], overlapping or touching ones merged, in order."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((max(a, t0), min(b, t1)) for a, b in intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def exact_idle(busy: list[tuple[float, float]], requests: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Share of [t0, t1] that one host spends neither in `busy` (its train and switch intervals)
    nor with a request in its engine (`requests`: each request's [t0, t1]); 0 for an empty window."""
    if t1 <= t0:
        return 0.0
    return 1 - sum(b - a for a, b in merged(busy + requests, t0, t1)) / (t1 - t0)


def engine_slowdown(logs: dict[str, list[dict]], t0: float, t1: float, step_ms: float, per_seq_ms: float,
                    tokens: int, capacity: int) -> float:
    """The engines' measured step against their nominal one (services/rollout/simulated.py's step_ms +
    per_seq_ms x running): over the requests that began in [t0, t1] and ran whole on one engine (first
    dispatch, finished "length", never beside more than `capacity` others: no wait for a slot), the
    mean of each one's time in the engine (its log's t0 -> t1) over its `tokens` + 1 nominal steps (its
    prefill's and its tokens') at the mean batch its engine ran meanwhile. The stand-in engine sleeps
    each step and then does its bookkeeping, on cores it shares with the control plane: live, a step
    takes longer than its sleep. 1.0 where no request qualifies."""
    ratios = []
    for rows in logs.values():
        ev = sorted([(r["t0"], 1) for r in rows] + [(r["t1"], -1) for r in rows])
        ts, ks = [e[0] for e in ev], list(itertools.accumulate(e[1] for e in ev))
        for r in rows:
            if r["finish"] != "length" or not str(r.get("request", "")).endswith(".0") or not t0 <= r["t0"] < t1:
                continue
            i0, i1 = bisect.bisect_right(ts, r["t0"]), bisect.bisect_left(ts, r["t1"])
            edges = [r["t0"], *ts[i0:i1], r["t1"]]
            batch = [ks[i0 - 1], *ks[i0:i1]]
            if max(batch) > capacity or r["t1"] <= r["t0"]:
                continue
            k = sum((b - a) * n for a, b, n in zip(edges, edges[1:], batch)) / (r["t1"] - r["t0"])
            ratios.append((r["t1"] - r["t0"]) / ((tokens + 1) * (step_ms + per_seq_ms * k) / 1000))
    return statistics.mean(ratios) if ratios else 1.0


def split_latency(turns: list[tuple], engine: list[dict]) -> dict:
    """A turn's latency outside the engine, before and after it (module docstring). `turns`:
    the agents' (open sent, opened, reply, finished, request id); `engine`: the engines' log
    lines ({"request": "<request id>.<...>", "t0", "t1", "finish"}; the gateway's id has no dot). A turn counts only
    if its request reached an engine and finished there ("length" or "stop")."""
    runs: dict[str, list[dict]] = {}
    for r in engine:
        rid = (r.get("request") or "").partition(".")[0]  # <gateway id>.<turn>.<dispatch>
        if rid:
            runs.setdefault(rid, []).append(r)
    before, inside, after = [], [], []
    for sent, _opened, _reply, finished, rid in turns:
        rs = runs.get(rid)
        done = [r for r in rs or () if r["finish"] in ("length", "stop")]
        if not done:
            continue
        t0, t1 = min(r["t0"] for r in rs), max(r["t1"] for r in done)
        before.append(t0 - sent)
        inside.append(t1 - t0)
        after.append(finished - t1)
    mean = lambda xs: statistics.mean(xs) if xs else float("nan")  # noqa: E731
    outside = [b + f for b, f in zip(before, after)]  # its spread: sim.Options.turn_latency_cv
    cv = statistics.pstdev(outside) / mean(outside) if len(outside) > 1 and mean(outside) > 0 else 0.0
    return {"before_s": mean(before), "engine_s": mean(inside), "after_s": mean(after), "turns": len(before),
            "cv": cv}


STEP_LINE = re.compile(r"\bstep (\d+) v\d+ .* wait=([\d.]+)s ")  # services/trainer/metrics.py format_line
GATE_LINE = re.compile(r"\bstep (\d+): gate (?:granted|not granted \(.*?\)) after ([\d.]+)s")  # trainer/service.py


def trainer_waits(log: str) -> dict[int, tuple[float, float]]:
    """Per step, from the live trainer's log: (wait for data, gate), in seconds (2 decimals): the time in
    `_next_batch` and the gate's round trip (0 where no gate was asked)."""
    waits = {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(log)}
    gates = {int(m.group(1)): float(m.group(2)) for m in GATE_LINE.finditer(log)}
    return {n: (w, gates.get(n, 0.0)) for n, w in waits.items()}


def overlap(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] that the intervals cover."""
    return sum(b - a for a, b in merged(intervals, t0, t1))


def trainer_overhead(audit: dict[int, float], start: dict[int, float], waits: dict[int, tuple[float, float]],
                     train: list[tuple[float, float]], switch: list[tuple[float, float]], reclaim_s: float,
                     steps: list[int]) -> dict:
    """The live trainer's time per step that the simulator's trainer did not have: what it spends
    neither computing, publishing, waiting for data nor waiting for its pool's reclaim
    (Calibration.bookkeeping_s, gate_s and start_s).

    For each step n of `steps` (step n-1 logged as well), the gap from step n-1's audit record
    (`audit`: the version is out; the simulator's publish ends there) to step n's compute start
    (`start`: the simulated engine's own clock) holds, in order: the bookkeeping of step n-1
    (checkpoint, metrics, status), the wait for data and the gate (`waits`, the trainer's log),
    the hand-off to the runner. The simulator charges the wait as it simulates it and the gate as
    a reclaim of `reclaim_s` where the pool had one to do, so what it misses is
        gap - wait - min(reclaim_s, switch time in the gate's window [start - gate, start]).
    The train host's timeline (`train`: its train intervals, the trainer computing or publishing as
    the scheduler saw it) splits that: the train interval that runs on from before the audit is
    `bookkeeping_s`; a train interval that begins in the gap (the trainer computing, before its
    compute starts) is `start_s`; the rest, the train host idle, is `gate_s`. Means over the steps;
    `gap_s`, `wait_s`, `gate_wait_s` (the logged gate) and `reclaim_s` for the record. NaN where no
    step qualifies."""
    rows = []
    for n in steps:
        if n - 1 not in audit or n not in start or n not in waits:
            continue
        t0, t1 = audit[n - 1], start[n]
        wait, gate = waits[n]
        reclaim = min(reclaim_s, overlap(switch, t1 - gate, t1)) if gate > 0 else 0.0
        missed = t1 - t0 - wait - reclaim
        after = overlap([(a, b) for a, b in train if a <= t0], t0, t1)
        before = overlap([(a, b) for a, b in train if a > t0], t0, t1)
        rows.append((t1 - t0, wait, gate, reclaim, after, missed - after - before, before))
    keys = ("gap_s", "wait_s", "gate_wait_s", "reclaim_s", "bookkeeping_s", "gate_s", "start_s")
    out = {k: statistics.mean(r[i] for r in rows) if rows else float("nan") for i, k in enumerate(keys)}
    return out | {"steps": len(rows)}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def live_stack(a, tmp: Path) -> SimTrainerStack:
    """The live stack, not started: SIMULATED engines on `a.hosts` hosts and a SIMULATED trainer."""
    model = a.model or init_model(tmp / "model", size="tiny")
    engine = f"{sys.executable} -m services.rollout.simulated --capacity {a.capacity} " \
             f"--step-ms {a.step_ms} --per-seq-ms {a.per_seq_ms} --follow-weights --timing-dir {tmp / 'engine_timing'}"
    trainer = {"group_size": WL.group_size, "groups_per_step": WL.groups_per_step, "publish_every": 1,
               "checkpoint_every": 5, "keep_versions": 3, "gate_timeout": 60}
    opts = StackOptions(model=model, data_dir=tmp, gateway_port=servers.free_port(), admin_port=servers.free_port(),
                        nats_port=servers.free_port(), redis_port=servers.free_port(), max_model_len=512,
                        max_num_seqs=a.capacity, policy=a.policy, hosts=["train+rollout"] + ["rollout"] * (a.hosts - 1),
                        train=True, trainer_settings=trainer, pin=a.pin,
                        extra_env={"SF_HOST_WORKER_CMD": engine, "SF_SCHEDULER_TICK": str(a.tick),
                                   "SF_TRAJECTORY_MAX_STALENESS": str(WL.max_staleness)})
    SimTrainerStack.s_per_token = a.s_per_token
    return SimTrainerStack(opts)


def wait_placed(conn, hosts: int, timeout: float = 60) -> None:
    """Until every host is placed, its worker up and its switch applied (or `timeout` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hs = asyncio.run(hostops.ask(conn, "status")).hosts
        if len(hs) == hosts and all(h.mode == h.target and h.healthy and h.mode != "idle" for h in hs):
            break
        time.sleep(0.3)


def heartbeat_fractions(hosts, t_k: float, t_n: float) -> tuple[dict, dict]:
    """From the scheduler's timeline: each activity's mean fraction of [t_k, t_n] over the hosts, and each host's idle."""
    spent, idle_hosts = dict.fromkeys(ACTS, 0.0), {}
    for h in hosts:
        f = fractions([Interval(iv.activity, iv.t_start, iv.t_end) for iv in h.timeline], t_k, t_n)
        idle_hosts[h.host] = f["idle"]
        for k, v in f.items():
            spent[k] += v / len(hosts)
    return spent, idle_hosts


def engine_requests(tmp: Path, hosts) -> tuple[dict, dict]:
    """The engines' request logs (by worker) and each host's requests as (t0, t1)."""
    logs = {f.stem: _jsonl(f) for f in sorted((tmp / "engine_timing").glob("*.jsonl"))}  # <worker-id>.jsonl
    host_of, reqs = {h.worker_id: h.host for h in hosts}, {}
    for stem, rows in logs.items():
        for r in rows:  # lines written before "host" was logged: the host whose worker wrote the file
            reqs.setdefault(r.get("host") or host_of.get(stem, stem), []).append((r["t0"], r["t1"]))
    return logs, reqs


def turn_times(turns: list, engine: list[dict]) -> tuple[float, float, dict]:
    """(an agent's mean turn, the engine's mean request, the agent turn's parts: open, chat, finish), in seconds."""
    agent_s = statistics.mean(x[3] - x[0] for x in turns) if turns else float("nan")
    engine_s = statistics.mean(r["t1"] - r["t0"] for r in engine) if engine else float("nan")
    parts = {"open_s": statistics.mean(x[1] - x[0] for x in turns) if turns else float("nan"),
             "chat_s": statistics.mean(x[2] - x[1] for x in turns) if turns else float("nan"),
             "finish_s": statistics.mean(x[3] - x[2] for x in turns) if turns else float("nan")}
    return agent_s, engine_s, parts


def live_overhead(a, stack: Stack, steps: list[dict], sims: dict[int, dict], hosts, sw: dict) -> dict:
    """trainer_overhead over the compared steps, from the run's records: the audit log's steps, the
    simulated engine's (compute start), the trainer's log and host-0's timeline."""
    h0 = next((h for h in hosts if h.host == "host-0"), None)
    acts = lambda kind: [(iv.t_start, iv.t_end) for iv in (h0.timeline if h0 else ()) if iv.activity == kind]  # noqa: E731
    log = stack.logs / "trainer.log"
    return trainer_overhead({r["step"]: r["ts"] for r in steps}, {n: r["ts"] - r["compute_s"] for n, r in sims.items()},
                            trainer_waits(log.read_text(errors="replace") if log.exists() else ""),
                            acts("train"), acts("switch"), statistics.median(sw["reclaim"]) if sw["reclaim"] else a.switch_s,
                            list(range(a.warmup + 1, a.steps + 1)))


def live(a, tmp: Path) -> dict:
    stack = live_stack(a, tmp)
    print(f"starting the live stack in {tmp} (SIMULATED engines and trainer) ...", file=sys.stderr)
    stack.start()
    conn = connections({"SF_NATS_URL": stack.nats_url, "SF_REDIS_URL": stack.redis_url})
    audit, simlog = tmp / "trainer" / "trained.jsonl", tmp / "trainer" / "sim_steps.jsonl"
    try:
        wait_placed(conn, a.hosts)
        agents = Agents(stack.gateway_url, stack.api_key, a.tokens, WL.group_size, a.slots)
        n_steps = lambda: sum(1 for r in _jsonl(audit) if r["event"] == "step")  # noqa: E731
        pids = {p.name: p.popen.pid for p in stack.procs} | {"bench agents": os.getpid()}
        own = lambda k, v: _cpu_s(v, tree=k != "bench agents")  # noqa: E731  (the stack is this process's children)
        cpu0, t_start, busy0 = {k: own(k, v) for k, v in pids.items()}, time.time(), machine_busy()[0]
        load0 = os.getloadavg()[0]
        asyncio.run(agents.run(lambda: n_steps() >= a.steps, a.timeout))
        t_end, busy = time.time(), machine_busy()[0] - busy0
        cpu_s = {k: own(k, v) - cpu0[k] for k, v in pids.items()}
        cpu = {k: round(v / (t_end - t_start), 3) for k, v in cpu_s.items()}
        load = (load0 + os.getloadavg()[0]) / 2
        reply = asyncio.run(hostops.ask(conn, "timeline"))
    finally:
        stack.stop()
    steps = [r for r in _jsonl(audit) if r["event"] == "step"]
    sims = {r["step"]: r for r in _jsonl(simlog)}
    if len(steps) < a.steps:
        raise SystemExit(f"live run trained {len(steps)} of {a.steps} steps within {a.timeout:.0f}s; "
                         f"failures: {agents.failures[:3]}")
    t_k, t_n = steps[a.warmup - 1]["ts"] if a.warmup else t_start, steps[a.steps - 1]["ts"]
    window = [sims[s["step"]] for s in steps[a.warmup:a.steps]]
    tokens = sum(r["tokens_all"] for r in window)
    spent, idle_hosts = heartbeat_fractions(reply.hosts, t_k, t_n)
    # exact idle: per host, the window less train, switch and its engine's requests (module docstring)
    logs, reqs = engine_requests(tmp, reply.hosts)
    by_host = {h.host: exact_idle([(iv.t_start, iv.t_end) for iv in h.timeline if iv.activity in ("train", "switch")],
                                  reqs.get(h.host, []), t_k, t_n) for h in reply.hosts}
    sw = switches(stack, t_k, t_n)
    publish = [s["ts"] - sims[s["step"]]["ts"] for s in steps[a.warmup:a.steps]]
    # latency outside the engine: the agents' time per turn less the engine's own, over the turns
    # begun in the compared window (two clocks of one machine, two independent records)
    turns = [x for x in agents.timings if t_k <= x[0] < t_n]
    engine = [r for rows in logs.values() for r in rows
              if t_k <= r["t0"] < t_n and r["finish"] == "length"]
    agent_s, engine_s, parts = turn_times(turns, engine)
    split = split_latency(turns, [r for rows in logs.values() for r in rows])
    samples = sum(r["samples"] for r in window)
    slowdown = engine_slowdown(logs, t_k, t_n, a.step_ms, a.per_seq_ms, a.tokens, a.capacity)
    return {"engine_slowdown": slowdown, "tmp": str(tmp),
        "trainer_overhead": live_overhead(a, stack, steps, sims, reply.hosts, sw),
        "wall_s": t_n - t_start, "window_s": t_n - t_k, "trained_tokens_per_s": tokens / (t_n - t_k),
        "idle": spent["idle"], "fractions": spent, "idle_hosts": idle_hosts,
        "idle_engine": statistics.mean(by_host.values()) if by_host else float("nan"), "idle_engine_hosts": by_host,
        "lend_s": statistics.median(sw["lend"]) if sw["lend"] else None, "lends": len(sw["lend"]),
        "reclaim_s": statistics.median(sw["reclaim"]) if sw["reclaim"] else None, "reclaims": len(sw["reclaim"]),
        "publish_s": statistics.mean(publish),
        "train_s_per_token": sum(r["compute_s"] for r in window) / tokens,
        "prompt_tokens": (tokens - sum(r["tokens_loss"] for r in window)) / samples,
        "gen_tokens": sum(r["tokens_loss"] for r in window) / samples,
        "turn_latency_s": agent_s - engine_s, "agent_turn_s": agent_s, "engine_turn_s": engine_s,
        "agent_turns": len(turns), "engine_turns": len(engine), "agent_parts": parts, "split_latency": split,
        "failures": len(agents.failures), "agent_prompt_tokens": statistics.mean(agents.prompt_tokens or [0]),
        "turns": len(agents.prompt_tokens), "turns_per_s": len(agents.prompt_tokens) / (t_end - t_start),
        "cpu_core_share": cpu, "machine_load": round(load, 1), "cores": os.cpu_count(),
        # the control plane's CPU per turn: everything of the stack but the trainer and the
        # scheduler (their work is per step, not per turn), the agents and workers included
        "control_s_per_turn": sum(v for k, v in cpu_s.items() if k not in ("trainer", "scheduler"))
        / max(len(agents.prompt_tokens), 1),
        # cores the stack could have had: the machine's, less what other processes used meanwhile
        "free_cores": os.cpu_count() - (busy - sum(cpu_s.values())) / (t_end - t_start),
        "machine_busy_cores": busy / (t_end - t_start),
    }


def simulated(a, m: dict, control: tuple[float, float] = (0.0, 1.0), latency: float = 0.0, after: float = 0.0,
              cv: float = 0.0) -> dict:
    """The simulator on the live run's measured costs; `control` = (CPU s per turn, cores) of
    the control plane (Options.control_s_per_turn, control_cores), (0, 1) to leave it out;
    `latency` = wall seconds per turn outside the engine before it (Options.turn_latency_s), and
    `after` after it (Options.turn_latency_after_s), 0 to leave either out."""
    # the engines' step as measured live (engine_slowdown), or as configured
    slow = m.get("engine_slowdown", 1.0) if a.engine_speed == "measured" else 1.0
    cal = replace(CALIBRATIONS["live-mini"], decode_a_s=a.step_ms / 1000 * slow, decode_b_s=a.per_seq_ms / 1000 * slow,
                  max_seqs=a.capacity, lend_s=m["lend_s"] or a.switch_s, reclaim_s=m["reclaim_s"] or a.switch_s, weight_sync_s=m["publish_s"],
                  train_s_per_token=m["train_s_per_token"],
                  prefill_s_per_token=a.step_ms / 1000 * slow / max(m["prompt_tokens"], 1),  # what the routing rules read
                  prefill_one_step=True, weight_load_s=0.0)  # as the stand-in engine: a prefill is one step of the
    # request's own (the others decode on) and a version's load is instant (services/rollout/simulated.py)
    if a.trainer_overhead == "measured":  # the live trainer's own time per step (trainer_overhead); a mean
        # below 0 (the simulator charges more than the gap held) is left at 0
        o = m.get("trainer_overhead") or {}
        # (unmeasured: NaN, which measured_inputs refuses; --trainer-overhead none runs without)
        cal = replace(cal, **{k: max(0.0, v) if math.isfinite(v := o.get(k, math.nan)) else v
                              for k in ("bookkeeping_s", "gate_s", "start_s")})
    measured_inputs(cal, m, control, latency, after)
    prompt = round(m["prompt_tokens"])
    wl = replace(WL, prompt_tokens=prompt, length_median=round(m["gen_tokens"]), length_cap=round(m["gen_tokens"]))
    runs = {}
    limit = sim_time_limit(m)
    for n in (a.warmup, a.steps):
        # the lend verdict as the live scheduler ran it: its offer setting (off by default) and its renewal
        opt = Options(steps=n, dt=a.tick, seed=0, backlog=a.backlog, control_s_per_turn=control[0],
                      control_cores=control[1], route=a.route, turn_latency_s=latency, turn_latency_after_s=after,
                      turn_latency_cv=cv, max_time_s=limit, offer=LIVE.live_offer, renew_s=LIVE.renew_s,
                      rebalance=TRAJ.rebalance, rebalance_worth=TRAJ.rebalance_worth)
        sim = Simulator(Cluster.uniform(a.hosts, 1), cal, wl, a.policy, opt)
        runs[n] = sim.run()
        if sim.step < n:
            raise SystemExit(f"the simulator trained {sim.step} of {n} steps in {limit:.0f} virtual s (the live run "
                             f"took {m.get('wall_s', math.nan):.1f} s): its inputs stop it; {cal}, control {control}, "
                             f"latency {latency} + {after} s")
    r0, r1 = runs[a.warmup], runs[a.steps]
    tok = r1.trained_tokens_per_s * r1.wall_s - (r0.trained_tokens_per_s * r0.wall_s if a.warmup else 0)
    ht = r1.host_time - (r0.host_time if a.warmup else 0)
    window = r1.wall_s - (r0.wall_s if a.warmup else 0)
    return {"wall_s": r1.wall_s, "window_s": window, "trained_tokens_per_s": tok / window,
            "control": {"s_per_turn": control[0], "cores": control[1], "wait_s": r1.control_wait_s},
            "turn_latency_s": latency, "turn_latency_after_s": after, "turn_latency_cv": cv,
            "idle": float(ht[:, ACTS.index("idle")].sum() / ht.sum()),
            "idle_hosts": {f"host-{i}": float(x) for i, x in enumerate(ht[:, ACTS.index("idle")] / ht.sum(axis=1))},
            "fractions": {k: float(ht[:, i].sum() / ht.sum()) for i, k in enumerate(ACTS)},
            "lends": r1.lends - r0.lends, "reclaims": r1.reclaims - r0.reclaims,
            "calibration": {k: getattr(cal, k) for k in ("decode_a_s", "decode_b_s", "max_seqs", "prefill_s_per_token",
                                                         "train_s_per_token", "weight_sync_s", "lend_s", "reclaim_s",
                                                         "bookkeeping_s", "gate_s", "start_s")},
            "workload": {"prompt_tokens": prompt, "tokens": wl.length_median, "group_size": wl.group_size,
                         "groups_per_step": wl.groups_per_step, "max_staleness": wl.max_staleness}}


def measured_inputs(cal, m: dict, control: tuple[float, float], latency: float, after: float) -> None:
    """Refuse figures the simulator cannot run on (a NaN publish, no cores for the control plane):
    with them it never trains a step, and once looped without end."""
    bad = {k: v for k, v in [*((k, getattr(cal, k)) for k in ("decode_a_s", "decode_b_s", "prefill_s_per_token",
                                                               "train_s_per_token", "weight_sync_s", "lend_s",
                                                               "reclaim_s", "bookkeeping_s", "gate_s", "start_s")),
                             ("prompt_tokens", m["prompt_tokens"]), ("gen_tokens", m["gen_tokens"]),
                             ("control_s_per_turn", control[0]), ("latency_s", latency), ("after_s", after)]
           if not (math.isfinite(v) and v >= 0)}
    if control[0] > 0 and not control[1] > 0:
        bad["control_cores"] = control[1]
    if bad:
        raise SystemExit(f"measured figures the simulator cannot run on: {bad}")


def sim_time_limit(m: dict) -> float:
    """Virtual seconds the simulator may take for the live run's steps: 20x the live run's wall time (the
    simulator has been within 2x of it), at least 10 min; without a live time, an hour."""
    wall = m.get("wall_s")
    return max(600.0, 20 * wall) if wall and math.isfinite(wall) else 3600.0


def train_host(m: dict, sims: dict[str, dict]) -> str:
    """Issue 29's fidelity line: trained tok/s and the train host's (host-0's) idle, live (engine logs)
    against each simulator variant."""
    h0 = m["idle_engine_hosts"].get("host-0", math.nan)
    return ("the train host (fidelity: tok/s within 10%, host-0 idle within 10 points): live "
            f"{m['trained_tokens_per_s']:.0f} tok/s, host-0 idle {h0:.1%} (engine logs), {m['lends']} lends; "
            + "; ".join(f"{name} {x['trained_tokens_per_s'] / m['trained_tokens_per_s']:.3f} of live, host-0 idle "
                        f"{x['idle_hosts'].get('host-0', math.nan):.1%} "
                        f"({(x['idle_hosts'].get('host-0', math.nan) - h0) * 100:+.1f} points), {x['lends']} lends"
                        for name, x in sims.items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the comparison (start-up)")
    ap.add_argument("--policy", default="seamless", choices=["colocated", "disaggregated", "seamless"])
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=2.0, help="simulated engine: fixed ms per step")
    ap.add_argument("--per-seq-ms", type=float, default=0.25, help="simulated engine: ms per running request")
    ap.add_argument("--s-per-token", type=float, default=1 / 17_123, help="simulated trainer: seconds per token")
    ap.add_argument("--tokens", type=int, default=int(WL.length_median), help="tokens per reply")
    ap.add_argument("--tick", type=float, default=0.05, help="scheduler tick (live) = simulator dt")
    ap.add_argument("--slots", type=int, default=0, help="concurrent agents (default: admission capacity + 8)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--backlog", default="heartbeat", choices=["heartbeat", "undelivered", "untrained"],
                    help="simulator's admission backlog: heartbeat, as the live trajectory manager counts it since "
                         "session 19 (the consumer's pending and what the trainer's last status says it holds: "
                         "complete groups and the batch in hand); untrained, every completed session not trained "
                         "(this bench's default before session 22); undelivered, as the live count was before session 19")
    ap.add_argument("--route", default="least_loaded", choices=["least_loaded", "refill"],
                    help="simulator's routing of turns: as the live trajectory manager routes, or the default refill")
    ap.add_argument("--switch-s", type=float, default=1.0,
                    help="simulator's lend / reclaim cost where the live run made none of that kind: the live "
                         "scheduler's initial estimate (services/scheduler/config.py), which its policy then read "
                         "all along, as the simulator's policy reads this")
    ap.add_argument("--control-ms", type=float, default=None,
                    help="sim + control: CPU ms per turn outside the engine (default: measured in this live run)")
    ap.add_argument("--control-cores", type=float, default=None,
                    help="sim + control: cores that work shares (default: the cores other processes left free)")
    ap.add_argument("--turn-latency-ms", type=float, default=None,
                    help="sim + latency: wall ms per turn outside the engine (default: measured in this live run)")
    ap.add_argument("--split-latency-ms", default=None, metavar="BEFORE,AFTER",
                    help="sim + split latency: wall ms per turn outside the engine before and after it "
                         "(default: measured in this live run)")
    ap.add_argument("--engine-speed", default="measured", choices=["measured", "nominal"],
                    help="the simulator's engine step: as measured live (each request's time in its engine over its "
                         "nominal steps: engine_slowdown), or as configured (--step-ms, --per-seq-ms)")
    ap.add_argument("--trainer-overhead", default="measured", choices=["measured", "none"],
                    help="the simulator's trainer: with the live trainer's own time per step outside compute, publish, "
                         "data and reclaim (trainer_overhead: Calibration.bookkeeping_s, gate_s, start_s), or without it")
    ap.add_argument("--replay", type=Path, default=None, metavar="JSON",
                    help="no live run: the simulator side again on a saved run's live figures (its --out JSON)")
    ap.add_argument("--pin", action="store_true",
                    help="each host its own CPU set for its worker and trainer rank, the control plane the rest "
                         "(seamlessflow up --pin)")
    ap.add_argument("--latency-cv", type=float, default=None,
                    help="sim + spread: the latency's coefficient of variation from turn to turn (default: measured)")
    ap.add_argument("--out", type=Path, default=Path("var/bench/pipeline_live.json"))
    ap.add_argument("--model", type=lambda s: Path(s).resolve(), help="a checkpoint directory (default: the tiny model, built in a temp dir)")
    a = ap.parse_args(argv)
    if not 0 <= a.warmup < a.steps:  # else no step is compared: found only after the live run, minutes later
        ap.error(f"--warmup {a.warmup} must be at least 0 and below --steps {a.steps} (default --warmup 4)")
    return a


def save(a, doc: dict) -> None:
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}} | doc, indent=1))


def live_or_replay(a) -> dict:
    """The live figures: a live run's (saved at once, should a simulator run fail), or --replay's."""
    if a.replay:
        return json.loads(a.replay.read_text())["live"]
    m = live(a, Path(tempfile.mkdtemp(prefix="sf-live-")))
    save(a, {"live": m})
    return m


def print_overhead(a, m: dict) -> None:
    o = {k: math.nan for k in ("bookkeeping_s", "gate_s", "start_s", "gap_s", "wait_s", "gate_wait_s", "reclaim_s")} | (
        m.get("trainer_overhead") or {"steps": 0})
    if o["steps"]:
        print(f"the trainer's own time per step (the simulator's: {a.trainer_overhead}), over {o['steps']} steps: "
              f"bookkeeping {o['bookkeeping_s'] * 1000:.1f} ms (train), gate {o['gate_s'] * 1000:.1f} ms (idle), "
              f"start {o['start_s'] * 1000:.1f} ms (train); of a gap audit -> next compute of {o['gap_s'] * 1000:.1f} "
              f"ms: data wait {o['wait_s'] * 1000:.1f}, gate as logged {o['gate_wait_s'] * 1000:.1f}, of it reclaim "
              f"{o['reclaim_s'] * 1000:.1f} (as the simulator charges it)")


def main() -> None:
    a = parse_args()
    a.slots = a.slots or (WL.max_staleness + 1) * WL.batch_samples + 8
    m = live_or_replay(a)
    tmp = Path(m["tmp"])
    s = simulated(a, m)
    control = (a.control_ms / 1000 if a.control_ms is not None else m["control_s_per_turn"],
               a.control_cores if a.control_cores is not None else m["free_cores"])
    c = simulated(a, m, control)
    latency = a.turn_latency_ms / 1000 if a.turn_latency_ms is not None else m["turn_latency_s"]
    lt = simulated(a, m, latency=latency)
    sp = m["split_latency"]
    before, after = ([float(x) / 1000 for x in a.split_latency_ms.split(",")] if a.split_latency_ms
                     else [sp["before_s"], sp["after_s"]])
    if not (math.isfinite(before) and math.isfinite(after)):
        raise SystemExit(f"no agent turn paired with an engine request ({sp}); see {tmp}")
    st = simulated(a, m, latency=before, after=after)
    cv = a.latency_cv if a.latency_cv is not None else sp["cv"]
    sv = simulated(a, m, latency=before, after=after, cv=cv)
    # sim idle over live idle, against both live figures (heartbeat timeline, engine logs)
    ratios = {name: {"idle_heartbeats": x["idle"] / m["idle"] if m["idle"] else float("nan"),
                     "idle_engine": x["idle"] / m["idle_engine"] if m["idle_engine"] else float("nan")}
              for name, x in (("sim", s), ("sim_control", c), ("sim_latency", lt), ("sim_split", st), ("sim_spread", sv))}
    save(a, {"live": m, "sim": s, "sim_control": c, "sim_latency": lt, "sim_split": st, "sim_spread": sv,
             "idle_ratios": ratios})
    print(f"\nSIMULATED engines and trainer, {a.hosts} hosts, {a.policy}, steps {a.warmup + 1}-{a.steps} "
          f"(engine {a.step_ms} ms + {a.per_seq_ms} ms/request, capacity {a.capacity}); measured live: "
          f"lend p50 {m['lend_s']}, reclaim p50 {m['reclaim_s']}, publish {m['publish_s']:.3f} s, "
          f"train {1 / m['train_s_per_token']:.0f} tok/s, prompt {m['prompt_tokens']:.1f} tok, engine step "
          f"{m['engine_slowdown']:.3f} x nominal (the simulator's: {a.engine_speed})")
    print(f"control plane (sim + control): {control[0] * 1000:.1f} ms of CPU per turn on {control[1]:.2f} cores "
          f"(measured live: {m['control_s_per_turn'] * 1000:.1f} ms per turn; {m['free_cores']:.2f} of "
          f"{m['cores']} cores left by other processes, the machine busy {m['machine_busy_cores']:.2f})")
    print_overhead(a, m)
    p = m["agent_parts"]
    print(f"latency outside the engine (sim + latency): {latency * 1000:.1f} ms per turn (measured live: "
          f"{m['turn_latency_s'] * 1000:.1f} ms = agents {m['agent_turn_s'] * 1000:.1f} ms per turn over "
          f"{m['agent_turns']} turns (open {p['open_s'] * 1000:.1f}, chat {p['chat_s'] * 1000:.1f}, finish "
          f"{p['finish_s'] * 1000:.1f}) - engine {m['engine_turn_s'] * 1000:.1f} ms over {m['engine_turns']} requests)")
    print(f"split (sim + split latency): before {before * 1000:.1f} ms, after {after * 1000:.1f} ms per turn (measured "
          f"live, turn by turn over {sp['turns']} paired turns: before {sp['before_s'] * 1000:.1f} + engine "
          f"{sp['engine_s'] * 1000:.1f} + after {sp['after_s'] * 1000:.1f} ms)")
    print("\n| | live | simulator | sim / live | sim + control | / live | sim + latency | / live "
          "| sim + split latency | / live |\n|---|---|---|---|---|---|---|---|---|---|")
    for key, fmt in (("trained_tokens_per_s", "{:.0f}"), ("idle", "{:.1%}"), ("window_s", "{:.2f}"),
                     ("wall_s", "{:.2f}")):
        r = [x[key] / m[key] if m[key] else float("nan") for x in (s, c, lt, st)]
        label = "idle live (heartbeats)" if key == "idle" else key
        print(f"| {label} | {fmt.format(m[key])} | {fmt.format(s[key])} | {r[0]:.3f} | {fmt.format(c[key])} | {r[1]:.3f} "
              f"| {fmt.format(lt[key])} | {r[2]:.3f} | {fmt.format(st[key])} | {r[3]:.3f} |")
        if key == "idle":
            r = [ratios[n]["idle_engine"] for n in ("sim", "sim_control", "sim_latency", "sim_split")]
            print(f"| idle live (engine logs) | {m['idle_engine']:.1%} | {s['idle']:.1%} | {r[0]:.3f} | {c['idle']:.1%} "
                  f"| {r[1]:.3f} | {lt['idle']:.1%} | {r[2]:.3f} | {st['idle']:.1%} | {r[3]:.3f} |")
    for act in ("train", "rollout", "switch"):
        print(f"| {act} fraction | {m['fractions'][act]:.1%} | {s['fractions'][act]:.1%} | | "
              f"{c['fractions'][act]:.1%} | | {lt['fractions'][act]:.1%} | | {st['fractions'][act]:.1%} | |")
    print(f"| lends / reclaims | {m['lends']} / {m['reclaims']} | {s['lends']} / {s['reclaims']} | | "
          f"{c['lends']} / {c['reclaims']} | | {lt['lends']} / {lt['reclaims']} | | {st['lends']} / {st['reclaims']} | |")
    print("idle per host, live heartbeats / live engine logs / simulator / sim + latency / sim + split latency: "
          + ", ".join(f"{k} {m['idle_hosts'][k]:.1%} / {v:.1%} / {s['idle_hosts'].get(k, float('nan')):.1%} / "
                      f"{lt['idle_hosts'].get(k, float('nan')):.1%} / {st['idle_hosts'].get(k, float('nan')):.1%}"
                      for k, v in sorted(m["idle_engine_hosts"].items())))
    print(f"sim + split latency + spread (each turn's latency drawn, cv {cv:.2f}; measured {sp['cv']:.2f}): trained "
          f"tok/s {sv['trained_tokens_per_s']:.0f} ({sv['trained_tokens_per_s'] / m['trained_tokens_per_s']:.3f} of live), "
          f"idle {sv['idle']:.1%} ({ratios['sim_spread']['idle_engine']:.3f} of the engine logs' idle, "
          f"{ratios['sim_spread']['idle_heartbeats']:.3f} of the heartbeats'), lends / reclaims {sv['lends']} / "
          f"{sv['reclaims']}; idle per host " + ", ".join(f"{k} {v:.1%}" for k, v in sorted(sv["idle_hosts"].items())))
    print(train_host(m, {"simulator": s, "sim + split latency": st, "sim + spread": sv}))
    busy = sorted(m["cpu_core_share"].items(), key=lambda kv: -kv[1])
    print("\nlive CPU (share of one core; host-N with its worker) over the run: "
          + ", ".join(f"{k} {v:.2f}" for k, v in busy)
          + f"; {m['turns_per_s']:.1f} turns/s; machine load average {m['machine_load']} on {m['cores']} cores")
    for name, x in (("simulator", s), ("sim + control", c), ("sim + latency", lt), ("sim + split latency", st)):
        print(f"live wall-clock overrun over the {name}: {m['window_s'] / x['window_s'] - 1:+.1%} over the compared "
              f"steps, {m['wall_s'] / x['wall_s'] - 1:+.1%} from the start")
    print(f"failed turns {m['failures']}; wrote {a.out}")

if __name__ == "__main__":
    main()
