"""The RL loop on one machine, end to end and all real: agents (official openai SDK) ->
gateway -> trajectory manager -> vLLM rollout -> TrajectoryCompleted -> DeepSpeed trainer ->
WeightsPublished -> rollout workers reload in place -> the next agents.

The task is seamlessflow/tasks.py's "reverse the digits", a verifiable reward. Agents run
in rounds of `groups` GRPO groups of `group_size` sessions that share a prompt; the trainer
steps once per round's worth of groups and publishes a new version after each step.
Rounds do not wait for the trainer: rollout runs ahead within the staleness bound, and the
loss corrects for the versions that generated each token.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai

from seamlessflow.stack import Stack
from seamlessflow.tasks import reverse_prompt, reverse_reward

# Trainer settings for the demo and the learning test (bench/probe_learning.py swept them:
# with 32 samples per step, lr >= 3e-4 follows noise on a model this small and collapses it
# into early EOS; lr 1e-4 climbs steadily).
TRAINER_SETTINGS = {
    "lr": 1e-4,
    "lr_warmup_steps": 5,
    "ppo_epochs": 1,
    "entropy_coef": 0.0,
    "advantage": "grpo",
    "checkpoint_every": 5,
    "publish_every": 1,
    "keep_versions": 3,
}


@dataclass
class Round:
    index: int
    rewards: list[float]
    versions: list[int]  # policy versions that generated this round's answers
    seconds: float

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rewards)


@dataclass
class RLResult:
    rounds: list[Round] = field(default_factory=list)

    def mean_of(self, rounds: list[Round]) -> float:
        return statistics.fmean(r for rd in rounds for r in rd.rewards)


async def one_agent(base_url: str, key: str, task: str, target: str, max_tokens: int) -> tuple[float, list[int]]:
    """Ordinary agent code: only base_url and api_key point at SeamlessFlow."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, timeout=180, max_retries=0)
    try:
        r = await client.chat.completions.create(
            model="seamlessflow-tiny", messages=[{"role": "user", "content": task}],
            max_tokens=max_tokens, temperature=1.0)
    finally:
        await client.close()
    extra = (r.model_extra or {}).get("seamlessflow", {})
    return reverse_reward(r.choices[0].message.content or "", target), list(extra.get("versions", []))


async def run_rounds(stack: Stack, rounds: int, groups: int, group_size: int, max_tokens: int = 8,
                     seed: int = 0, log: Callable[[str], None] = print) -> RLResult:
    rng = random.Random(seed)
    out = RLResult()
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=headers, timeout=120) as http:

        async def session(gid: str, task: str, target: str) -> tuple[float, list[int]]:
            for attempt in range(60):  # admission control may ask us to wait (429)
                r = await http.post("/sessions", json={"group_id": gid, "metadata": {"task": task}})
                if r.status_code != 429:
                    break
                await asyncio.sleep(0.5)
            r.raise_for_status()
            s = r.json()
            reward, versions = await one_agent(stack.gateway_url, s["api_key"], task, target, max_tokens)
            f = await http.post(f"/sessions/{s['id']}/finish", json={"reward": reward})
            f.raise_for_status()
            return reward, versions

        for i in range(rounds):
            t0 = time.monotonic()
            jobs = []
            for g in range(groups):
                task, target = reverse_prompt(rng)
                jobs += [session(f"r{i}-g{g}", task, target) for _ in range(group_size)]
            results = await asyncio.gather(*jobs)
            rd = Round(i, [r for r, _ in results], sorted({v for _, vs in results for v in vs}),
                       time.monotonic() - t0)
            out.rounds.append(rd)
            log(f"round {i:3d}: mean reward {rd.mean:.3f}  policy versions {rd.versions}  {rd.seconds:.1f}s")
    return out
