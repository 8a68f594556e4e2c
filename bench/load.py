"""Hundreds of concurrent multi-turn agent sessions against the whole stack: the control plane under load.

    flock /tmp/heavy.lock .venv/bin/python bench/load.py --replicas 1,2 --out /tmp/load.json   # 500 x 2 min each
    .venv/bin/python bench/load.py --sessions 50 --seconds 20 --replicas 1                      # a quick try
    .venv/bin/python bench/load.py --sessions 200 --seconds 30 --replicas 1 --profile DIR       # + cProfile
    flock /tmp/heavy.lock .venv/bin/python bench/load.py --replicas 1,2 --replica-cpu 0.3        # capped replicas (root)

For each trajectory-replica count in `--replicas` (one after the other, each on a fresh stack): the real
gateway, N trajectory managers, NATS (JetStream, file store) and Redis (AOF on), started by
`seamlessflow.stack` on free loopback ports in a temp dir, with `--workers` rollout workers around the
SIMULATED engine (services/rollout/simulated.py: no model; one step = `--step-ms` + 0.25 ms per running
request, `--capacity` requests at once), so that the control plane, not the engines, is the bottleneck.

The load: `--sessions` agents spread over `--procs` generator processes (each its own event loop and one
aiohttp client). An agent creates a session (user key), runs 4-8 turns (`--turns`) of a growing
conversation with the session's key (each turn sends the history and the replies it got back), finishes
the session with a reward, and starts the next, until the run ends; then it finishes the session it has
open. `--warmup` seconds of load come before the `--seconds` measured.

A 429 (a limit of the key, services/gateway/limits.py) is waited out as its Retry-After says (at most
`RETRY_AFTER_MAX` s), then the same request is sent again, up to `RETRIES_429` times, as the openai SDK
does; a turn's latency includes those waits.

Reports, per replica count: turns/s and p50/p99 turn latency in the measured window; 429s over the whole
run by kind (each refused try; expected 0 with the default limits), apart from errors (everything else,
and a request still refused after its last try; expected 0), by kind; Redis `used_memory` after minus before, per finished session; the
JetStream lag of the trainer's durable consumer on TRAJECTORIES (a stand-in trainer in this process acks
each trajectory as it comes, `--no-drain` leaves them pending; num_pending is sampled every second);
and the CPU each process used in the window (/proc schedstat, every thread) as ms per turn and as cores,
the generator's and the whole machine's included, so a saturated box shows as such.
`--profile DIR` runs the gateway and trajectory managers under cProfile (bench/profile_hook) for the
measured window only.

`--replica-cpu CORES` caps each trajectory replica at CORES of CPU (a cgroup quota each, bench/cpu_cap.py;
needs root), so that on a small box a replica, not the machine, is the bottleneck, as when each replica
has a host of its own: a CAPPED EMULATION of that, to show how turns/s scale with replicas. The report
then gives each replica's throttled periods (the kernel's count of how often it hit its cap).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu_cap import CpuCap  # noqa: E402
from bench.gateway_overhead import MODEL_NAME, cpu_seconds, pct, use_profiler  # noqa: E402
from seamlessflow.demo.workload import retry_delay  # noqa: E402

REQUEST_TIMEOUT = 120.0  # seconds: one HTTP call (the gateway's own turn timeouts are shorter)
RETRY_AFTER_MAX = 10.0  # seconds: the longest Retry-After a 429 is waited out for
RETRIES_429 = 5  # tries after a 429 before the request counts as an error (5 x 10 s stays well
                 # within the REQUEST_TIMEOUT + 60 s that the bench waits for a generator's tally)
_enc, _dec = msgspec.json.Encoder(), msgspec.json.Decoder()


# -- pure parts (tests/unit/test_bench_load.py) -----------------------------------------------------

def classify(status: int, body: bytes | None = None, exc: BaseException | None = None) -> str:
    """An error's kind: `http-<status>:<OpenAI error code>`, or the client-side exception's name."""
    if exc is not None:
        return f"client:{type(exc).__name__}"
    code = ""
    try:
        code = (_dec.decode(body or b"{}").get("error") or {}).get("code") or ""
    except (msgspec.DecodeError, AttributeError):
        code = "unparsed"
    return f"http-{status}:{code}" if code else f"http-{status}"


def retry_after(header: str | None) -> float:
    """Seconds to wait before trying a 429'd request again: its Retry-After within [0, RETRY_AFTER_MAX];
    1 s when it has none or one that does not read as seconds (the demo's reading, with bench's bounds)."""
    return retry_delay(header, low=0.0, high=RETRY_AFTER_MAX, default=1.0)


def group(name: str) -> str:
    """Report buckets: every rollout worker and generator process together; each replica alone."""
    for prefix in ("rollout", "gen"):
        if name.startswith(prefix + "-"):
            return "generator" if prefix == "gen" else prefix
    return name


def cpu_table(cpu_s: dict[str, float], turns: int, seconds: float) -> dict[str, dict[str, float]]:
    """{bucket: {ms_per_turn, cores}} from each process's CPU seconds in a window of `seconds`."""
    buckets: dict[str, float] = {}
    for name, s in cpu_s.items():
        buckets[group(name)] = buckets.get(group(name), 0.0) + s
    return {b: {"ms_per_turn": round(1000 * s / max(turns, 1), 3), "cores": round(s / seconds, 3)}
            for b, s in sorted(buckets.items())}


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat: not idle, not iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - fields[3] - fields[4]) / hz, sum(fields) / hz


# -- the load generator (one process each) -----------------------------------------------------------

@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)  # seconds, turns that ended in the window
    turns: int = 0  # turns that ended in the window
    turns_total: int = 0
    sessions_finished: int = 0
    errors: Counter = field(default_factory=Counter)
    limited: Counter = field(default_factory=Counter)  # 429s (each refused try), by kind: not errors
    examples: dict[str, str] = field(default_factory=dict)  # error or 429 kind -> its first message

    def error(self, kind: str, what: str) -> None:
        self.errors[kind] += 1
        self.examples.setdefault(kind, what[:300])

    def refused(self, kind: str, what: str) -> None:
        self.limited[kind] += 1
        self.examples.setdefault(kind, what[:300])

    def as_dict(self) -> dict:
        return {"latencies": self.latencies, "turns": self.turns, "turns_total": self.turns_total,
                "sessions_finished": self.sessions_finished, "errors": dict(self.errors),
                "limited": dict(self.limited), "examples": self.examples}

    def add(self, other: dict) -> None:
        self.latencies += other["latencies"]
        self.turns += other["turns"]
        self.turns_total += other["turns_total"]
        self.sessions_finished += other["sessions_finished"]
        self.errors.update(other["errors"])
        self.limited.update(other.get("limited", {}))
        self.examples = other["examples"] | self.examples


async def _post(http: aiohttp.ClientSession, url: str, key: str, body: dict, tally: Tally,
                retries: int = RETRIES_429) -> dict | None:
    """POST JSON; the decoded answer, or None with the error counted. A 429 is counted apart, waited
    out (`retry_after`) and the same body sent again, at most `retries` times; the 429 after the last
    try counts as an error too."""
    data, what = _enc.encode(body), url.rsplit("/", 1)[-1]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    for attempt in range(retries + 1):
        try:
            async with http.post(url, data=data, headers=headers) as r:
                raw = await r.read()
                if r.status == 200:
                    return _dec.decode(raw)
                kind, text = classify(r.status, raw), f"{what}: {raw.decode(errors='replace')}"
                if r.status != 429:
                    tally.error(kind, text)
                    return None
                tally.refused(kind, text)
                wait = retry_after(r.headers.get("Retry-After"))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            tally.error(classify(0, exc=e), f"{what}: {e!r}")
            return None
        if attempt < retries:
            await asyncio.sleep(wait)
    tally.error(f"{kind}:after-{retries}-retries", text)
    return None


async def _agent(http: aiohttp.ClientSession, base: str, user_key: str, spec: dict, rng: random.Random,
                 tally: Tally) -> None:
    lo, hi = spec["turns"]
    while time.time() < spec["t_end"]:
        made = await _post(http, f"{base}/sessions", user_key, {"metadata": {"bench": "load"}}, tally)
        if made is None:
            await asyncio.sleep(0.5)
            continue
        sid, key, messages = made["id"], made["api_key"], []
        for t in range(rng.randint(lo, hi)):
            if time.time() >= spec["t_end"]:
                break
            messages.append({"role": "user", "content": f"step {t}: run the tests again and say what failed"})
            t0 = time.perf_counter()
            body = await _post(http, f"{base}/chat/completions", key,
                               {"model": MODEL_NAME, "messages": messages, "max_tokens": spec["max_tokens"],
                                "temperature": 1.0}, tally)
            took, now = time.perf_counter() - t0, time.time()
            if body is None:
                break  # finish what it has
            tally.turns_total += 1
            if spec["t_measure"] <= now <= spec["t_end"]:
                tally.turns += 1
                tally.latencies.append(took)
            messages.append(body["choices"][0]["message"])
        if len(messages) < 2:  # no turn (the run ended, or its first turn failed): nothing to train on
            continue
        if await _post(http, f"{base}/sessions/{sid}/finish", key, {"reward": rng.random()}, tally) is not None:
            tally.sessions_finished += 1


async def _generate(index: int, spec: dict) -> dict:
    tally = Tally()
    rng = random.Random(index)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=spec["agents"] + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await asyncio.sleep(max(0.0, spec["t_start"] - time.time()))
        # agents start spread over the first second, not in one burst of session creations
        await asyncio.gather(*(_start_later(i / spec["agents"], _agent(http, spec["base"], spec["user_key"], spec,
                                                                         rng, tally))
                               for i in range(spec["agents"])))
    return tally.as_dict()


async def _start_later(delay: float, coro) -> None:
    await asyncio.sleep(delay)
    await coro


def generator(index: int, spec: dict, out: mp.Queue) -> None:
    """One generator process: its share of the agents on its own event loop."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    out.put(asyncio.run(_generate(index, spec)))


# -- one run: a stack, the load, the measurements ---------------------------------------------------

async def _consumer_lag(stack, drain: bool, stop: asyncio.Event, samples: list[int]) -> dict:
    """The trainer's durable consumer on TRAJECTORIES, as the trainer declares it; with `drain`, a stand-in
    trainer acks each trajectory at once. num_pending sampled every second until `stop`."""
    from shared import bus, subjects
    from shared.config import Connections

    nc = await bus.connect(Connections(nats_url=stack.nats_url), name="bench-load")
    js = nc.jetstream()
    await js.add_consumer(subjects.TRAJECTORIES_STREAM, subjects.trainer_consumer(subjects.TRAINER_DURABLE, 64))
    sub = await js.pull_subscribe(subjects.TRAJ_COMPLETED, durable=subjects.TRAINER_DURABLE,
                                  stream=subjects.TRAJECTORIES_STREAM)
    acked = 0

    async def consume() -> None:
        nonlocal acked
        while True:
            try:
                msgs = await sub.fetch(256, timeout=0.5)
            except asyncio.TimeoutError:
                continue
            for m in msgs:
                await m.ack()
            acked += len(msgs)

    drainer = asyncio.create_task(consume()) if drain else None
    while not stop.is_set():
        samples.append(int((await js.consumer_info(subjects.TRAJECTORIES_STREAM, subjects.TRAINER_DURABLE)).num_pending))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
    await asyncio.sleep(2.0)  # the last finishes' publications and acks
    info = await js.consumer_info(subjects.TRAJECTORIES_STREAM, subjects.TRAINER_DURABLE)
    stream = await js.stream_info(subjects.TRAJECTORIES_STREAM)
    if drainer:
        drainer.cancel()
        await asyncio.gather(drainer, return_exceptions=True)
    await sub.unsubscribe()
    await bus.wait_closed(nc)
    return {"final_num_pending": int(info.num_pending), "final_ack_pending": int(info.num_ack_pending),
            "acked": acked, "stream_messages": int(stream.state.messages)}


def _redis_memory(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def _profiling(pids: list[int], on: bool) -> None:
    if os.environ.get("SF_PROFILE_DIR"):
        for pid in pids:
            os.kill(pid, signal.SIGUSR1 if on else signal.SIGUSR2)


def start_stack(replicas: int, code: str, model: Path, tmp: Path, args):
    from seamlessflow.stack import Stack, StackOptions, servers
    from tests.integration.stack_fixture import simulated_worker_cmd

    hook = [str(ROOT / "bench" / "profile_hook")] if args.profile else []
    path = os.pathsep.join(hook + ([code] if code else []) + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    opts = StackOptions(model=model, data_dir=Path(tempfile.mkdtemp(prefix=f"replicas{replicas}-", dir=tmp)),
                        workers=args.workers,
                        trajectory_replicas=replicas, gateway_port=servers.free_port(),
                        admin_port=servers.free_port(), nats_port=servers.free_port(),
                        redis_port=servers.free_port(), max_model_len=2048, max_num_seqs=args.capacity,
                        extra_env={"PYTHONPATH": path} if path else {},
                        worker_cmd=simulated_worker_cmd(step_ms=args.step_ms, capacity=args.capacity))
    stack = Stack(opts)
    stack.start()
    return stack


def run_one(replicas: int, code: str, model: Path, tmp: Path, args) -> dict:
    stack = start_stack(replicas, code, model, tmp, args)
    procs: list = []
    caps: dict[str, CpuCap] = {}
    try:
        if args.replica_cpu:  # each replica in a cgroup of its own, capped at --replica-cpu cores
            for p in stack.procs:
                if p.name.startswith("trajectory-"):
                    caps[p.name] = CpuCap(f"sf-load-{os.getpid()}-{p.name}", args.replica_cpu).__enter__()
                    caps[p.name].add(p.popen.pid)
        return {"code": code or ".", "replica_cpu": args.replica_cpu} | asyncio.run(
            _measure(stack, replicas, procs, args, caps))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        stack.stop()
        for cap in caps.values():
            cap.__exit__(None, None, None)


async def _measure(stack, replicas: int, procs: list, args, caps: dict[str, CpuCap]) -> dict:
    pids = {p.name: p.popen.pid for p in stack.procs}
    mem0 = _redis_memory(stack.redis_url)
    t_start = time.time() + 3.0  # the generators import and connect meanwhile
    spec = {"base": stack.gateway_url, "user_key": stack.api_key, "turns": args.turns, "max_tokens": args.max_tokens,
            "t_start": t_start, "t_measure": t_start + args.warmup, "t_end": t_start + args.warmup + args.seconds}
    out = mp.get_context("spawn").Queue()
    shares = [args.sessions // args.procs + (i < args.sessions % args.procs) for i in range(args.procs)]
    for i, n in enumerate(shares):
        procs.append(mp.get_context("spawn").Process(target=generator, args=(i, spec | {"agents": n}, out),
                                                     name=f"gen-{i}", daemon=True))
        procs[-1].start()
        pids[f"gen-{i}"] = procs[-1].pid
    pids["bench"] = os.getpid()  # this process: the stand-in trainer and the sampling
    stop, lag = asyncio.Event(), []
    lag_task = asyncio.create_task(_consumer_lag(stack, not args.no_drain, stop, lag))
    profiled = [pid for n, pid in pids.items() if n == "gateway" or n.startswith("trajectory-")]

    await asyncio.sleep(spec["t_measure"] - time.time())
    _profiling(profiled, True)
    cpu0, busy0, load0 = {n: cpu_seconds(p) for n, p in pids.items()}, machine_busy(), os.getloadavg()
    throttled0 = {n: c.throttled() for n, c in caps.items()}
    lag.clear()  # the window's samples only
    await asyncio.sleep(spec["t_end"] - time.time())
    cpu1, busy1 = {n: cpu_seconds(p) for n, p in pids.items()}, machine_busy()
    throttled = {n: {k: v - throttled0[n][k] for k, v in c.throttled().items()} for n, c in caps.items()}
    _profiling(profiled, False)
    window_lag = list(lag)

    tally = Tally()
    for _ in procs:  # every agent finishes its open session, then its process answers
        tally.add(await asyncio.get_running_loop().run_in_executor(None, out.get, True, REQUEST_TIMEOUT + 60))
    for p in procs:
        p.join(10)
    stop.set()
    consumer = await lag_task
    mem1 = _redis_memory(stack.redis_url)

    seconds = args.seconds
    lat_ms = [1000 * x for x in tally.latencies]
    row = {
        "replicas": replicas, "sessions": args.sessions, "seconds": seconds, "turns": tally.turns,
        "turns_per_s": round(tally.turns / seconds, 1),
        "p50_ms": round(pct(lat_ms, 0.5), 1) if lat_ms else None,
        "p99_ms": round(pct(lat_ms, 0.99), 1) if lat_ms else None,
        "turns_total": tally.turns_total, "sessions_finished": tally.sessions_finished,
        "errors": dict(tally.errors), "error_count": sum(tally.errors.values()),
        "rate_limited": dict(tally.limited), "rate_limited_count": sum(tally.limited.values()),
        "error_examples": tally.examples,
        "redis_bytes_per_session": round((mem1 - mem0) / max(tally.sessions_finished, 1)),
        "redis_used_memory_before_after": [mem0, mem1],
        "consumer": {**consumer, "drained": not args.no_drain,
                     "window_num_pending_max": max(window_lag, default=0),
                     "window_num_pending_p50": pct(window_lag, 0.5) if window_lag else 0},
        "cpu": cpu_table({n: cpu1[n] - cpu0[n] for n in pids}, tally.turns, seconds),
        "machine_busy_cores": round((busy1[0] - busy0[0]) / seconds, 2),
        "machine_cores": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in load0],
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "replica_throttled": throttled,  # with --replica-cpu: periods, throttled periods, µs, in the window
    }
    print(json.dumps(row), flush=True)
    return row


def print_table(rows: list[dict]) -> None:
    buckets = sorted({b for r in rows for b in r["cpu"]}, key=lambda b: (b == "bench", b == "generator", b))
    print("\n| code | replicas | turns/s | p50 / p99 ms | errors | 429s | Redis B / session | consumer lag max (final) "
          "| machine busy cores | " + " | ".join(buckets) + " |")
    print("|---" * (9 + len(buckets)) + "|")
    for r in rows:
        cells = [f"{r['cpu'][b]['ms_per_turn']} ms ({r['cpu'][b]['cores']})" if b in r["cpu"] else "" for b in buckets]
        c = r["consumer"]
        code = r["code"] + (f" (each replica capped at {r['replica_cpu']} core)" if r.get("replica_cpu") else "")
        print(f"| {code} | {r['replicas']} | {r['turns_per_s']} | {r['p50_ms']} / {r['p99_ms']} | {r['error_count']} "
              f"| {r['rate_limited_count']} | {r['redis_bytes_per_session']} | {c['window_num_pending_max']} ({c['final_num_pending']}) "
              f"| {r['machine_busy_cores']} / {r['machine_cores']} | " + " | ".join(cells) + " |")
    print("(CPU cells: ms per turn (cores) in the measured window)")
    for r in rows:
        if r["errors"] or r["rate_limited"]:
            print(f"errors with {r['replicas']} replica(s): {r['errors']}; 429s: {r['rate_limited']}; "
                  f"first of each: {r['error_examples']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=500, help="concurrent agent sessions")
    ap.add_argument("--seconds", type=float, default=120.0, help="the measured window")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the window")
    ap.add_argument("--turns", type=lambda s: tuple(int(x) for x in s.split("-")) * (1 + ("-" not in s)),
                    default=(4, 8), help="turns per session, LO-HI (uniform) or N")
    ap.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                    help="trajectory-replica counts, one fresh stack each")
    ap.add_argument("--procs", type=int, default=4, help="load-generator processes")
    ap.add_argument("--workers", type=int, default=2, help="rollout workers (simulated engines)")
    ap.add_argument("--capacity", type=int, default=256, help="requests each simulated engine runs at once")
    ap.add_argument("--step-ms", type=float, default=2.0, help="the simulated engine's step (+0.25 ms per request)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--replica-cpu", type=float, default=0.0, metavar="CORES",
                    help="cap each trajectory replica at CORES of CPU (a cgroup quota; root): a capped emulation "
                    "of a host per replica (0: no cap)")
    ap.add_argument("--no-drain", action="store_true", help="no stand-in trainer: trajectories stay pending")
    ap.add_argument("--profile", metavar="DIR", help="cProfile the gateway and trajectory managers into DIR")
    ap.add_argument("--code", help="comma-separated checkouts whose services/ and shared/ to run, one stack "
                    "each, one after the other (default: this one)")
    ap.add_argument("--keep", action="store_true", help="keep the stacks' data dirs (their logs) in /tmp")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--model", type=lambda s: Path(s).resolve(), help="a checkpoint directory (default: the tiny model, built in a temp dir)")
    args = ap.parse_args()

    from seamlessflow.modelgen import init_model

    if args.profile:
        use_profiler(args.profile)
    tmp = Path(tempfile.mkdtemp(prefix="sf-load-"))
    model = args.model or init_model(tmp / "model")
    engine = {"workers": args.workers, "capacity": args.capacity, "step_ms": args.step_ms, "per_seq_ms": 0.25,
              "max_tokens": args.max_tokens}
    # each checkout as an absolute path, before the working directory changes
    codes = [str(Path(c).resolve()) for c in args.code.split(",")] if args.code else [""]
    if args.code:
        os.chdir(tmp)  # `python -m` puts the working directory first on sys.path: keep it neutral
    try:
        rows = [run_one(n, code, model, tmp, args) for n in args.replicas for code in codes]
    finally:
        if args.keep:
            print(f"kept {tmp} (each stack: replicasN-*/logs/)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"},
                                        "engine": engine, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
