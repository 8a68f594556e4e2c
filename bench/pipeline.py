"""Pipeline benchmark on SIMULATED clusters: the three placement policies side by side.

    .venv/bin/python bench/pipeline.py [--steps 30] [--sweep-steps 10] [--out var/bench/pipeline]
                                       [--reclaim-grace 0] [--drain-margin 0] [--skip-scale] [--skip-drain]
                                       [--rebalance [--move-all]] [--only-one-gpu]

No GPU and no model: services/scheduler/sim/simulator.py drives the scheduler's own policy module
(services/scheduler/policy.py) in virtual time on calibrated 8-accelerator hosts
(docs/capacity-planning.md). Every figure here is simulated.

One run measures, on the same workload and cluster for every policy:
1. side by side at 16 and 64 hosts (decode-heavy, long tail), at the split where seamless
   does best: trained tokens/s and its fraction of the physical limit, idle (per host and
   overall), staleness, trainer wait, lends/reclaims, time switching, re-prefilled tokens;
   Gantt PNGs of every host's timeline (16 hosts), one per policy;
2. the split sweep: disaggregated against seamless at every train/rollout split (16 hosts)
   and on a grid (64 hosts);
3. a fixed-split case: the train pool fixed (by memory) at half of 64 hosts, where
   disaggregated leaves the trainer waiting >= 40% of the time;
4. the train-heavy calibration at 8-accelerator granularity: seamless against the best
   static split;
5. the planner's time bound (4,096 hosts x 1,000 steps);
6. the drain trade-off: seamless at every reclaim grace x drain margin (policy.py) beside
   disaggregated, at 16 and 64 hosts (the splits of 1) and in the fixed split: re-prefilled
   tokens against trained tokens/s;
7. the second public calibration, an independent model's (`one-gpu` hosts, workload
   `one-gpu-reasoning`, docs/capacity-planning.md): 64 hosts at every split from 8 to 60 (by 4),
   disaggregated, seamless under each lent-host rule (shared/lending.py: "migrate", the
   default, and "fit"), re-prefilled tokens and lent-idle host-seconds; colocated; and the
   default rule again where a re-prefilled token costs as much as a trained one's forward pass;
and prints the goals as ratios (markdown), writing results.json and the PNGs under --out.
`--reclaim-grace` / `--drain-margin` set the drain of every seamless run in 1-5. `--rebalance`
models the live router's rebalance on a lend (SF_TRAJECTORY_REBALANCE, on live by default; off
here by default, as the recorded planning runs were made) in every run, each move under the
per-request worth test (shared/lending.py `move_worth`); `--move-all` moves the whole share, with no test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seamlessflow.planner import plan
from seamlessflow.planner.plan import POLICIES, plot_sweep, sized, splits
from services.scheduler.sim.workload import CALIBRATIONS, WORKLOADS
from shared.lending import DEFAULT_RULE, RULES

COLORS = {"train": "#d62728", "rollout": "#2ca02c", "switch": "#ff7f0e", "idle": "#c7c7c7"}


def gantt(result, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(11, 0.3 * result.hosts + 1.2))
    by = {}
    for h, a, b, act in result.timeline:
        by.setdefault(act, []).append((h, a, b))
    for act, spans in by.items():
        for h, a, b in spans:
            ax.broken_barh([(a, b - a)], (h - 0.4, 0.8), color=COLORS[act], linewidth=0)
    ax.set_ylim(-0.6, result.hosts - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("virtual seconds (SIMULATED)")
    ax.set_ylabel("host")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


DRAIN: dict = {}  # reclaim_grace_s and drain_margin_s of every seamless run (set by main)
ROUTER: dict = {}  # the live router's options of every run, every policy (set by main): rebalance


def run(*args, **kw):
    """plan.run with ROUTER's options."""
    return plan.run(*args, **(ROUTER | kw))
GRACES, DRAIN_MARGINS = (0.0, 30.0, 60.0, 75.0, 90.0), (0.0, 60.0)  # the drain trade-off's grid


def sweep(hosts, cal, wl, steps, grid):
    rows = []
    for t in grid:
        rows.append({"train_hosts": t, **{p: run(p, hosts, t, cal, wl, steps, **DRAIN).trained_tokens_per_s
                                          for p in ("disaggregated", "seamless")}})
    return rows


def drain_tradeoff(hosts, split, cal, wl, steps) -> dict:
    """Seamless at every (grace, drain margin) beside disaggregated, same workload and split."""
    dis = run("disaggregated", hosts, split, cal, wl, steps).row()
    rows = []
    for g in GRACES:
        for dm in DRAIN_MARGINS:
            r = run("seamless", hosts, split, cal, wl, steps, reclaim_grace_s=g, drain_margin_s=dm).row()
            rows.append({"reclaim_grace_s": g, "drain_margin_s": dm, **r,
                         "vs_disaggregated": r["trained_tok_s"] / dis["trained_tok_s"]})
    return {"hosts": hosts, "split": split, "disaggregated": dis, "seamless": rows}


def md_drain(title, t) -> str:
    lines = [f"**{title}**: disaggregated {t['disaggregated']['trained_tok_s']:,} tok/s", "",
             "| reclaim grace s | drain margin s | trained tok/s | / disaggregated | re-prefilled | trainer wait | "
             "idle | of limit |", "|---|---|---|---|---|---|---|---|"]
    for r in t["seamless"]:
        lines.append(f"| {r['reclaim_grace_s']:g} | {r['drain_margin_s']:g} | {r['trained_tok_s']:,} | "
                     f"{r['vs_disaggregated']:.3f} | {r['reprefill_fraction']:.2%} | {r['trainer_wait']:.1%} | "
                     f"{r['idle']:.1%} | {r['limit_fraction']:.1%} |")
    return "\n".join(lines)


def side_by_side(hosts, split, cal, wl, steps, out: Path | None):
    res = {}
    for p in POLICIES:
        r = run(p, hosts, split, cal, wl, steps, timeline=out is not None, **DRAIN)
        if out is not None:
            gantt(r, out / f"gantt-{hosts}-{p}.png", f"{p}: {hosts} hosts, split {split}, {cal.name} (SIMULATED)")
        res[p] = r.row() | {"idle_per_host": [round(x, 4) for x in r.idle_per_host]}
    return res


def md_policies(title, res) -> str:
    lines = [f"**{title}**", "", ("| policy | trained tok/s | of limit | idle (max host) | staleness mean / max | "
                                  "trainer wait | lends / reclaims | switching s | re-prefilled |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for p, r in res.items():
        lines.append(f"| {p} | {r['trained_tok_s']:,} | {r['limit_fraction']:.1%} | {r['idle']:.1%} "
                     f"({r['idle_host_max']:.1%}) | {r['staleness_mean']:.2f} / {r['staleness_max']} | "
                     f"{r['trainer_wait']:.1%} | {r['lends']} / {r['reclaims']} | {r['switch_s']:,} | "
                     f"{r['reprefill_fraction']:.2%} |")
    return "\n".join(lines)


def long_tail(hosts: int, dh, a: argparse.Namespace) -> tuple[dict, list[str]]:
    """1 + 2 at `hosts` hosts: the split sweep, then the three policies at seamless's best split
    (their results, and their lines of the report)."""
    wl = sized(WORKLOADS["long-tail"], dh, hosts, fill=1.0)
    grid = list(range(1, hosts)) if hosts <= 16 else splits(hosts, 8)
    sw = sweep(hosts, dh, wl, a.sweep_steps, grid)
    plot_sweep(sw, a.out / f"sweep-{hosts}.png", f"{hosts} hosts, decode-heavy, long tail (SIMULATED)")
    best = max(sw, key=lambda r: r["seamless"])["train_hosts"]
    res = side_by_side(hosts, best, dh, wl, a.steps, a.out if hosts == 16 else None)
    md = [md_policies(f"{hosts} hosts, decode-heavy, long tail, split {best} train / {hosts - best} rollout", res), ""]
    md += ["| train hosts | " + " | ".join(str(r["train_hosts"]) for r in sw) + " |",
           "|---|" + "---|" * len(sw),
           "| seamless / disaggregated | " + " | ".join(f"{r['seamless'] / r['disaggregated']:.3f}" for r in sw)
           + " |", ""]
    return {"sweep": sw, "split": best, "policies": res}, md


def one_gpu(steps: int) -> dict:
    """7: the independent model's calibration, its batch as it is (not sized to the cluster)."""
    cal, wl = CALIBRATIONS["one-gpu"], WORKLOADS["one-gpu-reasoning"]
    rows = []
    for t in range(8, 61, 4):
        row = {"train_hosts": t, "disaggregated": run("disaggregated", 64, t, cal, wl, steps).row()}
        row |= {rule: run("seamless", 64, t, cal, wl, steps, lent_rule=rule).row() for rule in RULES}
        rows.append(row)
    colocated = run("colocated", 64, 32, cal, wl, steps).row()
    # a re-prefilled token at a forward pass of training (2.8 ms / 4 passes), not at prefill's 15 k tok/s
    dear = replace(cal, prefill_s_per_token=cal.train_s_per_token / 4)
    costly = {rule: run("seamless", 64, 60, dear, wl, steps, lent_rule=rule).row() for rule in RULES}
    return {"sweep": rows, "colocated": colocated, "dear_reprefill_split_60": costly}


def md_one_gpu(t: dict) -> str:
    lines = [f"**one-gpu (the independent model's calibration), 64 hosts**: colocated "
             f"{t['colocated']['trained_tok_s']:,} tok/s; lent-host rule default \"{DEFAULT_RULE}\"", "",
             "| train hosts | disaggregated tok/s (idle) | " + " | ".join(
                 f"seamless {r} / disaggregated (idle, re-prefilled tokens, lent-idle host-s of lent)" for r in RULES)
             + " |", "|---|---|" + "---|" * len(RULES)]
    for row in t["sweep"]:
        d = row["disaggregated"]
        cells = [f"{row[r]['trained_tok_s'] / d['trained_tok_s']:.3f} ({row[r]['idle']:.1%}, "
                 f"{row[r]['reprefilled']:,} = {row[r]['reprefill_fraction']:.1%}, "
                 f"{row[r]['lent_idle_s']:,.0f} of {row[r]['lent_s']:,.0f})" for r in RULES]
        lines.append(f"| {row['train_hosts']} | {d['trained_tok_s']:,} ({d['idle']:.1%}) | " + " | ".join(cells) + " |")
    c, d60 = t["dear_reprefill_split_60"], t["sweep"][-1]["disaggregated"]["trained_tok_s"]
    lines += ["", "Split 60, a re-prefilled token at a training forward pass (0.7 ms): " + ", ".join(
        f"{r} {c[r]['trained_tok_s'] / d60:.3f}x ({c[r]['reprefill_fraction']:.1%} re-prefilled)" for r in RULES)]
    return "\n".join(lines)


def one_gpu_goals(t: dict) -> list[tuple]:
    at60 = t["sweep"][-1]
    best = max(row[DEFAULT_RULE]["trained_tok_s"] for row in t["sweep"])
    worst = min(row[DEFAULT_RULE]["trained_tok_s"] / row["disaggregated"]["trained_tok_s"] for row in t["sweep"])
    return [("one-gpu: seamless / disaggregated, split 60 of 64",
             at60[DEFAULT_RULE]["trained_tok_s"] / at60["disaggregated"]["trained_tok_s"], 1.35, ">="),
            ("one-gpu: seamless overall idle, split 60 of 64", at60[DEFAULT_RULE]["idle"], 0.20, "<="),
            ("one-gpu: seamless / disaggregated, worst split 8..60", worst, 0.99, ">="),
            ("one-gpu: best seamless / colocated", best / t["colocated"]["trained_tok_s"], 2.4, ">=")]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sweep-steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("var/bench/pipeline"))
    ap.add_argument("--skip-scale", action="store_true", help="skip the 4,096-host time bound")
    ap.add_argument("--skip-drain", action="store_true", help="skip the drain trade-off (6)")
    ap.add_argument("--skip-one-gpu", action="store_true", help="skip the one-gpu calibration (7)")
    ap.add_argument("--reclaim-grace", type=float, default=0.0, help="reclaim_grace_s of every seamless run in 1-5")
    ap.add_argument("--drain-margin", type=float, default=0.0, help="drain_margin_s of every seamless run in 1-5")
    ap.add_argument("--rebalance", action="store_true",
                    help="model the live router's rebalance on a lend (SF_TRAJECTORY_REBALANCE) in every run")
    ap.add_argument("--move-all", action="store_true",
                    help="with --rebalance: move the `rebalanced` share, youngest first, without the per-request worth "
                         "test (SF_TRAJECTORY_REBALANCE_WORTH=0; the behaviour before it)")
    ap.add_argument("--only-one-gpu", action="store_true", help="run 7 alone (its goals only)")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    DRAIN.update(reclaim_grace_s=a.reclaim_grace, drain_margin_s=a.drain_margin)
    ROUTER.update(rebalance=a.rebalance, rebalance_worth=not a.move_all)
    a.out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    dh, th = CALIBRATIONS["decode-heavy"], CALIBRATIONS["train-heavy"]
    report: dict = {}
    md: list[str] = [("SIMULATED (services/scheduler/sim/simulator.py driving services/scheduler/policy.py); "
                      f"`.venv/bin/python bench/pipeline.py --steps {a.steps} --sweep-steps {a.sweep_steps}"
                      f" --reclaim-grace {a.reclaim_grace:g} --drain-margin {a.drain_margin:g}"
                      + " --rebalance" * a.rebalance + " --move-all" * a.move_all + " --only-one-gpu" * a.only_one_gpu
                      + "`"), ""]
    if a.only_one_gpu:
        return only_one_gpu(a, md, t_all)

    # 1 + 2: sweeps, then the three policies at seamless's best split
    for hosts in (16, 64):
        report[f"long-tail-{hosts}"], lines = long_tail(hosts, dh, a)
        md += lines

    # 3: fixed split: train pool = half the hosts (memory), training fast next to rollout
    wl64 = sized(WORKLOADS["long-tail"], dh, 64, fill=1.0)
    fixed = {p: run(p, 64, 32, dh, wl64, a.steps, **DRAIN).row() for p in ("disaggregated", "seamless")}
    report["fixed-split"] = fixed
    md += [md_policies("fixed split: 64 hosts, 32 train (fixed by memory), decode-heavy, long tail", fixed), ""]

    # 4: train-heavy at 8-accelerator granularity: best static split vs seamless's best
    wl16 = sized(WORKLOADS["long-tail"], th, 16, fill=1.0)
    sw_th = sweep(16, th, wl16, a.sweep_steps, list(range(1, 16)))
    plot_sweep(sw_th, a.out / "sweep-16-train-heavy.png", "16 hosts, train-heavy, long tail (SIMULATED)")
    report["train-heavy-16"] = sw_th

    # 5: the planner's time bound
    if not a.skip_scale:
        t0 = time.perf_counter()
        wl4k = sized(WORKLOADS["long-tail"], dh, 4096, fill=1.0)
        big = run("seamless", 4096, 2048, dh, wl4k, 1000).row()
        report["scale"] = {"seconds": time.perf_counter() - t0, "result": big}

    # 6: the drain trade-off, at the splits above and in the fixed split
    if not a.skip_drain:
        cases = [(16, report["long-tail-16"]["split"]), (64, report["long-tail-64"]["split"]), (64, 32)]
        report["drain"] = []
        for hosts, split in cases:
            wl = sized(WORKLOADS["long-tail"], dh, hosts, fill=1.0)
            t = drain_tradeoff(hosts, split, dh, wl, a.steps)
            report["drain"].append(t)
            md += [md_drain(f"Drain trade-off, {hosts} hosts, split {split}" + (" (fixed)" if split == 32 else ""), t), ""]

    # 7: the second public calibration
    if not a.skip_one_gpu:
        report["one-gpu"] = one_gpu(a.steps)
        md += [md_one_gpu(report["one-gpu"]), ""]

    md += md_goals(report)
    report["seconds"] = time.perf_counter() - t_all
    (a.out / "results.json").write_text(json.dumps(report, indent=1))
    print("\n".join(md))
    print(f"\n{report['seconds']:.0f} s; results and PNGs in {a.out}")


def only_one_gpu(a: argparse.Namespace, md: list[str], t_all: float) -> None:
    """7 alone, with its goals."""
    report = {"one-gpu": one_gpu(a.steps)}
    md += [md_one_gpu(report["one-gpu"]), "", "**Goals** (ratios from this run)", "",
           "| goal | measured | target |", "|---|---|---|"]
    md += [f"| {n} | {v:.4f} | {o} {t:g} |" for n, v, t, o in one_gpu_goals(report["one-gpu"])]
    report["seconds"] = time.perf_counter() - t_all
    (a.out / "results.json").write_text(json.dumps(report, indent=1))
    print("\n".join(md) + f"\n\n{report['seconds']:.0f} s; results in {a.out}")


def md_goals(report: dict) -> list[str]:
    """The goals' table, and report["goals"] set to what it shows."""
    g = goals(report)
    md = ["**Goals** (ratios from this run)", "", "| goal | measured | target | met | by |", "|---|---|---|---|---|"]
    for name, v, target, op in g:
        ok = {">=": v >= target, "<": v < target, "<=": v <= target}[op]
        md.append(f"| {name} | {v:.4f} | {op} {target:g} | {'yes' if ok else 'NO'} | "
                  f"{(v / target - 1) * 100:+.2f}% |")
    report["goals"] = [{"goal": n, "measured": v, "target": t, "op": o} for n, v, t, o in g]
    return md


def goals(report: dict) -> list[tuple[str, float, float, str]]:
    """The goals as ratios measured in this run: (name, measured, target, ">=" or "<")."""
    lt64, fixed, sw_th = report["long-tail-64"], report["fixed-split"], report["train-heavy-16"]
    g = []
    r1 = lt64["policies"]["seamless"]["trained_tok_s"] / lt64["policies"]["colocated"]["trained_tok_s"]
    g.append(("seamless / colocated-sync, long tail, 64 hosts, recommended split", r1, 2.0, ">="))
    worst = min(min(r["seamless"] / r["disaggregated"] for r in report[k]["sweep"]) for k in ("long-tail-16", "long-tail-64"))
    g.append(("seamless / disaggregated, worst split (16 and 64 hosts)", worst, 0.99, ">="))
    g.append(("seamless / disaggregated, fixed split", fixed["seamless"]["trained_tok_s"] / fixed["disaggregated"]["trained_tok_s"], 1.2, ">="))
    g.append(("(fixed split: disaggregated trainer wait)", fixed["disaggregated"]["trainer_wait"], 0.40, ">="))
    g.append(("seamless best / best static split, train-heavy, 16 hosts",
              max(r["seamless"] for r in sw_th) / max(r["disaggregated"] for r in sw_th), 1.15, ">="))
    g.append(("fixed split, seamless overall idle", fixed["seamless"]["idle"], 0.05, "<"))
    g.append(("fixed split, seamless fraction of physical limit", fixed["seamless"]["limit_fraction"], 0.90, ">="))
    rp = max(lt64["policies"]["seamless"]["reprefill_fraction"], fixed["seamless"]["reprefill_fraction"],
             report["long-tail-16"]["policies"]["seamless"]["reprefill_fraction"])
    g.append(("re-prefilled / generated tokens, seamless (worst of the runs above)", rp, 0.02, "<"))
    for t in report.get("drain", []):  # the fastest drain setting under 2% re-prefill, against disaggregated
        ok = [r for r in t["seamless"] if r["reprefill_fraction"] < 0.02]
        name = f"drain trade-off, {t['hosts']} hosts, split {t['split']}: fastest under 2% re-prefill / disaggregated"
        if ok:
            b = max(ok, key=lambda r: r["trained_tok_s"])
            g.append((f"{name} (grace {b['reclaim_grace_s']:g} s, margin {b['drain_margin_s']:g} s)",
                      b["vs_disaggregated"], 0.99, ">="))
        else:
            g.append((f"{name}: none tried", 0.0, 0.99, ">="))
    if "scale" in report:
        g.append(("4,096 hosts x 1,000 steps (seamless, one policy), seconds", report["scale"]["seconds"], 60.0, "<"))
    if "one-gpu" in report:
        g += one_gpu_goals(report["one-gpu"])
    return g


if __name__ == "__main__":
    main()
