"""Per-step entropy, in-loop target-hit rate (exact answer) and trainer's reward, and the held-out
lenient accuracy, of bench/probe_learning.py `--task calc` runs (issue 26, SmolLM2):

    .venv/bin/python bench/plot_probe_calc.py OUT.png "seed 0=run0.log" "seed 1=run1.log"

Each log holds the run's JSON summary line. BASE: the step-0 eval of the runs in
docs/history/benchmarks-log.md ("SmolLM2-135M on calc"), for a run started with --eval-start false."""
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

runs = {}
BASE = {"sampled_lenient": 0.0781, "greedy_lenient": 0.4141}
for name in sys.argv[2:]:
    label, path = name.split("=")
    for line in open(path):
        if line.startswith("{"):
            runs[label] = json.loads(line)
fig, ax = plt.subplots(1, 4, figsize=(16, 3.6))
for k, (label, r) in enumerate(runs.items()):
    c = f"C{k}"
    ax[0].plot(r["entropy"], label=label, color=c)
    ax[1].plot(r["batch_exact"], label=label, color=c)
    if r.get("batch_train_reward"):
        ax[2].plot(r["batch_train_reward"], label=label, color=c)
    ev = r["eval"]
    steps = sorted(ev, key=int)
    if "0" not in ev:  # a run without its step-0 eval: the base is the same eval (same prompts and noise)
        steps, ev = ["0"] + steps, {"0": BASE, **ev}
    ax[3].plot([int(s) for s in steps], [ev[s]["sampled_lenient"] for s in steps], "o-", color=c, label=label + " T=1")
    ax[3].plot([int(s) for s in steps], [ev[s]["greedy_lenient"] for s in steps], "s--", color=c, label=label + " greedy")
ax[0].set_title("entropy of trained tokens (nats/token)")
ax[1].set_title("target-hit rate (exact answer), in loop")
ax[2].set_title("trainer's reward (lenient), in loop")
ax[3].set_title("lenient accuracy, 128 held-out prompts")
ax[3].set_ylim(0, 1)
ax[1].set_ylim(-0.02, 1)
for a in ax:
    a.set_xlabel("step"); a.legend(fontsize=7)
fig.suptitle("SmolLM2-135M, calc 2-9 +- with 'Answer with the number only.', offline probe (bench/probe_learning.py)", fontsize=9)
fig.tight_layout()
fig.savefig(sys.argv[1], dpi=90)
