"""Control-plane cost of the live scheduler at 64 hosts: decisions per second, assignment-to-applied
latency, and the scheduler process's CPU.

    .venv/bin/python bench/scheduler_scale.py [--hosts 64] [--train-hosts 16] [--seconds 60] [--period 2]

Real: NATS (JetStream), Redis, the scheduler process (`python -m services.scheduler`, policy
colocated) and `--hosts` HostAgent objects (services/scheduler/host.py), all in this one
process (64 agent processes would not fit two shared cores; each agent still has its own NATS
connection, heartbeat task and apply loop). The agents run no worker (no SF_HOST_MODEL), so
applying an assignment is the agent's bookkeeping and its HostModeChanged alone: what is
measured is the control plane, not a switch. A stand-in trainer (SIMULATED: no training)
publishes TrainerStatus, flipping between `ready` and `waiting` every --period seconds; under
colocated every flip moves every host (train pool: train/rollout, the rest: idle/rollout).

Reported: HostAssignments issued per second (mean over the run, and within a flip's burst,
as received here),
the time from a flip to the last host applied (the trainer heartbeat's arrival and the
0.2 s tick included), assignment-to-applied latency (HostAssignment
issued_at -> HostModeChanged t_end, both stamped by this machine's clock) p50/p95/max, and the
scheduler's CPU (utime + stime from /proc) as a share of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seamlessflow.stack import servers  # noqa: E402
from services.scheduler import policy  # noqa: E402
from services.scheduler.config import load_host  # noqa: E402
from services.scheduler.host import HostAgent  # noqa: E402
from shared import bus, subjects  # noqa: E402
from shared.codec import decode, encode  # noqa: E402
from shared.config import connections  # noqa: E402
from shared.messages.scheduler import HostAssignment, HostModeChanged, TrainerStatus  # noqa: E402


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def flip(trainer, t0: float, seconds: float, period: float) -> list[float]:
    """The trainer's state flipped between ready and waiting every `period` s until `seconds` after t0,
    its heartbeat sent meanwhile as TrainerService sends it; when each flip was made."""
    flips: list[float] = []
    state = "waiting"
    while time.time() - t0 < seconds:
        state = "ready" if state == "waiting" else "waiting"
        flips.append(time.time())
        end = time.time() + period
        while time.time() < end:  # the trainer's heartbeat, as TrainerService sends it
            await trainer(state)
            await asyncio.sleep(min(1.0, end - time.time()))
    return flips


def bursts_and_spans(flips: list[float], t1: float, issued: dict, seen: dict, applied: dict) -> tuple[list, list]:
    """Per flip: the rate its assignments reached this process at (with more than one), and the
    seconds until the last of them was applied."""
    bursts, spans = [], []
    for f, g in zip(flips, flips[1:] + [t1]):
        ts = sorted(seen[k] for k, v in issued.items() if f <= v < g)
        done = [applied[k] for k, v in issued.items() if f <= v < g and k in applied]
        if len(ts) > 1:
            bursts.append(len(ts) / max(ts[-1] - ts[0], 1e-3))
        if done:
            spans.append(max(done) - f)
    return bursts, spans


def decide_rate(n_hosts: int, train_hosts: int) -> int:
    """The policy's own cost per decision at this size, outside any I/O: decide calls per second."""
    hosts = tuple(policy.Host(f"h{i:03d}", frozenset({"train", "rollout"} if i < train_hosts else {"rollout"}),
                              mode="rollout", target="rollout") for i in range(n_hosts))
    snap = policy.Snapshot("colocated", 0.0, hosts, policy.Trainer("ready"))
    n, c0 = 0, time.perf_counter()
    while time.perf_counter() - c0 < 0.5:
        policy.decide(snap)
        n += 1
    return round(n / (time.perf_counter() - c0))


async def measure(a, conn, sched_pid: int) -> dict:
    quit = asyncio.Event()
    agents = [HostAgent(load_host(id=f"h{i:03d}", tags="train,rollout" if i < a.train_hosts else "rollout"), conn)
              for i in range(a.hosts)]
    tasks = [asyncio.create_task(ag.run(quit)) for ag in agents]
    nc = await bus.connect(conn, name="bench-scale")
    issued: dict[tuple[str, int], float] = {}
    seen: dict[tuple[str, int], float] = {}  # when this process received it (a burst's publish rate)
    applied: dict[tuple[str, int], float] = {}

    async def on_assign(msg):
        x = decode(msg.data, HostAssignment)
        issued[(x.host, x.epoch)] = x.issued_at
        seen[(x.host, x.epoch)] = time.time()

    async def on_changed(msg):
        x = decode(msg.data, HostModeChanged)
        if x.ok:
            applied[(x.host, x.epoch)] = x.t_end

    await nc.subscribe(f"{subjects.SCHED_ASSIGN_PREFIX}.*", cb=on_assign)
    await nc.subscribe(subjects.SCHED_CHANGED, cb=on_changed)

    async def trainer(state: str) -> None:
        await nc.publish(subjects.TRAINER_STATUS, encode(TrainerStatus(state, 0, 0, 0, 0, 0, 4, 8, 0.0, 0.0,
                                                                       time.time())))

    # settle: every agent registered and placed
    await trainer("waiting")
    t_settle = time.time()
    while len({h for h, _ in applied}) < a.hosts and time.time() - t_settle < 60:
        await trainer("waiting")
        await asyncio.sleep(0.5)
    issued.clear()
    applied.clear()
    seen.clear()
    cpu0, t0 = cpu_s(sched_pid), time.time()
    flips = await flip(trainer, t0, a.seconds, a.period)
    t1, cpu1 = time.time(), cpu_s(sched_pid)
    await asyncio.sleep(1.0)
    quit.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await bus.wait_closed(nc)

    lat = [applied[k] - issued[k] for k in issued if k in applied]
    bursts, spans = bursts_and_spans(flips, t1, issued, seen, applied)
    decide_per_s = decide_rate(a.hosts, a.train_hosts)
    return {"hosts": a.hosts, "seconds": round(t1 - t0, 1), "flips": len(flips), "assignments": len(issued),
            "applied": len(lat), "assignments_per_s": round(len(issued) / (t1 - t0), 1),
            "burst_assignments_per_s": round(statistics.median(bursts), 1) if bursts else None,
            "flip_to_all_applied_s_p50": round(statistics.median(spans), 3) if spans else None,
            "flip_to_all_applied_s_max": round(max(spans), 3) if spans else None,
            "latency_ms_p50": round(1000 * pct(lat, 0.5), 1), "latency_ms_p95": round(1000 * pct(lat, 0.95), 1),
            "latency_ms_max": round(1000 * max(lat), 1) if lat else None,
            "scheduler_cpu_core_share": round((cpu1 - cpu0) / (t1 - t0), 3),
            "decide_calls_per_s_64_hosts": decide_per_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--train-hosts", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--period", type=float, default=2.0, help="seconds between trainer state flips")
    ap.add_argument("--tick", type=float, default=0.2, help="SF_SCHEDULER_TICK")
    ap.add_argument("--out", type=Path, default=Path("var/bench/scheduler_scale.json"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sf-scale-"))
    nport, rport = servers.free_port(), servers.free_port()
    procs = [servers.start_nats(nport, tmp / "nats", tmp / "nats.log"), servers.start_redis(rport, tmp / "redis")]
    env = {"SF_NATS_URL": f"nats://127.0.0.1:{nport}", "SF_REDIS_URL": f"redis://127.0.0.1:{rport}/0"}
    try:
        log = open(tmp / "scheduler.log", "ab")
        sched = subprocess.Popen([sys.executable, "-m", "services.scheduler"], stdout=log, stderr=subprocess.STDOUT,
                                 env=dict(os.environ) | env | {"SF_SCHEDULER_POLICY": "colocated",
                                                               "SF_SCHEDULER_TICK": str(a.tick)},
                                 start_new_session=True)
        procs.append(sched)
        deadline = time.time() + 60
        while b"scheduler ready" not in (tmp / "scheduler.log").read_bytes():
            if time.time() > deadline or sched.poll() is not None:
                raise SystemExit(f"scheduler did not start; see {tmp / 'scheduler.log'}")
            time.sleep(0.2)
        r = asyncio.run(measure(a, connections(env), sched.pid))
    finally:
        for p in reversed(procs):
            servers.stop(p)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(r, indent=1))
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
