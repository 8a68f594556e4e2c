"""The demo's report folder from synthetic data: every file is written, the PNGs decode at
their size, metrics.csv has a row per round, summary.md has the result and the command."""

from __future__ import annotations

import csv
import json
import random

import pytest
from matplotlib.image import imread

from seamlessflow.demo.report import (
    ReportData,
    build_report,
    margin,
    rolling,
    state_intervals,
    version_loads,
    worker_rates,
)
from seamlessflow.demo.rl import Round
from seamlessflow.demo.telemetry import Sample

T0 = 1_700_000_000.0


def synthetic(rounds: int = 24, scheduler: bool = True) -> ReportData:
    rng = random.Random(0)
    rds = []
    for i in range(rounds):
        base = 0.5 + 0.3 * i / rounds
        rds.append(Round(i, [min(1.0, max(0.0, base + rng.uniform(-0.2, 0.2))) for _ in range(8)],
                         [max(0, i - 2), max(0, i - 1)], seconds=2.0, tokens=160 + i, t_end=2.0 * (i + 1),
                         tool_calls=8, exact=i / rounds, entropy=1.0 - 0.5 * i / rounds, uniform_groups=i % 2))
    samples = []
    for w in ("rollout-0", "rollout-1"):
        for k in range(rounds * 2):
            state = "updating" if k % 4 == 3 else ("vacated" if w == "rollout-1" and 20 <= k < 26 else "serving")
            samples.append(Sample(T0 + k, w, state, k // 2, 40 * k))
    timeline = None
    if scheduler:
        timeline = {"policy": "seamless", "hosts": {
            "host-0": {"tags": ["train", "rollout"], "intervals": [["train", T0, T0 + 10], ["switch", T0 + 10, T0 + 12],
                                                                   ["rollout", T0 + 12, T0 + 30], ["idle", T0 + 30, T0 + 48]]},
            "host-1": {"tags": ["rollout"], "intervals": [["rollout", T0, T0 + 48]]}}}
    return ReportData(task="calc", rounds=rds, staleness=[1] * rounds, newest_version=[i for i in range(rounds)],
                      started_at=T0, samples=samples, host_timeline=timeline, settings={"seed": 3},
                      commands=["seamlessflow demo --task calc --seed 3"])


@pytest.mark.parametrize("scheduler", [True, False])
def test_report_folder(tmp_path, scheduler):
    traj = tmp_path / "t.jsonl"
    traj.write_text(json.dumps({"reward": 1.0}) + "\n")
    data = synthetic(scheduler=scheduler)
    data.trajectories = traj
    out = tmp_path / "report"
    files = build_report(out, data)
    names = {p.name for p in files}
    assert names == {"reward.png", "throughput.png", "versions.png", "timeline.png", "metrics.csv",
                     "trajectories.jsonl", "summary.md"}
    for name in ("reward.png", "throughput.png", "versions.png", "timeline.png"):
        img = imread(out / name)  # decodes
        assert img.shape[0] >= 300 and img.shape[1] >= 700 and img.std() > 0.05, name  # not blank
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert len(rows) == 24 and rows[0]["round"] == "1" and float(rows[-1]["tokens_per_s"]) == pytest.approx(91.5)
    assert rows[-1]["tool_calls"] == "8" and rows[-1]["max_version"] == "22"
    assert float(rows[-1]["exact_frac"]) == pytest.approx(23 / 24, abs=1e-4) and rows[-1]["uniform_groups"] == "1"
    assert float(rows[0]["entropy"]) == pytest.approx(1.0)
    first, last, k = margin(data.rounds)
    summary = (out / "summary.md").read_text()
    assert f"{first:.3f} -> {last:.3f}" in summary and "seamlessflow demo --task calc --seed 3" in summary
    assert "Exact answers: first 6 rounds" in summary and "12 groups had all-equal rewards" in summary
    assert "[timeline.png](timeline.png)" in summary and (out / "trajectories.jsonl").read_text() == traj.read_text()


def test_report_without_heartbeats_or_trajectories(tmp_path):
    data = synthetic(rounds=3, scheduler=False)
    data.samples = []
    files = build_report(tmp_path / "r", data)
    assert "trajectories.jsonl" not in {p.name for p in files}
    imread(tmp_path / "r" / "timeline.png")


def test_helpers():
    assert rolling([0, 1, 2, 3], window=2) == [0, 0.5, 1.5, 2.5]
    ivs = state_intervals([Sample(T0, "w", "serving", 0, 0), Sample(T0 + 1, "w", "serving", 0, 10),
                           Sample(T0 + 2, "w", "updating", 0, 20), Sample(T0 + 3, "w", "serving", 1, 30)], T0)
    assert ivs == {"w": [("serving", 0.0, 2.0), ("updating", 2.0, 3.0), ("serving", 3.0, 4.0)]}
    # a restarted worker's counter goes back to 0: that interval is skipped, not negative
    rates = worker_rates([Sample(T0, "w", "serving", 0, 0), Sample(T0 + 1, "w", "serving", 0, 50),
                          Sample(T0 + 2, "w", "serving", 0, 5)], T0)
    assert rates == [(2.5, 10.0)]
    loads = version_loads([Sample(T0 + 3, "w", "serving", 2, 0), Sample(T0, "w", "serving", 0, 0),
                           Sample(T0 + 1, "w", "updating", 0, 0), Sample(T0 + 2, "w", "serving", 1, 0),
                           Sample(T0 + 1, "v", "serving", 5, 0)], T0)
    assert loads == {"v": [], "w": [(2.0, 1), (3.0, 2)]}  # in time order; a worker's first heartbeat is no load


def test_host_activity_before_the_rounds_is_clipped_to_a_short_lead_in():
    from seamlessflow.demo.report import clip_before

    ivs = [("idle", -250.0, -3.0), ("switch", -3.0, -1.0), ("train", -1.0, 4.0), ("idle", -400.0, -300.0)]
    assert clip_before(ivs, -2.0) == [("switch", -2.0, -1.0), ("train", -1.0, 4.0)]
