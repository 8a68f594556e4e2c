"""The scheduler's edges that need no server: what it reads of a finished trajectory, its gauges,
and the `hosts` command's control message (services/scheduler/service.py, metrics.py,
seamlessflow/ops/hosts.py)."""

from __future__ import annotations

import argparse
import asyncio
import time

from prometheus_client import CollectorRegistry

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import Finished, SchedulerService
from shared.config import Connections
from shared.codec import decode, encode
from shared.messages.scheduler import SchedulerReply
from shared.messages.trajectory import Sample, TrajectoryCompleted


def test_the_scheduler_reads_a_finished_trajectorys_group_and_skips_its_samples():
    traj = TrajectoryCompleted("s1", "g7", 1.0, [Sample([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2], [-1, 4, 4])],
                               {"k": "v"}, finished_at=5.0, policy_version=4)
    assert decode(encode(traj), Finished).group_id == "g7"


def test_the_gauges_show_rates_counts_and_each_hosts_activity():
    r = CollectorRegistry()
    m = SchedulerMetrics(r)
    m.update({"groups_per_s": 0.5, "predicted_wait_s": float("inf")}, {"lends": 3}, {"host-0": "rollout"})
    assert r.get_sample_value("sf_scheduler_rate", {"what": "groups_per_s"}) == 0.5
    assert r.get_sample_value("sf_scheduler_rate", {"what": "predicted_wait_s"}) == -1.0
    assert r.get_sample_value("sf_scheduler_switches", {"what": "lends"}) == 3
    assert r.get_sample_value("sf_scheduler_host_activity", {"host": "host-0", "activity": "rollout"}) == 1.0
    m.update({}, {}, {"host-0": "idle"})
    assert r.get_sample_value("sf_scheduler_host_activity", {"host": "host-0", "activity": "rollout"}) == 0.0


def test_hosts_list_sends_no_host(monkeypatch, capsys):
    """`hosts list` has no argument: the control message gets "" (a None failed the scheduler's decode)."""
    from seamlessflow import cli
    from seamlessflow.ops import hosts

    sent = {}

    async def ask(conn, op, host="", policy="", timeout=10.0):
        sent.update(op=op, host=host, policy=policy)
        return SchedulerReply(True, "seamless", rates={"groups_per_s": 0.25})

    monkeypatch.setattr(hosts, "ask", ask)
    monkeypatch.setattr(cli, "_connections", lambda a: None)
    cli.cmd_hosts(argparse.Namespace(action="list", arg=None))
    assert sent == {"op": "status", "host": "", "policy": ""}
    assert "groups_per_s 0.25" in capsys.readouterr().out


async def test_an_event_that_calls_for_a_decision_cuts_the_wait_for_the_tick():
    svc = SchedulerService(SchedulerConfig(tick=5.0), Connections())
    quit = asyncio.Event()
    t0 = time.monotonic()
    asyncio.get_running_loop().call_later(0.05, svc.wake.set)
    await svc._sleep(quit, 5.0)
    assert time.monotonic() - t0 < 1.0 and not svc.wake.is_set()  # woken, and ready for the next event
    t0 = time.monotonic()
    await svc._sleep(quit, 0.2)  # nothing calls: the tick
    assert 0.15 < time.monotonic() - t0 < 1.0
