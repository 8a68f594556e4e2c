"""What a weight update or a host move costs agents that are mid-request.

    .venv/bin/python bench/weight_update_stall.py            # ~3 minutes on 2 CPU cores

One stack (2 vLLM-CPU rollout workers, tiny model), 16 agents in a closed loop (official
openai SDK, non-streaming, 48 tokens at temperature 1). Three phases of equal length, side
by side in one run:
  baseline  no disturbance;
  keep      a new weight version every 3 s; each worker pauses (keep), reloads in place, resumes;
  abort     every 3 s one worker is vacated (abort: in-flight requests come back with their
            partial tokens and are re-dispatched to the other worker), then resumed.
With --lora (the default) a second stack follows in the same run, its worker started with
SF_ROLLOUT_LORA=1, and two more phases:
  lora-baseline  no disturbance, on the LoRA-enabled engine;
  lora      a new adapter version every 3 s (PEFT dir, MBs); the worker adds it beside the
            one in flight (no pause); requests in flight keep theirs, new ones take it.
For lora, "spanning" requests are those in flight when a version was published (an adapter
request never changes version mid-stream), and "aborted" counts requests that came back in
more than one segment (a migration; 0 expected below max_staleness). Every phase streams (each
agent reads the chunks as they come), so the pause an agent saw at an update is measured
directly: the longest gap between chunks in the 0.3 s after the update (the worker hears it,
and reads an adapter, a few ms later), less that request's own median gap (the request is its
own reference: the box's load cancels), p50 over (request, update) pairs; the same at the
half-way instants is the control, and the net (the difference of the two p50s) is the figure the LoRA goal (<= 5 ms) and the full-weight goal (<= 100 ms above the load)
are set against. The size of a version and the time to publish it (copy into the weight store +
announce) are printed for both.
Per phase: request latency p50/p99; for requests that spanned an update (several policy
versions) or a move (several workers), their latency minus the p50 of requests with the same
number of generated tokens that spanned nothing, in the same phase (the agent-visible stall;
same-phase peers share the machine's load). A request in flight at a given instant is more
likely a slow one (the longer a request takes, the likelier an instant falls inside it), so that
excess is biased upward even where an update costs nothing: the control measures the bias, the
same excess for requests in flight at the instant half-way between two updates (and at none),
and the net stall is the spanning p50 less the control's p50. Tokens lost = tokens the
workers sampled minus tokens recorded in trajectories (the goal is 0: partial tokens are
kept). The workers' own pause / load / resume times come from their logs.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seamlessflow.stack import servers  # noqa: E402
from seamlessflow.modelgen import init_model  # noqa: E402
from seamlessflow.stack import Stack, StackOptions  # noqa: E402
from shared import bus, weightstore  # noqa: E402
from shared.config import Connections  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def noisy_copy(src: Path, dst: Path, seed: int) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    for shard in src.glob("*.safetensors"):
        g = torch.Generator().manual_seed(seed)
        t = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in load_file(shard).items()}
        save_file(t, dst / shard.name, metadata={"format": "pt"})
    return dst


async def streamed(client: openai.AsyncOpenAI, **kw) -> tuple[list[float], int, str]:
    """One streamed turn: the perf_counter time of each content chunk, the completion tokens, the turn id."""
    stamps, tokens, turn = [], 0, ""
    async for chunk in await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if (ext := (chunk.model_extra or {}).get("seamlessflow")) is not None:
            turn = ext["turn_id"]
    return stamps, tokens, turn


async def agents(stack: Stack, n: int, seconds: float, max_tokens: int, stream: bool = False) -> list[dict]:
    """`n` closed-loop agents for `seconds`; with `stream` each turn is streamed and its chunks' times kept."""
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    done: list[dict] = []
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=headers, timeout=120) as http:

        async def loop(i: int) -> None:
            s = (await http.post("/sessions", json={})).json()
            client = openai.AsyncOpenAI(base_url=stack.gateway_url, api_key=s["api_key"], max_retries=0, timeout=120)
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                kw = dict(model="seamlessflow-tiny", messages=[{"role": "user", "content": f"agent {i} {len(done)}"}],
                          max_tokens=max_tokens, temperature=1.0)
                if stream:
                    stamps, tokens, turn = await streamed(client, **kw)
                else:
                    r = await client.chat.completions.create(**kw)
                    stamps, tokens, turn = [], r.usage.completion_tokens, r.model_extra["seamlessflow"]["turn_id"]
                t1 = time.perf_counter()
                done.append({"session": s["id"], "latency": t1 - t0, "t0": t0, "t1": t1, "stamps": [t0, *stamps, t1],
                             "tokens": tokens, "turn": turn})
            await client.close()

        await asyncio.gather(*(loop(i) for i in range(n)))
        # segments of every turn: versions and workers that produced it
        sessions: dict[str, dict] = {}
        for d in done:
            if d["session"] not in sessions:
                sessions[d["session"]] = (await http.get(f"/sessions/{d['session']}")).json()
            turn = next(t for t in sessions[d["session"]]["turns"] if t["turn_id"] == d["turn"])
            d["versions"] = sorted({seg["version"] for seg in turn["segments"]})
            d["workers"] = sorted({seg["worker_id"] for seg in turn["segments"]})
            d["recorded"] = sum(len(seg["token_ids"]) for seg in turn["segments"])
            d["segments"] = len(turn["segments"])
    return done


def worker_tokens(stack: Stack) -> int:
    r = httpx.get(f"{stack.admin_url}/admin/workers", headers={"Authorization": f"Bearer {stack.admin_key}"})
    return sum(w["generated_tokens"] for w in r.json()["workers"])


async def disturb(stack: Stack, mode: str, seconds: float, every: float, tmp: Path) -> list[float]:
    """Disturb every `every` s; returns the perf_counter time of each (lora/keep: when announced)."""
    nc = await bus.connect(Connections(nats_url=stack.nats_url), name="bench")
    headers = {"Authorization": f"Bearer {stack.admin_key}"}
    n = 0
    times: list[float] = []
    t_end = time.monotonic() + seconds - every / 2
    async with httpx.AsyncClient(base_url=stack.admin_url, headers=headers, timeout=60) as admin:
        while time.monotonic() < t_end:
            await asyncio.sleep(every)
            if mode in ("keep", "lora"):  # the copies were made before the phase: making one blocks this loop
                t0 = time.perf_counter()
                await weightstore.publish_dir(nc.jetstream(), stack.weights_dir, tmp / f"{mode}{n}")
                PUBLISH_S.setdefault(mode, []).append(time.perf_counter() - t0)
                times.append(time.perf_counter())
            else:
                w = f"rollout-{n % stack.o.workers}"
                (await admin.post(f"/admin/workers/{w}/vacate")).raise_for_status()
                await asyncio.sleep(0.05)
                (await admin.post(f"/admin/workers/{w}/resume")).raise_for_status()
                times.append(time.perf_counter())
            n += 1
    await bus.wait_closed(nc)
    return times


async def phase(stack, mode, args, tmp) -> dict:
    before = worker_tokens(stack)
    jobs = [agents(stack, args.agents, args.seconds, args.max_tokens, stream=True)]
    if not mode.endswith("baseline"):
        jobs.append(disturb(stack, mode, args.seconds, args.every, tmp))
    res = await asyncio.gather(*jobs)
    await asyncio.sleep(1.5)  # heartbeats catch up
    done = res[0]
    times = res[1] if len(res) > 1 else []
    return {"done": done, "sampled": worker_tokens(stack) - before, "events": len(times), "times": times}


def by_tokens(done: list[dict]) -> dict[int, float]:
    out: dict[int, list[float]] = {}
    for d in done:
        out.setdefault(d["tokens"], []).append(d["latency"])
    return {k: statistics.median(v) for k, v in out.items()}


def in_flight(d: dict, times: list[float]) -> bool:
    return any(d["t0"] < t < d["t1"] for t in times)


def halfway(times: list[float]) -> list[float]:
    """The instants half-way between consecutive disturbances (the control's instants)."""
    return [(a + b) / 2 for a, b in zip(times, times[1:])]


WINDOW_S = 0.3  # an update's pause starts once the worker has heard it (and, for an adapter, read it)


def gap_excess_ms(d: dict, t: float, window: float = WINDOW_S) -> float | None:
    """The longest gap in `d`'s stream (start, chunks, end) that overlaps [t, t + window], less the
    request's own median gap, in ms; None where `t` is outside the request."""
    ts = d["stamps"]
    i = bisect.bisect_right(ts, t)
    if i == 0 or i == len(ts) or len(ts) < 3:
        return None
    longest = max(ts[j] - ts[j - 1] for j in range(i, len(ts)) if ts[j - 1] < t + window)
    return 1000 * (longest - statistics.median(b - a for a, b in zip(ts, ts[1:])))


def gap_stall(ph: dict) -> dict:
    """Per update and per streamed request in flight at it, the longest gap in the WINDOW_S after the
    update less the request's median gap (the pause the agent saw); the same at the half-way instants
    (the control); the net is the difference of the two p50s. Each request is its own reference, so
    the box's load cancels."""
    def excess(times: list[float]) -> list[float]:
        return [x for t in times for d in ph["done"] if (x := gap_excess_ms(d, t)) is not None]

    at, control = excess(ph["times"]), excess(halfway(ph["times"]))
    if not at or not control:
        return {"gap_pairs": len(at), "gap_p50_ms": None, "gap_control_p50_ms": None, "gap_net_p50_ms": None}
    return {"gap_pairs": len(at), "gap_p50_ms": round(statistics.median(at), 1),
            "gap_p99_ms": round(pct(at, 0.99), 1), "gap_control_pairs": len(control),
            "gap_control_p50_ms": round(statistics.median(control), 1),
            "gap_net_p50_ms": round(statistics.median(at) - statistics.median(control), 1)}


def summarize(name: str, ph: dict, base_by_tokens: dict[int, float]) -> dict:
    """Stall of a spanning request = its latency minus the median latency of requests with the
    same number of tokens that did not span anything: first those of the same phase (same
    load on the machine), else those of the baseline phase."""
    done = ph["done"]
    span = [d for d in done if d["segments"] > 1]  # an update, a move, or a re-dispatch
    aborted = len(span)
    if name == "lora":  # an adapter request keeps its version: spanning = in flight at a publish
        span = [d for d in done if in_flight(d, ph["times"])]
    # the control: in flight half-way between two disturbances, at none (module docstring)
    control = [d for d in done if d not in span and not in_flight(d, ph["times"])
               and in_flight(d, halfway(ph["times"]))]
    calm = by_tokens([d for d in done if d not in span and d not in control])
    fallback = statistics.median(base_by_tokens.values())

    def excess_ms(group: list[dict]) -> list[float]:
        return [1000 * (d["latency"] - calm.get(d["tokens"], base_by_tokens.get(d["tokens"], fallback)))
                for d in group]

    stalls, controls = excess_ms(span), excess_ms(control)
    stall_p50 = statistics.median(stalls) if stalls else None
    control_p50 = statistics.median(controls) if controls else None
    recorded = sum(d["recorded"] for d in done)
    return {
        "phase": name, "requests": len(done), "events": ph["events"],
        "p50_ms": round(1000 * statistics.median(d["latency"] for d in done), 1),
        "p99_ms": round(1000 * pct([d["latency"] for d in done], 0.99), 1),
        "spanning": len(span), "multi_segment": aborted,
        "stall_p50_ms": round(stall_p50, 1) if stall_p50 is not None else None,
        "stall_p99_ms": round(pct(stalls, 0.99), 1) if stalls else None,
        "control": len(control), "control_p50_ms": round(control_p50, 1) if control_p50 is not None else None,
        "stall_net_p50_ms": (round(stall_p50 - control_p50, 1)
                             if stall_p50 is not None and control_p50 is not None else None),
        "tokens_sampled": ph["sampled"], "tokens_recorded": recorded, "tokens_lost": ph["sampled"] - recorded,
        **(gap_stall(ph) if not name.endswith("baseline") else {}),
    }


PUBLISH_S: dict[str, list[float]] = {}  # seconds per publish (copy into the store + announce), by phase


def make_adapter(model: Path, dst: Path, seed: int, rank: int) -> Path:
    """A PEFT LoRA adapter on every projection, lora_B small and random (a trained adapter's scale)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                       LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.01)
    m.save_pretrained(dst)
    return dst


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


async def stack_phases(args, tmp: Path, modes: tuple[str, ...], lora: bool) -> dict:
    model = args.model or init_model(tmp / "model")
    extra = {"SF_ROLLOUT_LORA": "1", "SF_ROLLOUT_MAX_LORA_RANK": str(args.lora_rank)} if lora else {}
    stack = Stack(StackOptions(model=model, data_dir=tmp, workers=args.workers, gateway_port=servers.free_port(),
                               admin_port=servers.free_port(), nats_port=servers.free_port(),
                               redis_port=servers.free_port(), max_model_len=512, max_num_seqs=16, extra_env=extra,
                               ready_timeout=600.0))  # a loaded shared box can take minutes
    for n in range(int(args.seconds // args.every) + 1):  # before the phases: making one blocks the loop
        if lora:
            make_adapter(model, tmp / f"lora{n}", n, args.lora_rank)
        else:
            noisy_copy(model, tmp / f"keep{n}", n)
    stack.start()
    try:
        await agents(stack, 4, args.warmup, args.max_tokens)  # warm up
        await asyncio.sleep(1.5)  # heartbeats catch up: the warm-up is not counted in the baseline
        return {m: await phase(stack, m, args, tmp) for m in modes}
    finally:
        stack.stop()


def worker_timings(tmp: Path) -> tuple[list[tuple[float, ...]], list[float]]:
    full, adapter = [], []
    for log in (tmp / "logs").glob("rollout-*.log"):
        text = log.read_text(errors="replace")
        for m in re.finditer(r"weight update v(\d+): pause ([\d.]+) ms, load ([\d.]+) ms, resume ([\d.]+) ms", text):
            full.append(tuple(float(x) for x in m.groups()[1:]))
        adapter += [float(m.group(1)) for m in re.finditer(r"adapter v\d+ added in ([\d.]+) ms", text)]
    return full, adapter


async def run(args) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="sf-stall-"))
    phases = await stack_phases(args, tmp / "full", ("baseline", "keep", "abort"), lora=False)
    if args.lora:
        phases |= await stack_phases(args, tmp / "lora", ("lora-baseline", "lora"), lora=True)
    rows = []
    for m, ph in phases.items():
        base = phases["lora-baseline" if m.startswith("lora") else "baseline"]
        rows.append(summarize(m, ph, by_tokens(base["done"])))
    for r in rows:
        print(json.dumps(r))
    print("\n| phase | requests | disturbances | p50 / p99 ms | spanning requests | stall p50 / p99 ms | "
          "control: requests, p50 ms | net stall p50 ms | multi-segment (aborted) | tokens lost |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['phase']} | {r['requests']} | {r['events']} | {r['p50_ms']} / {r['p99_ms']} | {r['spanning']} | "
              f"{r['stall_p50_ms']} / {r['stall_p99_ms']} | {r['control']}, {r['control_p50_ms']} | "
              f"{r['stall_net_p50_ms']} | {r['multi_segment']} | {r['tokens_lost']} of {r['tokens_sampled']} |")
    timings, adapter_ms = worker_timings(tmp / "full")
    if args.lora:
        adapter_ms = worker_timings(tmp / "lora")[1]
    if timings:
        med = [statistics.median(t[i] for t in timings) for i in range(3)]
        mx = [max(t[i] for t in timings) for i in range(3)]
        print(f"\nin-place updates on the workers ({len(timings)}): pause {med[0]:.1f} ms, load {med[1]:.1f} ms, "
              f"resume {med[2]:.1f} ms (median); max {mx[0]:.1f} / {mx[1]:.1f} / {mx[2]:.1f} ms")
        keep = next(r for r in rows if r["phase"] == "keep")
        if keep["stall_p50_ms"] is not None:
            print(f"keep: latency excess of spanning requests p50 {keep['stall_p50_ms']:.1f} ms (control "
                  f"{keep['control_p50_ms']} ms, net {keep['stall_net_p50_ms']} ms)")
        if keep.get("gap_net_p50_ms") is not None:
            print(f"keep: the pause an agent saw per update p50 {keep['gap_p50_ms']:.1f} ms over {keep['gap_pairs']} "
                  f"(request, update) pairs, control {keep['gap_control_p50_ms']} ms, net {keep['gap_net_p50_ms']} ms "
                  f"= load p50 {med[1]:.1f} ms {keep['gap_net_p50_ms'] - med[1]:+.1f} ms (goal: at most +100 ms)")
    if adapter_ms:
        print(f"adapter versions added on the workers ({len(adapter_ms)}): {statistics.median(adapter_ms):.1f} ms "
              f"median, {max(adapter_ms):.1f} ms max, no pause")
    for mode, d in (("keep", tmp / "full" / "keep0"), ("lora", tmp / "lora" / "lora0")):
        if mode in PUBLISH_S:
            print(f"{mode}: a version is {dir_bytes(d) / 1e6:.2f} MB; publish (copy + announce) "
                  f"{1000 * statistics.median(PUBLISH_S[mode]):.1f} ms median")
    lora_row = next((r for r in rows if r["phase"] == "lora"), None)
    if lora_row is not None:
        print(f"lora: agent-visible stall p50 {lora_row['stall_p50_ms']} ms over {lora_row['spanning']} spanning "
              f"requests; control (in flight half-way between updates) p50 {lora_row['control_p50_ms']} ms over "
              f"{lora_row['control']}; net {lora_row['stall_net_p50_ms']} ms (latency, streamed)")
        print(f"lora: the pause an agent saw per update (the stream's gap around it less the request's median "
              f"gap) p50 {lora_row['gap_p50_ms']} ms over {lora_row['gap_pairs']} (request, update) pairs; control "
              f"(half-way instants) p50 {lora_row['gap_control_p50_ms']} ms; net {lora_row['gap_net_p50_ms']} ms "
              f"(goal <= 5), tokens lost {lora_row['tokens_lost']} (goal 0), aborted {lora_row['multi_segment']} "
              f"(goal 0 below max_staleness)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=16, help="closed-loop agents (fewer: less CPU contention)")
    ap.add_argument("--workers", type=int, default=2, help="rollout workers (with 1, abort re-dispatches to the "
                    "same worker after its resume)")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    ap.add_argument("--every", type=float, default=3.0, help="seconds between disturbances")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of load on each stack before its "
                    "first phase, not counted")
    ap.add_argument("--model", type=lambda s: Path(s).resolve(),
                    help="a checkpoint directory for both stacks (default: the tiny model, built per stack)")
    ap.add_argument("--lora", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the LoRA stack: adapter versions beside the full-weight ones")
    ap.add_argument("--lora-rank", type=int, default=8)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
