"""supervisor.py: back-off, crash-loop accounting, shutdown order and scale planning (time passed in)."""

from __future__ import annotations

import pytest

from seamlessflow.stack.supervisor import (
    GiveUp,
    Restart,
    RestartPolicy,
    ScaleError,
    Service,
    kind_of,
    next_name,
    parse_scale,
    shutdown_tiers,
    victims,
)

POLICY = RestartPolicy()  # 0.5 s doubling to 30 s; 5 restarts in 60 s


def crash(s: Service, at: float, policy: RestartPolicy = POLICY) -> Restart | GiveUp:
    """The process dies at `at`; a due restart is spawned at once."""
    d = s.exited(at, 1, policy)
    if isinstance(d, Restart):
        s.spawned(d.at, pid=100)
    return d


def test_back_off_doubles_from_half_a_second_to_thirty():
    s = Service("trajectory-0")
    s.spawned(0.0, 1)
    policy = RestartPolicy(loop_restarts=100)
    delays, t = [], 0.0
    for _ in range(9):
        t += 1.0
        d = crash(s, t, policy)
        delays.append(d.delay)
        t = d.at
    assert delays == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert s.restarts == 9 and s.state == "starting"


def test_a_restart_waits_for_its_back_off():
    s = Service("rollout-1")
    s.spawned(0.0, 1)
    d = s.exited(10.0, -9, POLICY)
    assert d == Restart(at=10.5, delay=0.5)
    assert s.state == "restarting" and s.last_exit == -9 and s.restarts == 1
    assert not s.due(10.4) and s.due(10.5)
    assert s.row(10.2)["pid"] == 0 and s.row(10.2)["uptime"] == 0.0


def test_a_long_healthy_run_resets_the_back_off():
    s = Service("gateway")
    s.spawned(0.0, 1)
    assert crash(s, 1.0).delay == 0.5
    assert crash(s, 2.0).delay == 1.0
    assert crash(s, 3.5).delay == 2.0
    # ran 60 s since its last start: the next crash is a fresh one
    assert crash(s, 5.5 + 60).delay == 0.5


def test_five_restarts_within_sixty_seconds_give_up():
    s = Service("trajectory-0")
    s.spawned(0.0, 1)
    for t in (1, 3, 6, 11, 20):
        assert isinstance(crash(s, t), Restart)
    d = crash(s, 40)
    assert isinstance(d, GiveUp)
    assert "exited with code 1 after 5 restarts within 60s (crash loop)" in d.reason
    assert s.state == "given up" and s.restarts == 5 and not s.due(1e9)


def test_restarts_older_than_the_window_do_not_count():
    s = Service("trajectory-0")
    s.spawned(0.0, 1)
    policy = RestartPolicy(loop_restarts=2, loop_window=10.0, healthy_after=1e9)
    assert isinstance(crash(s, 1.0, policy), Restart)
    assert isinstance(crash(s, 2.0, policy), Restart)
    assert isinstance(crash(s, 12.5, policy), Restart)  # the restart at 1.0 left the window
    assert isinstance(crash(s, 13.0, policy), Restart)  # and the one at 2.0
    assert isinstance(crash(s, 14.0, policy), GiveUp)  # 12.5 and 13.0: two within 10 s


def test_policy_is_checked():
    with pytest.raises(ValueError):
        RestartPolicy(loop_restarts=0)
    with pytest.raises(ValueError):
        RestartPolicy(loop_window=0)


def test_essential_services_are_nats_and_redis():
    assert Service("nats").essential and Service("redis").essential
    assert not any(Service(n).essential for n in ("gateway", "trajectory-0", "rollout-3", "host-0", "scheduler"))
    assert [kind_of(n) for n in ("rollout-12", "trajectory-0", "gateway", "host-1", "trainer")] == \
        ["rollout", "trajectory", "gateway", "host", "trainer"]


def test_shutdown_order_gateway_then_replicas_then_workers_then_infra():
    names = ["nats", "redis", "trajectory-0", "trajectory-1", "scheduler", "host-0", "host-1", "trainer",
             "rollout-0", "gateway"]
    assert shutdown_tiers(names) == [
        ["gateway"], ["trajectory-0", "trajectory-1"], ["scheduler", "host-0", "host-1", "trainer", "rollout-0"],
        ["nats", "redis"],
    ]
    assert shutdown_tiers(["nats", "bench-thing"]) == [["bench-thing"], ["nats"]]  # unknown: with the workers


def test_parse_scale():
    assert parse_scale(["rollout=3", "trajectory=2"]) == {"rollout": 3, "trajectory": 2}
    assert parse_scale(["rollout=0"]) == {"rollout": 0}
    for bad, why in ((["rollout"], "KIND=N"), (["gateway=2"], "cannot be scaled"), (["rollout=-1"], "KIND=N"),
                     ([], "nothing to scale"), (["trajectory=0"], "keep at least 1")):
        with pytest.raises(ScaleError, match=why):
            parse_scale(bad)


def test_new_names_fill_the_lowest_free_index():
    assert next_name("rollout", ["rollout-0", "rollout-2", "gateway"]) == "rollout-1"
    assert next_name("trajectory", []) == "trajectory-0"


def test_scale_down_removes_given_up_ones_first_then_the_newest():
    a, b, c = Service("rollout-0"), Service("rollout-1"), Service("rollout-2")
    assert victims([a, b, c], 1) == ["rollout-2", "rollout-1"]
    a.state = "given up"
    assert victims([a, b, c], 2) == ["rollout-0"]
    assert victims([a, b, c], 3) == [] and victims([a, b, c], 5) == []
