"""bench/weight_update_stall.py's stall arithmetic on synthetic requests: a request in flight at an
instant is likelier a slow one, so the raw spanning excess is biased upward where an update costs
nothing; the control (requests in flight half-way between updates) measures that bias, and the net
stall recovers the cost an update really adds (the bench itself runs minutes: smoke run in tests/bench)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.weight_update_stall import gap_excess_ms, gap_stall, halfway, in_flight, summarize  # noqa: E402


def closed_loop(seed: int, cost_s: float, every: float = 3.0, seconds: float = 600.0, agents: int = 2) -> dict:
    """Agents in a closed loop; latencies 0.4-0.9 s at random (same token count); a request in flight
    at an update (every `every` s) takes `cost_s` longer."""
    rng = random.Random(seed)
    times = [every * k for k in range(1, int(seconds / every))]
    done = []
    for _ in range(agents):
        t = rng.uniform(0, 1)
        while t < seconds:
            lat = rng.uniform(0.4, 0.9)
            if any(t < u < t + lat for u in times):
                lat += cost_s
            done.append({"t0": t, "t1": t + lat, "latency": lat, "tokens": 48, "segments": 1, "stamps": [],
                         "recorded": 48})
            t += lat
    return {"done": done, "times": times, "events": len(times), "sampled": 48 * len(done)}


def test_halfway_instants_and_in_flight():
    assert halfway([3.0, 6.0, 9.0]) == [4.5, 7.5]
    assert halfway([3.0]) == []
    assert in_flight({"t0": 1.0, "t1": 2.0}, [1.5]) and not in_flight({"t0": 1.0, "t1": 2.0}, [2.5])


def test_an_update_that_costs_nothing_shows_a_raw_excess_and_a_net_near_zero():
    row = summarize("lora", closed_loop(0, cost_s=0.0), {48: 0.65})
    assert row["stall_p50_ms"] > 40  # length bias alone: ~+80 ms on uniform 0.4-0.9 s latencies
    assert row["control"] > 100
    assert abs(row["stall_net_p50_ms"]) < 15


def test_an_update_that_costs_30_ms_nets_about_30_ms():
    row = summarize("lora", closed_loop(1, cost_s=0.030), {48: 0.65})
    assert 15 < row["stall_net_p50_ms"] < 45
    assert row["tokens_lost"] == 0


def streamed_request(t0: float, gap: float, n: int, pause_at: float | None = None, pause: float = 0.0) -> dict:
    stamps, t = [t0], t0
    for _ in range(n):
        t += gap + (pause if pause_at is not None and t < pause_at <= t + gap else 0.0)
        stamps.append(t)
    return {"t0": t0, "t1": stamps[-1], "stamps": stamps}


def test_the_longest_gap_just_after_an_instant_less_the_requests_median_gap():
    d = streamed_request(0.0, 0.010, 100, pause_at=0.2505, pause=0.013)
    assert abs(gap_excess_ms(d, 0.2505) - 13.0) < 1e-6
    assert abs(gap_excess_ms(d, 0.2005) - 13.0) < 1e-6  # the worker pauses 50 ms after the update: caught
    assert abs(gap_excess_ms(d, 0.7005)) < 1e-6
    assert abs(gap_excess_ms(d, 0.2005, window=0.02)) < 1e-6
    assert gap_excess_ms(d, -1.0) is None and gap_excess_ms(d, 9.0) is None


def test_gap_stall_nets_the_pause_against_the_half_way_control():
    times = [1.0, 2.0, 3.0, 4.0]
    done = [streamed_request(t - 0.3, 0.010, 100, pause_at=t + 0.05, pause=0.020) for t in times]
    row = gap_stall({"done": done, "times": times})
    assert row["gap_pairs"] == 4 and row["gap_control_pairs"] == 3
    assert abs(row["gap_net_p50_ms"] - 20.0) < 1e-6
    calm = gap_stall({"done": [streamed_request(t - 0.3, 0.010, 100) for t in times], "times": times})
    assert abs(calm["gap_net_p50_ms"]) < 1e-6
