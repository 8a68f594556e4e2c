"""bench/ha_stack.py's pure parts: the rounds' order, the window, the Sentinel URL's database, the
tallies and the ratios (the bench itself runs minutes; tests/bench/test_smoke.py runs it tiny)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.ha_stack import BASELINE, CONFIGS, Tally, in_window, order, ratios, with_db


def test_the_four_configurations_are_r1_and_r3_with_and_without_wait():
    assert {(c.replicas, c.wait) for c in CONFIGS} == {(1, 0), (1, 1), (3, 0), (3, 1)}
    assert BASELINE == "R1, no WAIT" and CONFIGS[0].replicas == 1 and CONFIGS[0].wait == 0


def test_each_configuration_takes_each_place_once_in_four_rounds():
    names = [c.name for c in CONFIGS]
    rounds = [order(k, names) for k in range(4)]
    assert all(sorted(r) == sorted(names) for r in rounds)
    for place in range(4):
        assert sorted(r[place] for r in rounds) == sorted(names)
    assert order(4, names) == order(0, names)


def test_only_turns_that_ended_in_the_window_count():
    lat = [(0.0, 0.5), (0.9, 0.2), (1.5, 1.0), (2.9, 0.2), (3.5, 0.1)]  # (start, seconds)
    assert in_window(lat, 1.0, 3.0) == [0.2, 1.0]


def test_each_stack_gets_a_database_of_its_own_behind_the_same_sentinels():
    url = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/sf/0"
    assert with_db(url, 3) == "redis+sentinel://127.0.0.1:1,127.0.0.1:2/sf/3"


def test_tally_pools_rounds_and_ratios_compare_with_the_baseline():
    base, other = Tally(), Tally()
    base.add([0.01] * 100, 10.0, [])
    base.add([0.01] * 100, 10.0, [])
    other.add([0.02] * 50, 10.0, ["x"])
    other.add([0.02] * 100, 10.0, [])
    rows = {BASELINE: base.row(), "R3, WAIT 1": other.row()}
    assert rows[BASELINE]["turns_per_s"] == 10.0 and rows[BASELINE]["p50_ms"] == pytest.approx(10.0)
    assert rows["R3, WAIT 1"]["turns_per_s"] == 7.5 and rows["R3, WAIT 1"]["failed_turns"] == 1
    rel = ratios(rows, {BASELINE: base.per_round, "R3, WAIT 1": other.per_round})
    assert rel[BASELINE] == {"turns_per_s": 1.0, "p50": 1.0, "p99": 1.0, "turns_per_s_round_median": 1.0}
    assert rel["R3, WAIT 1"]["turns_per_s"] == 0.75 and rel["R3, WAIT 1"]["p50"] == 2.0
    assert rel["R3, WAIT 1"]["turns_per_s_round_median"] == 0.75  # rounds 0.5 and 1.0
