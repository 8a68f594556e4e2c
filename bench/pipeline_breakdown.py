"""Where the physical limit goes, on SIMULATED clusters: host-seconds by what they were spent on.

    .venv/bin/python bench/pipeline_breakdown.py                       # fixed split, 64/48, diagnostics (~1 min)
    .venv/bin/python bench/pipeline_breakdown.py --steps 10 --no-diagnostics

No GPU and no model: services/scheduler/sim/simulator.py drives the scheduler's own policy.py, as in
bench/pipeline.py, on the same workload (decode-heavy, long tail, 30 steps). The physical limit
(sim/result.py) is every host busy at full efficiency; this script splits the rest of the
host-seconds into idle, switching, the trainer's publish, stalls (prefill, re-prefill, weight
loads), decode below full batch (a step of `a + b*k` s for k sequences makes k/K of a full step's
tokens), and tokens generated but not trained when the run ends. Decode time is also split by
batch size (eighths of K) and by who decodes while the trainer waits or trains.

The diagnostics rerun the fixed split with one physical constraint lifted at a time (a looser
staleness bound, no length tail, free switches). They are not benchmark settings: they say which
constraint holds the limit fraction down.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seamlessflow.planner.plan import run, scale_factors, sized
from services.scheduler import sim as S
from services.scheduler.sim.workload import CALIBRATIONS, WORKLOADS

EIGHTHS = 8
WHO = ("rollout hosts, trainer waiting", "rollout hosts, trainer busy", "lent pool, trainer waiting",
       "lent pool, draining")


class Metered(S.Simulator):
    """The simulator, unchanged, with decode time and tokens tallied per (who, batch eighth)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.tok_tick = np.zeros(len(self.mode))
        self.dtime, self.dtok = np.zeros((4, EIGHTHS)), np.zeros((4, EIGHTHS))
        self.stall_s, self.publish_s, self._tick = 0.0, 0.0, None

    def _generate(self, idx, hosts, adv):
        self.tok_tick += np.bincount(hosts, weights=adv, minlength=len(self.mode)) * self.w
        super()._generate(idx, hosts, adv)

    def _advance(self, t0, t1):
        rolling = (self.mode == 1) & (self.target == 1)
        use = np.where(rolling, np.minimum(self.stall, t1 - t0), 0.0)
        self._tick = (t1 - t0, rolling & (self.k_run > 0), use, self.k_run.copy(), self.tstate)
        if self.tstate == "publishing":
            self.publish_s += (t1 - t0) * len(self.pool_idx) * self.m
        return super()._advance(t0, t1)

    def _dispatch(self, t0, fh, ft):
        super()._dispatch(t0, fh, ft)  # a slot freed mid-tick is refilled here, its tokens credited
        if self._tick is not None:
            dt, busy, use, k, state = self._tick
            pool = np.zeros(len(self.mode), bool)
            pool[self.pool_idx] = True
            who = np.where(pool, 2, 0) + (state != "waiting")
            eighth = np.minimum((k * self.w / self.m / (self.cal.max_seqs / EIGHTHS)).astype(int), EIGHTHS - 1)
            for i in np.nonzero(busy)[0]:
                self.dtime[who[i], eighth[i]] += (dt - use[i]) * self.m
                self.dtok[who[i], eighth[i]] += self.tok_tick[i]
            self.stall_s += float(use.sum()) * self.m
        self.tok_tick[:] = 0


def metered(policy: str, hosts: int, split: int, steps: int) -> tuple[Metered, object]:
    """One run as seamlessflow.planner.plan.run makes it (same tick, replicas, host groups)."""
    cal = CALIBRATIONS["decode-heavy"]
    wl = sized(WORKLOADS["long-tail"], cal, hosts, fill=1.0)
    if policy == "colocated":
        wl = replace(wl, max_staleness=0)
    w, m = scale_factors(hosts, split, wl)
    dt = max(0.01, wl.mean_length() * cal.step_s(cal.max_seqs) / 100)
    sim = Metered(S.Cluster.uniform(hosts, split), cal, wl, policy, S.Options(steps=steps, dt=dt, replicas=w,
                                                                             host_group=m))
    return sim, sim.run()


def breakdown(policy: str, hosts: int, split: int, steps: int) -> list[str]:
    sim, r = metered(policy, hosts, split, steps)
    full = sim.cal.step_s(sim.cal.max_seqs) / sim.cal.max_seqs  # host-s per token at full batch
    total = hosts * r.wall_s
    ht = r.host_time.sum(axis=0) * sim.m / total
    dec, tok = sim.dtime.sum(), sim.dtok.sum()
    untrained = 1 - sim.tot.trained_generated / r.generated
    head = (f"**{policy}, {hosts} hosts, split {split}, {steps} steps**: {r.trained_tokens_per_s:,.0f} tok/s, "
            f"{r.limit_fraction:.1%} of the limit; step {r.wall_s / r.steps:.0f} s; trainer wait "
            f"{r.trainer_wait_fraction:.1%}; re-prefilled {r.reprefill_fraction:.2%}")
    lost = (f"| decoding | {dec / total:.1%}, at {tok * full / dec:.1%} of full-batch efficiency: "
            f"**{(dec - tok * full) / total:.1%} lost to small batches** |")
    out = [head, "",
           "| share of host-seconds | |", "|---|---|",
           f"| training (of which the publish, {sim.publish_s / total:.1%}) | {ht[0]:.1%} |",
           lost,
           f"| stalls: prefill, re-prefill, weight loads | {sim.stall_s / total:.1%} |",
           f"| switching | {ht[2]:.1%} |", f"| idle | {ht[3]:.1%} |",
           f"| generated, not trained when the run ended | {untrained:.1%} of generated tokens |", "",
           "| who decodes | of host-s | efficiency | time at k < K/8, K/8-K/4, ..., >= 7K/8 |", "|---|---|---|---|"]
    for i, name in enumerate(WHO):
        t = sim.dtime[i].sum()
        if t > 0:
            shares = " ".join(f"{x / t:.2f}" for x in sim.dtime[i])
            out.append(f"| {name} | {t / total:.1%} | {sim.dtok[i].sum() * full / t:.1%} | {shares} |")
    return [*out, ""]


def diagnostics(steps: int) -> list[str]:
    cal = CALIBRATIONS["decode-heavy"]
    wl = sized(WORKLOADS["long-tail"], cal, 64, fill=1.0)
    lifted = [("as benchmarked", wl, cal), ("max_staleness 2", replace(wl, max_staleness=2), cal),
              ("max_staleness 4", replace(wl, max_staleness=4), cal),
              ("no tail: every response the mean length", replace(wl, length="fixed",
                                                                  length_median=round(wl.mean_length())), cal),
              ("free switches (0.01 s)", wl, replace(cal, lend_s=0.01, reclaim_s=0.01))]
    out = ["**Fixed split (64 hosts, 32 train), one constraint lifted at a time (diagnostic only)**", "",
           "| lifted | disaggregated tok/s (of limit) | seamless tok/s (of limit) | seamless / disaggregated |",
           "|---|---|---|---|"]
    for name, w, c in lifted:
        d, s = (run(p, 64, 32, c, w, steps) for p in ("disaggregated", "seamless"))
        out.append(f"| {name} | {d.trained_tokens_per_s:,.0f} ({d.limit_fraction:.1%}) | "
                   f"{s.trained_tokens_per_s:,.0f} ({s.limit_fraction:.1%}) | "
                   f"{s.trained_tokens_per_s / d.trained_tokens_per_s:.3f} |")
    return [*out, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-diagnostics", action="store_true")
    a = ap.parse_args()
    md = ["SIMULATED (services/scheduler/sim/simulator.py driving services/scheduler/policy.py)", ""]
    for policy, hosts, split in (("seamless", 64, 32), ("disaggregated", 64, 32), ("seamless", 64, 48),
                                 ("colocated", 64, 48)):
        md += breakdown(policy, hosts, split, a.steps)
    if not a.no_diagnostics:
        md += diagnostics(a.steps)
    print("\n".join(md))


if __name__ == "__main__":
    main()
