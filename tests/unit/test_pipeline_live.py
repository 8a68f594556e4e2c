"""bench/pipeline_live.py's exact idle arithmetic and the simulated engine's timing log it reads
(the bench itself is not in the test suite: it runs minutes)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.pipeline_live import (engine_slowdown, exact_idle, merged, split_latency, trainer_overhead,  # noqa: E402
                                 trainer_waits)
from services.trainer.metrics import format_line  # noqa: E402
from services.rollout.simulated import SimulatedEngine  # noqa: E402
from shared.messages.rollout import Sampling  # noqa: E402


def test_overlapping_and_touching_intervals_merge_in_order():
    assert merged([(5, 7), (1, 3), (2, 4), (4, 4.5), (6, 6.5)], 0, 10) == [(1, 4.5), (5, 7)]


def test_intervals_are_clipped_to_the_window_and_those_outside_dropped():
    assert merged([(-5, 1), (2, 3), (9, 15), (-3, -1), (11, 12), (4, 4)], 0, 10) == [(0, 1), (2, 3), (9, 10)]


def test_idle_is_the_window_less_train_switch_and_engine_requests():
    busy = [(0, 2), (2, 3)]  # train, then switch
    requests = [(4, 6), (5, 7), (9, 12)]  # two overlapping, one running past the window
    assert exact_idle(busy, requests, 0, 10) == pytest.approx(0.3)  # idle: 3-4, 7-9


def test_a_request_during_training_is_not_counted_twice():
    assert exact_idle([(0, 5)], [(3, 6)], 0, 10) == pytest.approx(0.4)


def test_time_before_the_window_is_left_out():
    assert exact_idle([(-10, 2)], [(-4, -1), (8, 20)], 0, 10) == pytest.approx(0.6)


def test_a_host_with_nothing_running_is_idle_and_an_empty_window_is_zero():
    assert exact_idle([], [], 0, 10) == 1.0
    assert exact_idle([(0, 1)], [], 5, 5) == 0.0


def test_the_engine_logs_every_request_with_its_host_and_one_cut_off_with_a_null_finish(tmp_path):
    log = tmp_path / "host-1-rollout.jsonl"

    async def run():
        engine = SimulatedEngine(4, step_ms=1.0, per_seq_ms=0.0, timing_log=log,
                                 names={"worker": "host-1-rollout", "host": "host-1"})
        await engine.start()
        deltas = [d async for d in engine.generate("a", [1, 2], Sampling(max_tokens=3))]
        cut = engine.generate("b", [1, 2], Sampling(max_tokens=100))
        await anext(cut)
        await cut.aclose()
        engine.shutdown()
        return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].finish == "length"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["finish"], x["request"], x["worker"], x["host"]) for x in lines] == [
        ("length", "a", "host-1-rollout", "host-1"), (None, "b", "host-1-rollout", "host-1")]
    assert all(x["t1"] >= x["t0"] for x in lines)


def test_the_latency_splits_turn_by_turn_around_the_engine_by_request_id():
    """Turn a: sent 0, in the engine 1-3, finished 3.5 (before 1, after 0.5). Turn b: sent 10,
    dispatched at 10.2, re-dispatched at 11 (a reclaim), done 12, finished 13 (before 0.2,
    after 1). Turn c never reached an engine that finished it; d's line belongs to no turn.
    before + engine + after = the agents' time per turn, over the paired turns."""
    turns = [(0.0, 0.1, 3.2, 3.5, "a"), (10.0, 10.1, 12.5, 13.0, "b"), (20.0, 20.1, 21.0, 21.5, "c")]
    engine = [{"request": "b.tb.0", "t0": 10.2, "t1": 10.8, "finish": None},
              {"request": "a.ta.0", "t0": 1.0, "t1": 3.0, "finish": "length"},
              {"request": "b.tb.1", "t0": 11.0, "t1": 12.0, "finish": "length"},
              {"request": "c.tc.0", "t0": 20.5, "t1": 20.9, "finish": None},
              {"request": "d.td.0", "t0": 0.0, "t1": 99.0, "finish": "length"}]
    sp = split_latency(turns, engine)
    assert sp["turns"] == 2
    assert sp["before_s"] == pytest.approx((1.0 + 0.2) / 2)
    assert sp["after_s"] == pytest.approx((0.5 + 1.0) / 2)
    assert sp["engine_s"] == pytest.approx((2.0 + 1.8) / 2)
    assert sp["before_s"] + sp["engine_s"] + sp["after_s"] == pytest.approx((3.5 + 3.0) / 2)
    assert split_latency(turns, [])["turns"] == 0


# -- the simulator side: a short run ends, and inputs it cannot run on are refused -----------------

MEASURED = {"lend_s": 0.024, "reclaim_s": 0.032, "publish_s": 0.006, "train_s_per_token": 1 / 16_671,
            "prompt_tokens": 14.9, "gen_tokens": 96.0, "wall_s": 10.7,  # a --steps 2 live run's figures
            "trainer_overhead": {"bookkeeping_s": 0.045, "gate_s": 0.003, "start_s": 0.024}}


def test_warmup_must_leave_a_step_to_compare():
    from bench.pipeline_live import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--steps", "2"])  # the default --warmup 4: no step compared, found after the live run
    assert parse_args(["--steps", "2", "--warmup", "1"]).warmup == 1


def test_the_simulator_side_of_a_two_step_run_ends():
    from bench.pipeline_live import parse_args, simulated

    a = parse_args(["--hosts", "2", "--steps", "2", "--warmup", "1"])
    for kw in ({}, {"latency": 1.98}, {"latency": 1.58, "after": 0.49}, {"control": (0.0219, 0.28)}):
        r = simulated(a, MEASURED, **kw)
        assert r["trained_tokens_per_s"] > 0 and r["window_s"] > 0


def test_the_trainers_overhead_is_fed_in_or_left_out_on_purpose_never_lost():
    """The simulator's trainer takes the live trainer's measured overhead (a slower step: fewer tok/s); a
    saved run without one is refused unless --trainer-overhead none says to leave it out."""
    from bench.pipeline_live import parse_args, simulated

    args = ["--hosts", "2", "--steps", "4", "--warmup", "1"]
    fed = simulated(parse_args(args), MEASURED)
    assert fed["calibration"]["start_s"] == 0.024 and fed["calibration"]["bookkeeping_s"] == 0.045
    bare = simulated(parse_args([*args, "--trainer-overhead", "none"]), MEASURED)
    assert bare["calibration"]["start_s"] == 0.0
    assert fed["trained_tokens_per_s"] < bare["trained_tokens_per_s"]
    with pytest.raises(SystemExit, match="cannot run on"):
        simulated(parse_args(args), {k: v for k, v in MEASURED.items() if k != "trainer_overhead"})
    assert simulated(parse_args(args), MEASURED | {"trainer_overhead": {"bookkeeping_s": 0.01, "gate_s": -0.002,
                                                                          "start_s": 0.02}})["calibration"]["gate_s"] == 0


@pytest.mark.parametrize("bad", [{"publish_s": float("nan")}, {"control": (0.0219, 0.0)}, {"control": (0.0219, 1e-9)}])
def test_inputs_that_stop_the_simulator_are_refused_not_looped_on(bad):
    """A NaN publish or no cores for the control plane: the simulator never trains a step, and
    looped without end (its time limit was infinite)."""
    from bench.pipeline_live import parse_args, simulated

    a = parse_args(["--hosts", "2", "--steps", "2", "--warmup", "1"])
    control = bad.pop("control", (0.0, 1.0))
    with pytest.raises(SystemExit, match="cannot run on|trained 0 of"):
        simulated(a, MEASURED | bad, control)


def test_engine_slowdown_is_each_requests_time_over_its_nominal_steps():
    """pipeline_live.engine_slowdown: a request alone (batch 1) that took 1.2 x its 97 nominal steps of
    2 + 0.25 ms, and two side by side (batch 2) at 1.1 x theirs; moved requests, cut-off ones, those
    begun outside the window and those beside more than `capacity` others do not count."""
    alone = 97 * 0.00225 * 1.2
    pair = 97 * 0.0025 * 1.1
    logs = {"w0": [{"t0": 0.0, "t1": alone, "finish": "length", "request": "a.x.0"},
                   {"t0": 10.0, "t1": 10.0 + pair, "finish": "length", "request": "b.x.0"},
                   {"t0": 10.0, "t1": 10.0 + pair, "finish": "length", "request": "c.x.0"},
                   {"t0": 20.0, "t1": 21.0, "finish": "length", "request": "d.x.1"},  # moved: not its first dispatch
                   {"t0": 30.0, "t1": 30.5, "finish": None, "request": "e.x.0"}]}  # cut off
    assert engine_slowdown(logs, 0.0, 100.0, 2.0, 0.25, 96, 64) == pytest.approx((1.2 + 2 * 1.1) / 3)
    assert engine_slowdown(logs, 5.0, 100.0, 2.0, 0.25, 96, 64) == pytest.approx(1.1)
    assert engine_slowdown(logs, 5.0, 100.0, 2.0, 0.25, 96, 1) == 1.0  # two beside each other: none


def test_the_trainers_wait_and_gate_are_read_from_its_own_log_lines():
    """trainer_waits reads the lines the live trainer writes (services/trainer/metrics.py format_line,
    services/trainer/service.py's gate): a format change fails here, not silently in the bench."""
    m = {"wait_s": 0.123, "compute_s": 0.5, "publish_s": 0.01, "checkpoint_s": 0.0, "tokens": 10}
    log = "\n".join([
        "2026-12-07 05:51:23,456 services.trainer.service INFO step 5: gate granted after 0.15s",
        "2026-12-07 05:51:23,956 services.trainer.service INFO " + format_line(5, 5, m, {0: 3}),
        "2026-12-07 05:51:24,100 services.trainer.service WARNING step 6: gate not granted (timed out) after 0.31s; "
        "computing anyway",
        "2026-12-07 05:51:24,600 services.trainer.service INFO " + format_line(6, 6, m | {"wait_s": 0.0}, {}),
        "2026-12-07 05:51:25,600 services.trainer.service INFO " + format_line(7, 7, m | {"wait_s": 1.5}, {}),
    ])
    assert trainer_waits(log) == {5: (0.12, 0.15), 6: (0.0, 0.31), 7: (1.5, 0.0)}


def test_the_trainers_overhead_is_the_gap_less_wait_and_reclaim_split_by_its_timeline():
    """trainer_overhead, computed by hand: step 4's version is out at 100.0, step 5 computes from 100.5.
    Of the 0.5 s gap, the trainer waited 0.2 s for data and 0.15 s at its gate, in which host-0 switched
    0.10 s (the simulator charges its reclaim_s, 0.08 s, for that). 0.22 s is missed. Host-0's timeline
    shows 0.04 s of it as train after the audit (bookkeeping) and 0.01 s before the compute (start);
    the gate's 0.17 s is the rest. Step 6 (disaggregated-like): a 0.03 s gate and no switch."""
    audit = {4: 100.0, 5: 101.0}
    start = {5: 100.5, 6: 101.3}
    waits = {5: (0.2, 0.15), 6: (0.2, 0.03)}
    train = [(99.0, 100.04), (100.49, 101.02), (101.28, 101.6)]
    switch = [(100.36, 100.46)]
    one = trainer_overhead(audit, start, waits, train, switch, 0.08, [5])
    assert (one["bookkeeping_s"], one["start_s"], one["gate_s"]) == pytest.approx((0.04, 0.01, 0.17))
    assert one["reclaim_s"] == pytest.approx(0.08) and one["gap_s"] == pytest.approx(0.5) and one["steps"] == 1
    both = trainer_overhead(audit, start, waits, train, switch, 0.08, [5, 6, 7])  # 7: no compute start logged
    assert both["steps"] == 2
    # step 6: gap 0.3, wait 0.2, no reclaim: 0.1 missed; 0.02 train after the audit, 0.02 before the compute
    assert (both["bookkeeping_s"], both["start_s"], both["gate_s"]) == pytest.approx(
        ((0.04 + 0.02) / 2, (0.01 + 0.02) / 2, (0.17 + 0.06) / 2))
    assert math.isnan(trainer_overhead(audit, start, waits, train, switch, 0.08, [4])["start_s"])
