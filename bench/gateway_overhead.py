"""What the gateway and trajectory manager add over calling a rollout worker directly.

    .venv/bin/python bench/gateway_overhead.py                      # vLLM-CPU worker, tiny model
    .venv/bin/python bench/gateway_overhead.py --engine simulated   # calibrated simulated engine
    .venv/bin/python bench/gateway_overhead.py --engine simulated --turns 200   # one long session
    .venv/bin/python bench/gateway_overhead.py --engine simulated --profile DIR # + cProfile of both services

Run it from another checkout's root (`cd /tmp/before && .venv/bin/python /work/main/bench/...`)
and the gateway and trajectory manager are that checkout's code (`python -m` imports from the
working directory): how BENCHMARKS.md puts the code before and after a change side by side.

Both paths run in the same process against the same worker, in alternating rounds, with the
same prompt token ids and greedy sampling (so both generate the same tokens):
  direct:  NATS request sf.rollout.gen.<worker>  (Generate -> TokenDelta* -> GenerateDone)
  gateway: HTTP POST /v1/chat/completions with a session key (gateway -> trajectory -> worker),
           one fresh single-turn conversation per request, recorded in Redis as usual.
Reports p50/p99 latency per path at each concurrency, the added latency, and requests/s.
`--engine simulated` swaps vLLM for bench/simulated_engine.py (a calibrated stand-in, for
measuring the gateway's own capacity; never real inference).

`--turns N` measures one growing session instead: turn n sends the n-1 earlier user messages and
replies plus a new user message, and the CPU each turn costs the gateway and the trajectory manager
is reported at turns 10, 50, 100, 200 (the median of the 10 turns ending there, over `--sessions`).
CPU is read from /proc/<pid>/task/*/schedstat (nanoseconds, every thread).
`--profile DIR` runs both services under cProfile for the measured turns only
(bench/profile_hook/sitecustomize.py), one .prof file per service and concurrency level.
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
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seamlessflow import servers  # noqa: E402
from seamlessflow.modelgen import init_model  # noqa: E402
from seamlessflow.stack import Stack, StackOptions  # noqa: E402
from shared import bus, subjects  # noqa: E402
from shared.codec import decode, encode  # noqa: E402
from shared.config import Connections  # noqa: E402
from shared.messages import Generate, GenerateDone, RolloutReply, Sampling  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def direct_path(nc, worker: str, prompt_ids: list[int], max_tokens: int) -> float:
    cmd = Generate(uuid.uuid4().hex, prompt_ids, Sampling(max_tokens=max_tokens, temperature=0.0))
    t0 = time.perf_counter()
    async with bus.stream_request(nc, subjects.rollout_gen(worker), encode(cmd), 60, 60) as replies:
        async for data in replies:
            if isinstance(decode(data, RolloutReply), GenerateDone):
                break
    return time.perf_counter() - t0


async def gateway_path(http: httpx.AsyncClient, key: str, messages: list[dict], max_tokens: int) -> float:
    t0 = time.perf_counter()
    r = await http.post("/chat/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": "seamlessflow-tiny", "messages": messages, "max_tokens": max_tokens,
                              "temperature": 0.0})
    r.raise_for_status()
    return time.perf_counter() - t0


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, every thread (Linux schedstat: nanoseconds, not clock ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def profiling(pids: dict[str, int], on: bool) -> None:
    """Start (SIGUSR1) or stop and write (SIGUSR2) the services' profiles (bench/profile_hook)."""
    if os.environ.get("SF_PROFILE_DIR"):
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR1 if on else signal.SIGUSR2)


def use_profiler(out: str) -> None:
    """Every process the stack starts from here on can profile itself (see profiling())."""
    Path(out).mkdir(parents=True, exist_ok=True)
    hook = str(ROOT / "bench" / "profile_hook")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH", "")) if p)
    os.environ["SF_PROFILE_DIR"] = str(Path(out).resolve())
    os.environ["SF_PROFILE_ONLY"] = "services.gateway,services.trajectory"


async def long_sessions(http: httpx.AsyncClient, admin: dict, pids: dict[str, int], args) -> dict:
    """`--sessions` sessions of `--turns` turns each, one after the other; CPU per turn by turn number."""
    cpu: dict[str, list[list[float]]] = {n: [] for n in pids}
    lat: list[list[float]] = []
    for _ in range(args.sessions):
        key = (await http.post("/sessions", json={}, headers=admin)).json()["api_key"]
        messages: list[dict] = []
        per = {n: [] for n in pids}
        times = []
        profiling(pids, True)
        for t in range(1, args.turns + 1):
            messages.append({"role": "user", "content": f"step {t}: run the tests again and say what failed"})
            c0 = {n: cpu_seconds(p) for n, p in pids.items()}
            t0 = time.perf_counter()
            r = await http.post("/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                json={"model": "seamlessflow-tiny", "messages": messages,
                                      "max_tokens": args.max_tokens, "temperature": 0.0})
            r.raise_for_status()
            times.append(time.perf_counter() - t0)
            for n, p in pids.items():
                per[n].append(cpu_seconds(p) - c0[n])
            messages.append(r.json()["choices"][0]["message"])
        profiling(pids, False)
        for n in pids:
            cpu[n].append(per[n])
        lat.append(times)
    marks = sorted({m for m in (10, 50, 100, 200, args.turns) if m <= args.turns})
    rows = []
    for m in marks:
        window = range(max(0, m - 10), m)  # the 10 turns ending at turn m
        row = {"turn": m}
        for n in pids:
            row[f"{n}_cpu_ms"] = round(1000 * statistics.median(s[i] for s in cpu[n] for i in window), 3)
        row["latency_ms"] = round(1000 * statistics.median(s[i] for s in lat for i in window), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"engine": args.engine, "turns": args.turns, "sessions": args.sessions, "long_rows": rows}


async def run(args) -> dict:
    from transformers import AutoTokenizer

    if args.profile:
        use_profiler(args.profile)
    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-"))
    model = init_model(tmp / "model")
    tok = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "hello world, please reverse 12345"}]
    prompt_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
    opts = StackOptions(model=model, data_dir=tmp, workers=0 if args.engine == "simulated" else 1,
                        gateway_port=servers.free_port(), admin_port=servers.free_port(),
                        nats_port=servers.free_port(), redis_port=servers.free_port(),
                        max_num_seqs=max(args.concurrency), max_model_len=32768 if args.turns else 512,
                        extra_env={"SF_ROLLOUT_MAX_MODEL_LEN": "32768"} if args.turns else {})
    stack = Stack(opts)
    stack.start()
    worker = "rollout-0"
    if args.engine == "simulated":
        stack.wait_ready(stack.spawn("rollout-0", [sys.executable, str(ROOT / "bench" / "simulated_engine.py"),
                                                   "--worker-id", worker, "--model", str(model),
                                                   "--capacity", str(max(args.concurrency))],
                                     ready="rollout worker rollout-0 ready"))
    pids = {p.name.split("-")[0]: p.popen.pid for p in stack.procs if p.name in ("gateway", "trajectory-0")}
    results: dict = {"engine": args.engine, "max_tokens": args.max_tokens, "prompt_tokens": len(prompt_ids),
                     "rows": []}
    try:
        nc = await bus.connect(Connections(nats_url=stack.nats_url), name="bench")
        limits = httpx.Limits(max_connections=max(args.concurrency) + 8)
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=120, limits=limits) as http:
            admin = {"Authorization": f"Bearer {stack.api_key}"}
            sessions = [(await http.post("/sessions", json={}, headers=admin)).json()["api_key"]
                        for _ in range(max(args.concurrency))]
            # warm up both paths (vLLM's first logprobs request is slow)
            for _ in range(3):
                await direct_path(nc, worker, prompt_ids, args.max_tokens)
                await gateway_path(http, sessions[0], messages, args.max_tokens)
            if args.turns:
                results = await long_sessions(http, admin, pids, args)
            for conc in args.concurrency if not args.turns else []:
                lat = {"direct": [], "gateway": []}
                wall = {"direct": 0.0, "gateway": 0.0}
                cpu = {name: 0.0 for name in pids}
                profiling(pids, True)
                per_round = max(conc, args.requests // args.rounds)
                for _ in range(args.rounds):
                    for path in ("direct", "gateway"):
                        queue = list(range(per_round))

                        async def loop(i: int) -> None:
                            while queue:
                                queue.pop()
                                if path == "direct":
                                    lat[path].append(await direct_path(nc, worker, prompt_ids, args.max_tokens))
                                else:
                                    lat[path].append(await gateway_path(http, sessions[i], messages, args.max_tokens))

                        t0, c0 = time.perf_counter(), {n: cpu_seconds(p) for n, p in pids.items()}
                        await asyncio.gather(*(loop(i) for i in range(conc)))
                        wall[path] += time.perf_counter() - t0
                        if path == "gateway":
                            for n, p in pids.items():
                                cpu[n] += cpu_seconds(p) - c0[n]
                profiling(pids, False)
                row = {"concurrency": conc, "requests_per_path": len(lat["direct"])}
                for path in ("direct", "gateway"):
                    row[f"{path}_p50_ms"] = round(1000 * statistics.median(lat[path]), 2)
                    row[f"{path}_p99_ms"] = round(1000 * pct(lat[path], 0.99), 2)
                    row[f"{path}_rps"] = round(len(lat[path]) / wall[path], 1)
                # the capacity that does not depend on the load generator sharing the cores:
                # CPU each gateway turn costs the gateway and the trajectory manager
                for n in pids:
                    row[f"{n}_cpu_ms_per_turn"] = round(1000 * cpu[n] / len(lat["gateway"]), 3)
                row["turns_per_core_s"] = round(len(lat["gateway"]) / max(sum(cpu.values()), 1e-9), 1)
                row["added_p50_ms"] = round(row["gateway_p50_ms"] - row["direct_p50_ms"], 2)
                row["added_p99_ms"] = round(row["gateway_p99_ms"] - row["direct_p99_ms"], 2)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
        await bus.wait_closed(nc)
    finally:
        stack.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["vllm", "simulated"], default="vllm")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--requests", type=int, default=256, help="requests per path per concurrency level")
    ap.add_argument("--rounds", type=int, default=4, help="alternating direct/gateway rounds")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--turns", type=int, default=0, help="measure one session growing to this many turns")
    ap.add_argument("--sessions", type=int, default=2, help="with --turns: how many such sessions, in a row")
    ap.add_argument("--profile", metavar="DIR", help="cProfile the gateway and trajectory manager into DIR")
    args = ap.parse_args()
    res = asyncio.run(run(args))
    if args.turns:
        print("\n| turn | CPU ms per turn: gateway | trajectory | latency p50 ms |")
        print("|---|---|---|---|")
        for r in res["long_rows"]:
            print(f"| {r['turn']} | {r['gateway_cpu_ms']} | {r['trajectory_cpu_ms']} | {r['latency_ms']} |")
        return
    print("\n| concurrency | direct p50 / p99 ms | gateway p50 / p99 ms | added p50 / p99 ms | direct / gateway req/s "
          "| CPU ms per turn: gateway + trajectory | turns/s per core |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['concurrency']} | {r['direct_p50_ms']} / {r['direct_p99_ms']} | {r['gateway_p50_ms']} / "
              f"{r['gateway_p99_ms']} | {r['added_p50_ms']} / {r['added_p99_ms']} | {r['direct_rps']} / "
              f"{r['gateway_rps']} | {r['gateway_cpu_ms_per_turn']} + {r['trajectory_cpu_ms_per_turn']} | "
              f"{r['turns_per_core_s']} |")


if __name__ == "__main__":
    main()
