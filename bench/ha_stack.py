"""The whole stack's turns/s and per-turn latency with R1 and R3 streams, with and without Redis WAIT
(issue 30), side by side in one run. bench/ha_costs.py measures the same choices per operation; this
measures what an agent sees.

    flock /tmp/heavy.lock nice -n 19 .venv/bin/python -m bench.ha_stack            # 4 rounds x 4 x 20 s
    .venv/bin/python -m bench.ha_stack --rounds 1 --seconds 2 --warmup 1 --lanes 1  # a quick try

Four configurations, each a stack of its own, all running at once on this machine:

    R1, no WAIT    SF_JETSTREAM_REPLICAS=1   SF_TRAJECTORY_REDIS_WAIT_REPLICAS=0  (the baseline)
    R1, WAIT 1     SF_JETSTREAM_REPLICAS=1   SF_TRAJECTORY_REDIS_WAIT_REPLICAS=1
    R3, no WAIT    SF_JETSTREAM_REPLICAS=3   SF_TRAJECTORY_REDIS_WAIT_REPLICAS=0
    R3, WAIT 1     SF_JETSTREAM_REPLICAS=3   SF_TRAJECTORY_REDIS_WAIT_REPLICAS=1

Each has a fresh 3-server JetStream cluster of its own (seamlessflow/stack/servers.py NatsCluster), so
its services create every stream at its replica count (an existing stream keeps the replicas it was
made with; R1 streams live on one server of the cluster); the run reads TRAJECTORIES' replicas back
from each cluster and refuses to measure if one differs. All four share one Redis primary + 1 replica
+ 3 sentinels (RedisSentinels), each on a database of its own, reached through the redis+sentinel://
URL. On top: the real stack (seamlessflow.stack: gateway, 1 trajectory manager, `--workers` rollout
workers), given the servers as external ones (`up --nats-url --redis-url`), with the SIMULATED engine
in each rollout worker (services/rollout/simulated.py: no model, `--step-ms` a step, so the control
and data planes, not an engine, are measured). A stand-in trainer in this process acks every
trajectory on the trainer's durable consumer of each stack (acks on an R3 stream are replicated too).

The load: `--lanes` GRPO groups of `--group-size` openai-SDK agents in flight (seamlessflow/demo/
workload.py GroupAgents: 16 agents by default), each session `--turns` non-streamed turns of 1 to
`--max-tokens` tokens, then a finish with a reward. Rounds alternate the configurations (their order
rotates each round) so the drift of a shared, busy machine falls on all four; in each round each
configuration gets `--warmup` s of load, then `--seconds` s measured: turns that ended in the window,
their latency (the SDK call, HTTP included). The three idle stacks run meanwhile (heartbeats only).

Reports per configuration: turns/s and p50/p99 over all rounds, each round's turns/s, the ratios to
"R1, no WAIT" (of the pooled figures, and the median of the per-round ratios), failed turns, and
whether any WAIT timed out short of its replica (the trajectory manager logs that once per cause:
"acknowledged anyway"). Local processes on one machine, no network between servers: the floor of
the cost, not a cluster's. `--out FILE` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import pct
from seamlessflow.demo.workload import GroupAgents, Load
from seamlessflow.stack import Stack, StackOptions, servers
from shared import bus, subjects
from shared.config import Connections


@dataclass(frozen=True)
class Config:
    name: str
    replicas: int  # SF_JETSTREAM_REPLICAS
    wait: int  # SF_TRAJECTORY_REDIS_WAIT_REPLICAS


CONFIGS = (Config("R1, no WAIT", 1, 0), Config("R1, WAIT 1", 1, 1),
           Config("R3, no WAIT", 3, 0), Config("R3, WAIT 1", 3, 1))
BASELINE = CONFIGS[0].name
WAIT_TIMED_OUT = "acknowledged anyway"  # services/trajectory/store.py: a WAIT short of its replicas


# -- pure parts (tests/unit/test_bench_ha_stack.py) ---------------------------------------------------

def order(round_no: int, names: list[str]) -> list[str]:
    """Round k runs the configurations rotated by k: each takes each place in the order once per len(names) rounds."""
    k = round_no % len(names)
    return names[k:] + names[:k]


def in_window(latencies: list[tuple[float, float]], start: float, end: float) -> list[float]:
    """Seconds of each turn (start, seconds) that ended within [start, end]."""
    return [d for s, d in latencies if start <= s + d <= end]


def with_db(sentinel_url: str, db: int) -> str:
    """`redis+sentinel://HOSTS/SERVICE/0` -> the same service's database `db`."""
    head, _, _ = sentinel_url.rpartition("/")
    return f"{head}/{db}"


@dataclass
class Tally:
    turns: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    per_round: list[float] = field(default_factory=list)  # turns/s of each round
    failures: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, lat_s: list[float], seconds: float, failures: list[str]) -> None:
        self.turns += len(lat_s)
        self.seconds += seconds
        self.latencies_ms += [1000 * x for x in lat_s]
        self.per_round.append(len(lat_s) / seconds)
        self.failures += len(failures)
        self.examples += failures[:2]

    def row(self) -> dict:
        lat = self.latencies_ms
        return {"turns": self.turns, "turns_per_s": round(self.turns / self.seconds, 2) if self.seconds else 0.0,
                "p50_ms": round(pct(lat, 0.5), 1) if lat else None, "p99_ms": round(pct(lat, 0.99), 1) if lat else None,
                "per_round_turns_per_s": [round(x, 2) for x in self.per_round], "failed_turns": self.failures,
                "failure_examples": self.examples[:3]}


def ratios(rows: dict[str, dict], per_round: dict[str, list[float]], base: str = BASELINE) -> dict[str, dict]:
    """Each configuration against `base`: turns/s, p50 and p99 of the pooled figures, and the median of
    the per-round turns/s ratios (the rounds are side by side: one round's drift cancels in its ratio)."""
    b = rows[base]
    out = {}
    for name, r in rows.items():
        rounds = [x / y for x, y in zip(per_round[name], per_round[base], strict=True) if y]
        out[name] = {"turns_per_s": round(r["turns_per_s"] / b["turns_per_s"], 3) if b["turns_per_s"] else None,
                     "p50": round(r["p50_ms"] / b["p50_ms"], 3) if r["p50_ms"] and b["p50_ms"] else None,
                     "p99": round(r["p99_ms"] / b["p99_ms"], 3) if r["p99_ms"] and b["p99_ms"] else None,
                     "turns_per_s_round_median": round(statistics.median(rounds), 3) if rounds else None}
    return out


# -- the agents -----------------------------------------------------------------------------------------

class Agents(GroupAgents):
    """GroupAgents whose session calls that fail (a 4xx/5xx on create or finish, a dropped connection)
    are counted as failures instead of ending the run."""

    async def session(self, http: httpx.AsyncClient, gid: str) -> None:
        try:
            await super().session(http, gid)
        except (httpx.HTTPError, openai.OpenAIError) as e:
            self.failures.append(f"{gid}: {type(e).__name__}: {e}"[:300])


async def measure(stack: Stack, args, seed: int) -> tuple[list[float], float, list[str]]:
    """`--warmup` s of load, then `--seconds` s measured: (latencies of turns that ended in the window,
    the window's seconds, failures over the whole load)."""
    agents = Agents(stack.gateway_url, stack.api_key,
                    Load(group_size=args.group_size, lanes=args.lanes, seed=seed, min_tokens=1,
                         max_tokens=args.max_tokens, turns=args.turns))
    t0 = time.monotonic()
    start, end = t0 + args.warmup, t0 + args.warmup + args.seconds
    await agents.run(until=lambda: time.monotonic() >= end, timeout=args.warmup + args.seconds + 120)
    return in_window(agents.latencies, start, end), args.seconds, agents.failures


# -- the servers and stacks --------------------------------------------------------------------------

async def stream_replicas(nats_url: str) -> int:
    nc = await bus.connect(Connections(nats_url=nats_url), "bench-ha-stack")
    try:
        info = await nc.jetstream().stream_info(subjects.TRAJECTORIES_STREAM)
        return int(info.config.num_replicas or 1)
    finally:
        await bus.wait_closed(nc)


async def drain(nats_url: str, stop: asyncio.Event) -> int:
    """The stand-in trainer: the trainer's durable consumer on TRAJECTORIES, every message acked at once."""
    nc = await bus.connect(Connections(nats_url=nats_url), "bench-ha-stack-trainer")
    js = nc.jetstream()
    acked, sub = 0, None
    try:
        await js.add_consumer(subjects.TRAJECTORIES_STREAM, subjects.trainer_consumer(subjects.TRAINER_DURABLE, 64))
        sub = await js.pull_subscribe(subjects.TRAJ_COMPLETED, durable=subjects.TRAINER_DURABLE,
                                      stream=subjects.TRAJECTORIES_STREAM)
        while not stop.is_set():
            try:
                msgs = await sub.fetch(256, timeout=0.5)
            except TimeoutError:
                continue
            for m in msgs:
                await m.ack()
            acked += len(msgs)
    finally:
        if sub is not None:  # before the drain: a pull subscription's drain is cancelled, and logged as such
            await sub.unsubscribe()
        await bus.wait_closed(nc)
    return acked


def start_all(tmp: Path, model: Path, redis_url: str, args) -> dict[str, tuple[servers.NatsCluster, Stack]]:
    """A NATS cluster and a stack per configuration, spawned together, then each waited for."""
    from tests.integration.stack_fixture import simulated_worker_cmd

    out: dict[str, tuple[servers.NatsCluster, Stack]] = {}
    try:
        for i, c in enumerate(CONFIGS):
            d = tmp / f"c{i}"
            cluster = servers.NatsCluster(d / "nats", 3, log_dir=d).start()
            opts = StackOptions(model=model, data_dir=d / "stack", workers=args.workers,
                                gateway_port=servers.free_port(), admin_port=servers.free_port(),
                                external_nats=cluster.url, external_redis=with_db(redis_url, i + 1),
                                max_model_len=2048, max_num_seqs=args.capacity, ready_timeout=180,
                                worker_cmd=simulated_worker_cmd(step_ms=args.step_ms, capacity=args.capacity),
                                extra_env={"SF_JETSTREAM_REPLICAS": str(c.replicas),
                                           "SF_TRAJECTORY_REDIS_WAIT_REPLICAS": str(c.wait),
                                           "SF_TRAJECTORY_REDIS_WAIT_MS": str(args.wait_ms)})
            stack = Stack(opts)
            out[c.name] = (cluster, stack)
            stack.start(wait=False)
        for _, stack in out.values():
            for p in stack.procs:
                stack.wait_ready(p)
    except BaseException:
        stop_all(out)
        raise
    return out


def stop_all(running: dict[str, tuple[servers.NatsCluster, Stack]]) -> None:
    for cluster, stack in running.values():
        stack.stop(timeout=10)
        cluster.stop()


def wait_timeouts(stack: Stack) -> int:
    """Lines of the stack's trajectory logs that say a WAIT fell short (logged once per cause)."""
    return sum(p.read_text(errors="replace").count(WAIT_TIMED_OUT) for p in stack.logs.glob("trajectory-*.log"))


async def run(args) -> dict:
    from seamlessflow.modelgen import init_model

    tmp = Path(tempfile.mkdtemp(prefix="sf-ha-stack-"))
    group = None
    running: dict[str, tuple[servers.NatsCluster, Stack]] = {}
    try:
        model = init_model(tmp / "model")
        group = servers.RedisSentinels(tmp / "redis").start()
        t = time.monotonic()
        running = await asyncio.to_thread(start_all, tmp, model, group.url, args)
        print(f"4 stacks ready in {time.monotonic() - t:.0f} s", flush=True)
        replicas = {name: await stream_replicas(cluster.url) for name, (cluster, _) in running.items()}
        want = {c.name: c.replicas for c in CONFIGS}
        if replicas != want:
            raise SystemExit(f"TRAJECTORIES' replicas are {replicas}, not {want}: not measured")
        stop = asyncio.Event()
        drains = [asyncio.create_task(drain(cluster.url, stop)) for cluster, _ in running.values()]
        tallies = {c.name: Tally() for c in CONFIGS}
        names = [c.name for c in CONFIGS]
        for k in range(args.rounds):
            for name in order(k, names):
                lat, seconds, failures = await measure(running[name][1], args, seed=k)
                tallies[name].add(lat, seconds, failures)
                print(json.dumps({"round": k, "config": name, "turns": len(lat),
                                  "turns_per_s": round(len(lat) / seconds, 2), "failed": len(failures)}), flush=True)
        stop.set()
        acked = await asyncio.gather(*drains)
        rows = {name: t.row() | {"stream_replicas": replicas[name], "wait_timeout_lines": wait_timeouts(running[name][1]),
                                 "trajectories_acked": n}
                for (name, t), n in zip(tallies.items(), acked, strict=True)}
        return {"rows": rows, "ratios": ratios(rows, {n: t.per_round for n, t in tallies.items()})}
    finally:
        stop_all(running)
        if group is not None:
            group.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def print_table(result: dict, args) -> None:
    rows, rel = result["rows"], result["ratios"]
    print(f"\n{args.lanes * args.group_size} openai-SDK agents, {args.turns} turns a session, 1-{args.max_tokens} "
          f"tokens a turn, SIMULATED engines (step {args.step_ms} ms); {args.rounds} alternating rounds of "
          f"{args.seconds:g} s each\n")
    print("| configuration | turns/s | vs R1, no WAIT | p50 ms | p99 ms | p50 / p99 vs R1, no WAIT "
          "| per-round ratio (median) | failed turns | WAIT timed out |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        x = rel[name]
        print(f"| {name} | {r['turns_per_s']} | {x['turns_per_s']} | {r['p50_ms']} | {r['p99_ms']} "
              f"| {x['p50']} / {x['p99']} | {x['turns_per_s_round_median']} | {r['failed_turns']} "
              f"| {'yes' if r['wait_timeout_lines'] else 'no'} |")
    print("per round, turns/s: " + "; ".join(f"{n}: {r['per_round_turns_per_s']}" for n, r in rows.items()))
    for name, r in rows.items():
        if r["failure_examples"]:
            print(f"failures in {name}: {r['failure_examples']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window per configuration per round")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each window")
    ap.add_argument("--lanes", type=int, default=4, help="GRPO groups in flight")
    ap.add_argument("--group-size", type=int, default=4, help="agents (sessions) per group")
    ap.add_argument("--turns", type=int, default=3, help="turns per session")
    ap.add_argument("--max-tokens", type=int, default=8, help="a turn's reply: 1 to this many tokens")
    ap.add_argument("--workers", type=int, default=1, help="rollout workers (SIMULATED engines) per stack")
    ap.add_argument("--capacity", type=int, default=64, help="requests each SIMULATED engine runs at once")
    ap.add_argument("--step-ms", type=float, default=2.0, help="the SIMULATED engine's step")
    ap.add_argument("--wait-ms", type=int, default=100, help="SF_TRAJECTORY_REDIS_WAIT_MS (the default: 100)")
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print_table(result, args)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}} | result, indent=1))


if __name__ == "__main__":
    main()
