"""Live A/B of the tag scheduler's policies on this machine's two real hosts, in one run.

    .venv/bin/python bench/scheduler_ab.py --seconds 90 [--policies disaggregated,seamless,colocated]
    # issue 29's workload: 12 agents (3 groups of 4 in flight), 2 turns, think 0-3 s, 2 groups a step, pinned
    .venv/bin/python bench/scheduler_ab.py --seconds 120 --lanes 3 --think-s 1.5 --pin

One stack: host-0 {train, rollout, cpu} runs the DeepSpeed trainer and a resident vLLM-CPU
worker, host-1 {rollout, cpu} a vLLM-CPU worker (each host its own core), the scheduler, a
trajectory manager and the gateway. For each policy, in turn on the same stack (a
`set_policy` between them), the same agent workload (seamlessflow/demo/workload.py: GRPO groups
of openai-SDK agents, two turns of 32-160 tokens) runs for --seconds after a settle. Reported
per policy: trained tokens/s (completion tokens of the sessions the trainer's audit log
says it trained in the window), trainer steps, host-0's activity fractions from the
scheduler's timeline (idle is measured, not inferred), lend and reclaim counts, and switch
latency p50/max measured by the host agents (lend = offload + wake + load + resume; reclaim
= vacate until the last request has migrated + sleep + reload), trained samples/s (sessions the
trainer trained in the window, per second), lend/reclaim cycles per minute, turns whose tokens
came from more than one worker (moved by a reclaim), failed agent requests, and the scheduler's
rates at the end (sessions/s, groups/s, predicted wait, lent hosts that generate nothing), and the
host-seconds train hosts spent lent and idle in the window (the defect a lend must not have).
With --pin each host runs on a CPU set of its own (seamlessflow/stack/pinning.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seamlessflow.ops import hosts as hostops  # noqa: E402
from seamlessflow.stack import servers  # noqa: E402
from seamlessflow.modelgen import init_model  # noqa: E402
from seamlessflow.stack import Stack, StackOptions  # noqa: E402
from seamlessflow.demo.workload import GroupAgents, Load  # noqa: E402
from shared.config import connections  # noqa: E402
from shared.messages.scheduler import Interval, fractions  # noqa: E402

SWITCH = re.compile(r"host (host-\d+): (\w+) -> (\w+) \(epoch \d+\) in (\d+) ms")
TRAINER = {"group_size": 4, "groups_per_step": 2, "lr": 1e-5, "publish_every": 1, "checkpoint_every": 5,
           "keep_versions": 3, "gate_timeout": 60}


def steps(stack: Stack) -> list[dict]:
    path = stack.data / "trainer" / "trained.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["event"] == "step"]


def switches(stack: Stack, t0: float, t1: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"lend": [], "reclaim": []}
    for line in (stack.logs / "scheduler.log").read_text().splitlines():
        m = SWITCH.search(line)
        if not m:
            continue
        ts = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
        if not t0 - 1 <= ts <= t1 + 1:
            continue
        kind = {"rollout": "lend", "train": "reclaim"}.get(m.group(3))
        if kind and m.group(2) != m.group(3):
            out[kind].append(int(m.group(4)) / 1000)
    return out


def measure(stack: Stack, conn, policy: str, a: argparse.Namespace, seed: int) -> dict:
    seconds = a.seconds
    asyncio.run(hostops.ask(conn, "set_policy", policy=policy))
    deadline = time.monotonic() + 600  # the first policy waits for both vLLM workers to start
    while time.monotonic() < deadline:
        # settled and placed: a host whose worker is still starting is idle and not yet placed
        if all(h.mode == h.target != "idle" and h.healthy for h in asyncio.run(hostops.ask(conn, "status")).hosts):
            break
        time.sleep(0.5)
    agents = GroupAgents(stack.gateway_url, stack.api_key, Load(
        group_size=a.group_size, lanes=a.lanes, seed=seed, min_tokens=a.min_tokens, max_tokens=a.max_tokens,
        turns=a.turns, think_s=a.think_s))
    before = asyncio.run(hostops.ask(conn, "status"))
    n0, t0 = len(steps(stack)), time.time()
    asyncio.run(agents.run(lambda: time.time() - t0 >= seconds, seconds + 120))
    t1 = time.time()
    after = asyncio.run(hostops.ask(conn, "timeline"))
    window = steps(stack)[n0:]
    trained = [sid for r in window for sid in r["ids"]]
    tokens = sum(agents.session_tokens.get(sid, 0) for sid in trained)
    host0 = next(h for h in after.hosts if h.host == "host-0")
    frac = fractions([Interval(iv.activity, iv.t_start, iv.t_end) for iv in host0.timeline], t0, t1)
    sw = switches(stack, t0, t1)
    reclaims = after.counts.get("reclaims", 0) - before.counts.get("reclaims", 0)
    return {
        "workload": getattr(a, "workload_name", ""), "policy": policy, "seconds": round(t1 - t0, 1), "steps": len(window), "trained_sessions": len(trained),
        "trained_samples_per_s": round(len(trained) / (t1 - t0), 3),
        "trained_tokens_per_s": round(tokens / (t1 - t0), 1), "agent_turns": agents.ok,
        "failures": len(agents.failures), "host0": {k: round(v, 3) for k, v in frac.items()},
        "lends": after.counts.get("lends", 0) - before.counts.get("lends", 0), "reclaims": reclaims,
        "cycles_per_min": round(reclaims / (t1 - t0) * 60, 2), "moved_turns": moved_turns(agents),
        "lend_s": _p(sw["lend"]), "reclaim_s": _p(sw["reclaim"]),
        "rates": {k: round(v, 3) for k, v in after.rates.items()},
        # train hosts lent to rollout that served nothing (registry.lent_idle_s): the defect a lend must not have
        "lent_idle_host_s": round(after.rates.get("lent_idle_host_s", 0.0) - before.rates.get("lent_idle_host_s", 0.0),
                                  1),
    }


def moved_turns(agents: GroupAgents) -> int:
    """Turns whose tokens came from more than one worker (a reclaim migrated them mid-turn)."""
    turns = [turn for t in agents.trajectories() for turn in t["turns"]]
    return sum(len({seg["worker_id"] for seg in turn["segments"]}) > 1 for turn in turns)


def _p(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": round(statistics.median(xs), 3), "max": round(max(xs), 3)} if xs else {"n": 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--policies", default="disaggregated,seamless")
    ap.add_argument("--model", type=Path, help="default: the tiny model, built in a temp dir")
    ap.add_argument("--out", type=Path, default=Path("var/bench/scheduler_ab.json"))
    ap.add_argument("--runs", type=int, default=1, help="each policy this many times, alternating, on one stack")
    ap.add_argument("--pin", action="store_true", help="each host on a CPU set of its own (up --pin)")
    ap.add_argument("--lanes", type=int, default=4, help="groups in flight (agents = lanes x group size)")
    ap.add_argument("--group-size", type=int, default=4, help="sessions per group (SF_TRAINER_GROUP_SIZE too)")
    ap.add_argument("--groups-per-step", type=int, default=2, help="SF_TRAINER_GROUPS_PER_STEP")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--think-s", type=float, default=0.0, help="between an agent's turns: uniform in [0, 2x]")
    ap.add_argument("--min-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--workload", action="append", default=[], metavar="NAME:KEY=V,...",
                    help="another workload on the same stack after the first, e.g. 'short:lanes=6,turns=1,"
                         "think_s=0,min_tokens=4,max_tokens=8' (keys: lanes turns think_s min_tokens max_tokens "
                         "seconds); repeatable")
    ap.add_argument("--worker-cmd", default="", help="e.g. 'python -m services.rollout.simulated' (SIMULATED)")
    a = ap.parse_args()
    cache = Path(__file__).resolve().parents[1] / ".cache" / "tests"  # the test suite's JIT and vLLM caches
    for key, sub in (("TORCH_EXTENSIONS_DIR", "torch_extensions"), ("VLLM_CACHE_ROOT", "vllm"),
                     ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        os.environ.setdefault(key, str(cache / sub))
    tmp = Path(tempfile.mkdtemp(prefix="sf-ab-"))
    model = a.model or init_model(tmp / "model", size="tiny")
    opts = StackOptions(model=model, data_dir=tmp, gateway_port=servers.free_port(), admin_port=servers.free_port(),
                        nats_port=servers.free_port(), redis_port=servers.free_port(), max_model_len=512,
                        max_num_seqs=8, policy="seamless", hosts=["train+rollout", "rollout"], train=True,
                        trainer_settings=TRAINER | {"group_size": a.group_size, "groups_per_step": a.groups_per_step},
                        ready_timeout=900, pin=a.pin, worker_cmd=a.worker_cmd)
    stack = Stack(opts)
    # a SIGTERM (kill, a CI timeout) stops the stack too: Python's default would skip the `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"starting the stack in {tmp} ...", file=sys.stderr)
    stack.start()
    conn = connections({"SF_NATS_URL": stack.nats_url, "SF_REDIS_URL": stack.redis_url})
    results = []
    try:
        for w in workloads(a):
            for run in range(a.runs):  # run k of every policy draws the same workload (seed k)
                for i, policy in enumerate(a.policies.split(",")):
                    r = measure(stack, conn, policy, w, seed=i if a.runs == 1 else run)
                    print(json.dumps(r), flush=True)
                    results.append(r)
    finally:
        stack.stop()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1))
    print(table(results))
    print(summary(results))


def workloads(a: argparse.Namespace) -> list[argparse.Namespace]:
    """The command line's workload ("main"), then each --workload: the same settings with its overrides."""
    out = [argparse.Namespace(**vars(a), workload_name="main")]
    kinds = {"lanes": int, "turns": int, "think_s": float, "min_tokens": int, "max_tokens": int, "seconds": float}
    for spec in a.workload:
        name, _, pairs = spec.partition(":")
        over = {k: kinds[k](v) for k, v in (p.split("=", 1) for p in pairs.split(",") if p)}
        out.append(argparse.Namespace(**(vars(a) | over), workload_name=name))
    return out


def summary(results: list[dict]) -> str:
    """Per workload and policy, the mean over its runs; trained samples/s against the workload's first policy."""
    lines = []
    for name in dict.fromkeys(r.get("workload", "") for r in results):
        lines.append(_summary([r for r in results if r.get("workload", "") == name], name))
    return "\n".join(lines)


def _summary(results: list[dict], name: str) -> str:
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["policy"], []).append(r)
    base = statistics.mean(r["trained_samples_per_s"] for r in next(iter(by.values())))
    lines = [f"workload {name}:"]
    for policy, rs in by.items():
        sps = statistics.mean(r["trained_samples_per_s"] for r in rs)
        lines.append(f"{policy}: {len(rs)} run(s), trained samples/s {sps:.3f} ({sps / base if base else 0:.2f}x), "
                     f"host-0 idle {statistics.mean(r['host0']['idle'] for r in rs):.0%}, "
                     f"cycles/min {statistics.mean(r['cycles_per_min'] for r in rs):.1f}, "
                     f"moved turns {sum(r['moved_turns'] for r in rs)}, failures {sum(r['failures'] for r in rs)}, "
                     f"lent-idle host-s {sum(r.get('lent_idle_host_s', 0) for r in rs):.1f}")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    rows = ["| workload | policy | trained samples/s | trained tok/s | steps | host-0 idle | host-0 train | host-0 rollout "
            "| host-0 switch | lends | reclaims | cycles/min | moved turns | lend p50/max s | reclaim p50/max s "
            "| failed turns | lent-idle host-s |", "|---" * 17 + "|"]
    for r in results:
        h = r["host0"]
        rows.append(f"| {r.get('workload', '')} | {r['policy']} | {r['trained_samples_per_s']} | {r['trained_tokens_per_s']} | {r['steps']} "
                    f"| {h['idle']:.0%} | {h['train']:.0%} | {h['rollout']:.0%} | {h['switch']:.0%} | {r['lends']} "
                    f"| {r['reclaims']} | {r['cycles_per_min']} | {r['moved_turns']} "
                    f"| {r['lend_s'].get('p50', '-')}/{r['lend_s'].get('max', '-')} "
                    f"| {r['reclaim_s'].get('p50', '-')}/{r['reclaim_s'].get('max', '-')} | {r['failures']} | {r.get('lent_idle_host_s', '-')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
