"""Per-step entropy, in-loop target-hit rate (exact answer), distinct answers a group and trainer's
reward, and the held-out accuracy, of bench/probe_learning.py `--task calc` runs (issue 26, SmolLM2):

    .venv/bin/python bench/plot_probe_calc.py OUT.png "seed 0=run0.log" "seed 1=run1.log"
    .venv/bin/python bench/plot_probe_calc.py OUT.png --metric exact --base sft.log --title "..." "seed 0=run0.log"

Each log holds the run's JSON summary line. A run started with --eval-start false takes its step-0
eval from --base (a log whose step-0 eval is the same eval: same prompts and noise, e.g. the
--sft-steps run that saved the start), or, without --base, from BASE: the runs of
docs/history/benchmarks-log.md ("SmolLM2-135M on calc", session 21). --metric: the held-out rate
drawn (lenient: the right number anywhere, exact: the task's target hit)."""
import argparse
import json
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BASE = {"sampled_lenient": 0.0781, "greedy_lenient": 0.4141}
TITLE = "SmolLM2-135M, calc 2-9 +- with 'Answer with the number only.', offline probe (bench/probe_learning.py)"


STEP = re.compile(r"^step +\d+ reward \S+ train (\S+) exact (\S+) distinct (\S+) .* ent (\S+) ")
EVAL = re.compile(r"^\[eval\] step +(\d+) (.*)")


def summary(path: str) -> dict:
    """The run's JSON summary line; a run stopped before it (killed, timed out) is read from its step and
    eval lines instead (the same figures, as printed: 3 decimals)."""
    found, steps, evals = {}, [], {}
    for line in open(path):
        if line.startswith("{"):
            found = json.loads(line)
        elif m := STEP.match(line):
            steps.append([float(x) for x in m.groups()])
        elif m := EVAL.match(line):
            kv = m.group(2).split()
            evals[m.group(1)] = {k: float(v) for k, v in zip(kv[::2], kv[1::2])}
    if found or not steps:
        return found
    train, exact, distinct, entropy = (list(c) for c in zip(*steps))
    return {"entropy": entropy, "batch_exact": exact, "batch_distinct": distinct, "batch_train_reward": train,
            "eval": evals}


ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("runs", nargs="+", help="LABEL=LOG")
ap.add_argument("--metric", choices=["lenient", "exact"], default="lenient")
ap.add_argument("--base", default="")
ap.add_argument("--title", default=TITLE)
a = ap.parse_args()
base = summary(a.base)["eval"]["0"] if a.base else BASE
runs = {label: summary(path) for label, path in (r.split("=", 1) for r in a.runs)}
fig, ax = plt.subplots(1, 5, figsize=(20, 3.6))
for k, (label, r) in enumerate(runs.items()):
    c = f"C{k}"
    ax[0].plot(r["entropy"], label=label, color=c)
    ax[1].plot(r["batch_exact"], label=label, color=c)
    if r.get("batch_distinct"):
        ax[2].plot(r["batch_distinct"], label=label, color=c)
    if r.get("batch_train_reward"):
        ax[3].plot(r["batch_train_reward"], label=label, color=c)
    ev = r["eval"]
    steps = sorted(ev, key=int)
    if "0" not in ev:  # a run without its step-0 eval: the base is the same eval (same prompts and noise)
        steps, ev = ["0"] + steps, {"0": base, **ev}
    for mode, mark in (("sampled", "o-"), ("greedy", "s--")):
        key = f"{mode}_{a.metric}"
        ax[4].plot([int(s) for s in steps], [ev[s].get(key, float("nan")) for s in steps], mark, color=c,
                   label=f"{label} {'T=1' if mode == 'sampled' else mode}")
ax[0].set_title("entropy of trained tokens (nats/token)")
ax[1].set_title("target-hit rate (exact answer), in loop")
ax[2].set_title("distinct final turns a group, in loop")
ax[3].set_title("trainer's reward, in loop")
ax[4].set_title(f"{a.metric} accuracy, held-out prompts")
ax[4].set_ylim(0, 1)
ax[1].set_ylim(-0.02, 1)
for x in ax:
    x.set_xlabel("step")
    x.legend(fontsize=7)
fig.suptitle(a.title, fontsize=9)
fig.tight_layout()
fig.savefig(a.out, dpi=90)
