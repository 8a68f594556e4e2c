"""bench/load.py's pure parts: error kinds, report buckets and CPU arithmetic (the bench itself is not
in the test suite: it runs minutes)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.load import Tally, classify, cpu_table, group  # noqa: E402


def test_errors_are_classified_by_status_and_openai_code_or_by_client_exception():
    body = b'{"error": {"message": "Redis is unreachable", "type": "server_error", "code": "redis_unavailable"}}'
    assert classify(503, body) == "http-503:redis_unavailable"
    assert classify(502, b"<html>bad gateway</html>") == "http-502:unparsed"
    assert classify(500, b"{}") == "http-500"
    assert classify(0, exc=asyncio.TimeoutError()) == "client:TimeoutError"


def test_workers_and_generators_are_summed_and_replicas_kept_apart():
    assert [group(n) for n in ("rollout-0", "rollout-1", "gen-3", "trajectory-1", "gateway", "nats")] == [
        "rollout", "rollout", "generator", "trajectory-1", "gateway", "nats"]


def test_cpu_per_turn_and_cores():
    table = cpu_table({"gateway": 2.0, "trajectory-0": 4.0, "gen-0": 0.5, "gen-1": 0.5}, turns=1000, seconds=10)
    assert table["gateway"] == {"ms_per_turn": 2.0, "cores": 0.2}
    assert table["trajectory-0"] == {"ms_per_turn": 4.0, "cores": 0.4}
    assert table["generator"] == {"ms_per_turn": 1.0, "cores": 0.1}
    assert cpu_table({"gateway": 1.0}, turns=0, seconds=1)["gateway"]["ms_per_turn"] == 1000.0  # no divide by 0


def test_tallies_of_the_generator_processes_add_up():
    total = Tally()
    total.add({"latencies": [0.1], "turns": 1, "turns_total": 2, "sessions_finished": 1, "errors": {"http-500": 1},
               "examples": {"http-500": "first"}})
    total.add({"latencies": [0.2, 0.3], "turns": 2, "turns_total": 3, "sessions_finished": 0,
               "errors": {"http-500": 2}, "examples": {"http-500": "second"}})
    assert (total.latencies, total.turns, total.turns_total, total.sessions_finished) == ([0.1, 0.2, 0.3], 3, 5, 1)
    assert total.errors == {"http-500": 3} and total.examples == {"http-500": "first"}



def _spin(seconds: float, out) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    out.put(time.process_time())


def test_a_capped_process_gets_its_quota_and_no_more():
    # --replica-cpu: a process in a CpuCap of 0.2 core, spinning for 1.5 s of wall time, gets ~0.3 s of CPU
    from bench.cpu_cap import CpuCap, CpuCapUnavailable

    try:
        cap = CpuCap(f"sf-test-{os.getpid()}", 0.2).__enter__()
    except (CpuCapUnavailable, OSError) as e:
        pytest.skip(f"no CPU cap here (it needs root and a cgroup cpu controller): {e}")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    try:
        proc = ctx.Process(target=_spin, args=(1.5, out))
        proc.start()
        cap.add(proc.pid)
        used = out.get(timeout=10)
        proc.join(10)
        throttled = cap.throttled()
    finally:
        cap.__exit__(None, None, None)
    assert used < 0.6 and throttled["throttled"] > 0
