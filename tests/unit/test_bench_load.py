"""bench/load.py's pure parts: error kinds, report buckets and CPU arithmetic, and its requests' answer
to a 429 against a stand-in server (the bench itself is not in the test suite: it runs minutes)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.load import RETRY_AFTER_MAX, Tally, _post, classify, cpu_table, group, retry_after  # noqa: E402


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


    total.add({"latencies": [], "turns": 0, "turns_total": 0, "sessions_finished": 0, "errors": {},
               "limited": {"http-429:rate_limit_exceeded": 2}, "examples": {}})
    assert total.limited == {"http-429:rate_limit_exceeded": 2} and total.errors == {"http-500": 3}


def test_retry_after_is_read_as_seconds_and_bounded():
    assert retry_after("2") == 2.0 and retry_after("0") == 0.0 and retry_after("0.25") == 0.25
    assert retry_after("3600") == RETRY_AFTER_MAX and retry_after("-5") == 0.0
    for unreadable in (None, "", "Wed, 21 Oct 2026 07:28:00 GMT", "nan", "inf"):
        assert retry_after(unreadable) == 1.0, unreadable


def _error(status: int) -> dict:
    code = "rate_limit_exceeded" if status == 429 else "overloaded"
    return {"error": {"message": "not now", "type": "rate_limit_error", "param": None, "code": code}}


async def _stand_in(answers: list[tuple[int, dict[str, str]]]):
    """A server on a free port that answers each POST with the next (status, headers), the last one
    for ever after; it records when each request came and its body."""
    from aiohttp import web

    seen: list[tuple[float, bytes]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((time.monotonic(), await request.read()))
        status, headers = answers[min(len(seen), len(answers)) - 1]
        return web.json_response({"ok": True} if status == 200 else _error(status), status=status, headers=headers)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1/chat/completions", seen


async def test_a_429_is_waited_out_then_the_same_request_sent_again_and_counted_apart():
    import aiohttp

    runner, url, seen = await _stand_in([(429, {"Retry-After": "0.3"}), (200, {})])
    tally = Tally()
    try:
        async with aiohttp.ClientSession() as http:
            assert await _post(http, url, "k", {"messages": ["one"]}, tally) == {"ok": True}
    finally:
        await runner.cleanup()
    assert len(seen) == 2 and seen[0][1] == seen[1][1]  # the same turn, again
    assert seen[1][0] - seen[0][0] >= 0.3  # after Retry-After
    assert tally.limited == {"http-429:rate_limit_exceeded": 1} and not tally.errors


async def test_a_request_still_refused_after_its_last_try_is_an_error_and_other_statuses_are_not_retried():
    import aiohttp

    runner, url, seen = await _stand_in([(429, {"Retry-After": "0"})])
    tally = Tally()
    try:
        async with aiohttp.ClientSession() as http:
            assert await _post(http, url, "k", {}, tally, retries=3) is None
            assert len(seen) == 4
            assert tally.limited == {"http-429:rate_limit_exceeded": 4}
            assert tally.errors == {"http-429:rate_limit_exceeded:after-3-retries": 1}
    finally:
        await runner.cleanup()
    runner, url, seen = await _stand_in([(503, {"Retry-After": "0"})])
    tally = Tally()
    try:
        async with aiohttp.ClientSession() as http:
            assert await _post(http, url, "k", {}, tally) is None
    finally:
        await runner.cleanup()
    assert len(seen) == 1 and tally.errors == {"http-503:overloaded": 1} and not tally.limited


def _spin(seconds: float, out) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    out.put(time.process_time())


def test_a_capped_process_gets_its_quota_and_no_more():
    # --replica-cpu: a process in a CpuCap of 0.2 core, spinning for 1.0 s of wall time, gets ~0.2 s of CPU
    from bench.cpu_cap import CpuCap, CpuCapUnavailable

    try:
        cap = CpuCap(f"sf-test-{os.getpid()}", 0.2).__enter__()
    except (CpuCapUnavailable, OSError) as e:
        pytest.skip(f"no CPU cap here (it needs root and a cgroup cpu controller): {e}")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    try:
        proc = ctx.Process(target=_spin, args=(1.0, out))
        proc.start()
        cap.add(proc.pid)
        used = out.get(timeout=10)
        proc.join(10)
        throttled = cap.throttled()
    finally:
        cap.__exit__(None, None, None)
    assert used < 0.4 and throttled["throttled"] > 0
