"""A steady agentic workload for the scheduler's tests and benchmarks: GRPO groups of
openai-SDK agents, each session two turns of random length with a random reward, a fixed
number of groups in flight until a condition holds.

    agents = GroupAgents(stack.gateway_url, stack.api_key, Load(group_size=4, lanes=4, seed=0))
    await agents.run(until=lambda: done(), timeout=120)
    agents.ok, agents.failures, agents.latencies, agents.sessions

Rewards are random: the point is load that looks like RL (groups, multi-turn, long tails
of reply length), not learning; the demo and the learning test measure learning.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai


@dataclass(frozen=True)
class Load:
    """The agents' shape: `lanes` groups of `group_size` sessions in flight, each `turns` turns
    of a reply length drawn from [min_tokens, max_tokens] (`seed` draws them)."""

    group_size: int = 4
    lanes: int = 4
    seed: int = 0
    min_tokens: int = 32
    max_tokens: int = 160
    turns: int = 2
    model: str = "seamlessflow-tiny"
    # between an agent's turns, as a tool call would take (no device works for it): drawn uniformly
    # from [0, 2 * think_s], so a group's agents do not all generate at the same moments
    think_s: float = 0.0
    stream: bool = False  # streamed turns: every token reaches the trajectory manager (and Redis) as it comes
    # sent with every turn: {"<eos id>": -100} makes each reply exactly its drawn length (a tiny model
    # emits EOS at random: a turn cut short where a test needs one still generating)
    logit_bias: dict[str, float] | None = None
    # retryable answers tried again this many times: a session call's 429 or 503 (after its Retry-After), and
    # in a turn whatever the openai SDK retries (its default is 2); 0: every error is a failure, which is
    # what most tests want to see
    retries: int = 0


def retry_delay(retry_after: str | None, low: float = 0.5, high: float = 5.0, default: float | None = None) -> float:
    """Seconds before the next try: the gateway's Retry-After (delay-seconds), kept within [low, high];
    `default` (None: `low`) where it sends none or one that does not read as a finite number (an HTTP
    date, "nan", "inf")."""
    fallback = low if default is None else default
    try:
        wait = float(retry_after or "")
    except ValueError:
        return fallback
    return min(high, max(low, wait)) if math.isfinite(wait) else fallback


class GroupAgents:
    def __init__(self, base_url: str, api_key: str, load: Load = Load()):
        self.base_url, self.api_key, self.group_size, self.lanes = base_url, api_key, load.group_size, load.lanes
        self.rng = random.Random(load.seed)
        self.min_tokens, self.max_tokens = load.min_tokens, load.max_tokens
        self.turns, self.model = load.turns, load.model
        self.think_s = load.think_s
        self.stream = load.stream
        self.extra = {"logit_bias": load.logit_bias} if load.logit_bias else {}
        self.retries = load.retries
        self.ok = 0
        self.failures: list[str] = []
        self.retried = 0  # session calls answered retryable and tried again (the SDK's own retries not counted)
        self.latencies: list[tuple[float, float]] = []  # (start, seconds) of each successful turn
        self.sessions: list[str] = []
        self.completion_tokens = 0
        self.session_tokens: dict[str, int] = {}  # finished session id -> its completion tokens

    async def session(self, http: httpx.AsyncClient, gid: str) -> None:
        try:
            s = (await self._post(http, "/sessions", {"group_id": gid})).json()
        except httpx.HTTPStatusError as e:
            self.failures.append(f"{gid}: create: {e.response.status_code} {e.response.text[:200]}")
            return
        agent = openai.AsyncOpenAI(base_url=self.base_url, api_key=s["api_key"], timeout=120,
                                   max_retries=self.retries)
        messages = [{"role": "user", "content": f"count {self.rng.randint(0, 999)}"}]
        tokens = 0
        try:
            for turn in range(self.turns):
                if turn and self.think_s:
                    await asyncio.sleep(self.rng.uniform(0.0, 2.0 * self.think_s))
                t0 = time.monotonic()
                try:
                    text, used = await self._turn(agent, messages, self.rng.randint(self.min_tokens, self.max_tokens))
                except openai.APIError as e:
                    self.failures.append(f"{gid}: {type(e).__name__}: {e}")
                    return
                self.ok += 1
                self.latencies.append((t0, time.monotonic() - t0))
                tokens += used
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
        finally:
            await agent.close()
        try:
            await self._post(http, f"/sessions/{s['id']}/finish", {"reward": self.rng.random()})
        except httpx.HTTPStatusError as e:
            self.failures.append(f"{gid}: finish {s['id']}: {e.response.status_code} {e.response.text[:200]}")
            return
        self.sessions.append(s["id"])
        self.session_tokens[s["id"]] = tokens
        self.completion_tokens += tokens

    async def _post(self, http: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
        """A session call; a retryable answer is tried again up to `retries` times, after its Retry-After."""
        for attempt in range(self.retries + 1):
            r = await http.post(path, json=body)
            if r.status_code not in (429, 503) or attempt == self.retries:
                r.raise_for_status()
                return r
            self.retried += 1
            await asyncio.sleep(retry_delay(r.headers.get("retry-after"), low=0.0, high=5.0, default=1.0))
        raise AssertionError("unreachable")

    async def _turn(self, agent: openai.AsyncOpenAI, messages: list[dict], max_tokens: int) -> tuple[str, int]:
        """One turn: (the reply's text, its completion tokens)."""
        if not self.stream:
            c = await agent.chat.completions.create(model=self.model, messages=messages, temperature=1.0,
                                                    max_tokens=max_tokens, **self.extra)
            return c.choices[0].message.content or "", c.usage.completion_tokens if c.usage else 0
        chunks = [c async for c in await agent.chat.completions.create(
            model=self.model, messages=messages, temperature=1.0, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, **self.extra)]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, next((c.usage.completion_tokens for c in reversed(chunks) if c.usage), 0)

    async def run(self, until: Callable[[], bool], timeout: float) -> bool:
        """Keep `lanes` groups in flight until `until()` or `timeout`; returns until()."""
        headers = {"Authorization": f"Bearer {self.api_key}"}
        deadline = time.monotonic() + timeout
        n = 0
        async with httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=120) as http:

            async def lane(i: int) -> None:
                nonlocal n
                while not until() and time.monotonic() < deadline:
                    n += 1
                    gid = f"g{i}-{n}-{self.rng.randint(0, 1 << 30)}"
                    await asyncio.gather(*(self.session(http, gid) for _ in range(self.group_size)))

            await asyncio.gather(*(lane(i) for i in range(self.lanes)))
        return until()

    def trajectories(self) -> list[dict]:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=30) as http:
            return [http.get(f"/sessions/{sid}").json() for sid in self.sessions]
