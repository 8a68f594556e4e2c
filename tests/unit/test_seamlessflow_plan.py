"""`seamlessflow plan` (SIMULATED): the parallel planner gives what the serial one gives, and
its progress adds up to the bar's total."""

from __future__ import annotations

from collections import Counter

import pytest

import seamlessflow.planner.plan as plan_mod
from seamlessflow.planner.plan import (
    DRAIN_MARGINS,
    GRACES,
    MARGINS,
    POLICIES,
    Search,
    jobs,
    pick_drain,
    plan,
    run,
    sized,
    splits,
)
from services.scheduler.sim.workload import CALIBRATIONS, WORKLOADS

CAL = CALIBRATIONS["decode-heavy"]


def _plan(workers: int):
    wl = sized(WORKLOADS["long-tail"], CAL, 4, fill=0.5)
    ticks: Counter[str] = Counter()
    search = Search(steps=4, sweep_steps=2, margins=(1.0, 3.0), graces=(0.0, 60.0), drain_margins=(0.0,))
    p = plan(4, CAL, wl, search, workers=workers, progress=lambda what, k: ticks.update({what: k}))
    return p, ticks


@pytest.fixture(scope="module")
def serial_plan():
    """The serial plan, made once for the module (~1.3 s of simulation): three tests read it."""
    return _plan(workers=1)


def test_parallel_and_serial_plans_agree_and_progress_adds_up(serial_plan):
    serial, serial_ticks = serial_plan
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


def test_reused_rows_are_the_runs_they_stand_for(serial_plan):
    """colocated starts before the sweep (the split does not change its run), the default threshold's
    trial is the sweep's row, and the drain trial without grace or margin is the winning threshold's
    row: each equals the run made directly."""
    p, _ = serial_plan
    wl = sized(WORKLOADS["long-tail"], CAL, 4, fill=0.5)
    assert p.results[0] == run("colocated", 4, p.split, CAL, wl, 4).row()
    plain = next(r for r in p.drains if (r["reclaim_grace_s"], r["drain_margin_s"]) == (0.0, 0.0))
    direct = run("seamless", 4, p.split, CAL, wl, 2, lend_margin=p.lend_margin).row()
    assert {k: plain[k] for k in ("trained_tok_s", "reprefill_fraction")} == \
        {k: direct[k] for k in ("trained_tok_s", "reprefill_fraction")}


def test_the_sweep_runs_every_other_split_then_the_neighbours_of_the_best(monkeypatch):
    """A fake simulator whose seamless peaks at a split off the coarse grid: the plan finds it,
    runs no split twice, leaves the far splits out, and runs each final policy once."""
    calls: list[tuple] = []

    def fake(t):
        calls.append((t.policy, t.train_hosts, t.label, t.lend_margin, t.reclaim_grace_s, t.drain_margin_s))
        tok = 1000 - 10 * abs(t.train_hosts - 10) if t.policy == "seamless" else 500
        plan_mod._progress_queue.put((t.label, t.steps if t.label in POLICIES else 1))
        return {"policy": t.policy, "trained_tok_s": tok - t.reclaim_grace_s,
                "reprefill_fraction": 0.05 - t.reclaim_grace_s / 1000, "trainer_wait": 0.5, "idle": 0.1,
                "steps": t.steps, "train_hosts": t.train_hosts}

    monkeypatch.setattr(plan_mod, "_run_row", fake)
    ticks: Counter[str] = Counter()
    wl = sized(WORKLOADS["long-tail"], CAL, 16)
    p = plan(16, CAL, wl, Search(steps=5, sweep_steps=2), workers=1, progress=lambda what, k: ticks.update({what: k}))
    grid = splits(16)
    assert grid == list(range(1, 16)) and p.split == 10
    swept = [r["train_hosts"] for r in p.sweep]
    assert swept == sorted(set(grid[::2]) | {8, 10})  # 9 and 11 tie; the first, 9, is refined
    sweep_calls = [c for c in calls if c[2] == "sweep"]
    assert len(sweep_calls) == len(set(sweep_calls)) == 2 * len(swept)
    # the default threshold (the sweep ran it) and the drain setting (0, 0) are not run again
    assert sorted(c[3] for c in calls if c[2] == "margin") == [1.0, 3.0]
    assert (0.0, 0.0) not in [(c[4], c[5]) for c in calls if c[2] == "drain"]
    assert sorted(c[0] for c in calls if c[2] in POLICIES) == sorted(POLICIES)
    assert sum(ticks.values()) == jobs(grid, MARGINS, GRACES, DRAIN_MARGINS, 5)


def test_the_table_shows_lent_idle_host_seconds_and_a_public_batch_is_kept(serial_plan):
    """A host lent and given no turn is a defect: `plan` prints its host-seconds beside the lent
    ones; the one-gpu workload's batch (512 samples) is the calibration's, not sized to the hosts."""
    p, _ = serial_plan
    text = plan_mod.table(p)
    assert "lent-idle host-s (of lent)" in text
    seamless = next(r for r in p.results if r["policy"] == "seamless")
    assert f"{seamless['lent_idle_s']:,.0f} ({seamless['lent_s']:,.0f})" in text
    assert "one-gpu-reasoning" in plan_mod.FIXED_BATCH and WORKLOADS["one-gpu-reasoning"].batch_samples == 512
