"""`seamlessflow plan` (SIMULATED): the parallel planner gives what the serial one gives, and
its progress adds up to the bar's total."""

from __future__ import annotations

from collections import Counter

from seamlessflow.plan import POLICIES, pick_drain, plan, sized, splits
from services.scheduler.sim_workload import CALIBRATIONS, WORKLOADS

CAL = CALIBRATIONS["decode-heavy"]


def _plan(workers: int):
    wl = sized(WORKLOADS["long-tail"], CAL, 4, fill=0.5)
    ticks: Counter[str] = Counter()
    p = plan(4, CAL, wl, steps=4, sweep_steps=2, margins=(1.0, 3.0), workers=workers,
             progress=lambda what, k: ticks.update({what: k}), graces=(0.0, 60.0), drain_margins=(0.0,))
    return p, ticks


def test_parallel_and_serial_plans_agree_and_progress_adds_up():
    serial, serial_ticks = _plan(workers=1)
    parallel, parallel_ticks = _plan(workers=2)
    for p in (serial, parallel):
        assert [r["policy"] for r in p.results] == list(POLICIES)
        assert p.split in splits(4) and p.lend_margin in (1.0, 3.0)
        assert all(r["steps"] == 4 for r in p.results)
        assert [r["train_hosts"] for r in p.results] == [0, p.split, p.split]  # colocated: every host trains
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa: E731
    assert serial.sweep == parallel.sweep and serial.margins == parallel.margins and serial.drains == parallel.drains
    assert [(r["reclaim_grace_s"], r["drain_margin_s"]) for r in serial.drains] == [(0.0, 0.0), (60.0, 0.0)]
    assert (serial.reclaim_grace_s, serial.drain_margin_s) in [(0.0, 0.0), (60.0, 0.0)] and serial.drain_note
    assert strip(serial.results) == strip(parallel.results)
    expected = {"sweep": 2 * len(splits(4)), "margin": 2, "drain": 2} | {pol: 4 for pol in POLICIES}
    assert serial_ticks == parallel_ticks == expected


def test_the_recommended_drain_setting_meets_the_reprefill_budget_or_says_why():
    rows = [{"reclaim_grace_s": 0.0, "drain_margin_s": 0.0, "trained_tok_s": 170, "reprefill_fraction": 0.064},
            {"reclaim_grace_s": 60.0, "drain_margin_s": 0.0, "trained_tok_s": 149, "reprefill_fraction": 0.030},
            {"reclaim_grace_s": 90.0, "drain_margin_s": 0.0, "trained_tok_s": 143, "reprefill_fraction": 0.000},
            {"reclaim_grace_s": 90.0, "drain_margin_s": 60.0, "trained_tok_s": 146, "reprefill_fraction": 0.001}]
    best, why = pick_drain(rows, disaggregated=131)
    assert (best["reclaim_grace_s"], best["drain_margin_s"]) == (90.0, 60.0) and "fastest under 2%" in why
    # the budget cannot be met at >= 0.99x disaggregated: the fastest is kept, and the note says so
    best, why = pick_drain(rows, disaggregated=150)
    assert best["trained_tok_s"] == 170 and why.startswith("no setting")
