"""Seamless against colocated-sync (decode-heavy, long tail, 64 hosts, SIMULATED): which lifted
constraint closes the gap. A diagnostic, not benchmark settings (docs/capacity-planning.md,
"Seamless against colocated-sync").

    .venv/bin/python bench/pipeline_colocated_gap.py [--steps 10] [--split 48]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from seamlessflow.planner.plan import run, sized  # noqa: E402
from services.scheduler.sim.workload import CALIBRATIONS, WORKLOADS  # noqa: E402


def main(steps: int, split: int) -> None:
    cal = CALIBRATIONS["decode-heavy"]
    wl = sized(WORKLOADS["long-tail"], cal, 64, fill=1.0)
    free = replace(cal, lend_s=0.01, reclaim_s=0.01)
    notail = replace(wl, length="fixed", length_median=round(wl.mean_length()))
    cases = [
        ("colocated, split %d (as benchmarked)" % split, "colocated", split, cal, wl),
        ("colocated, all 64 train", "colocated", 64, cal, wl),
        ("colocated, free switches", "colocated", split, free, wl),
        ("disaggregated", "disaggregated", split, cal, wl),
        ("seamless (as benchmarked)", "seamless", split, cal, wl),
        ("seamless, free switches", "seamless", split, free, wl),
        ("seamless, max_staleness 2", "seamless", split, cal, replace(wl, max_staleness=2)),
        ("seamless, max_staleness 4", "seamless", split, cal, replace(wl, max_staleness=4)),
        ("seamless, max_staleness 4 + free switches", "seamless", split, free, replace(wl, max_staleness=4)),
        ("seamless, max_staleness 8 + free switches", "seamless", split, free, replace(wl, max_staleness=8)),
        ("colocated, no tail", "colocated", split, cal, notail),
        ("seamless, no tail", "seamless", split, cal, notail),
    ]
    base = None
    print(f"steps {steps}, 64 hosts, split {split}")
    print("| case | trained tok/s | of limit | idle | trainer wait | switch s | / colocated (as benchmarked) | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, p, t, c, w in cases:
        t0 = time.time()
        r = run(p, 64, t, c, w, steps)
        row = r.row()
        if base is None:
            base = r.trained_tokens_per_s
        print(f"| {name} | {r.trained_tokens_per_s:,.0f} | {r.limit_fraction:.1%} | {row['idle']:.1%} | "
              f"{row['trainer_wait']:.1%} | {row['switch_s']:,} | {r.trained_tokens_per_s / base:.3f} | {time.time()-t0:.0f} |",
              flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="simulated training steps per case")
    ap.add_argument("--split", type=int, default=48, help="train hosts of 64")
    a = ap.parse_args()
    main(a.steps, a.split)
