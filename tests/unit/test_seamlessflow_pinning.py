"""CPU sets for `up --pin` (seamlessflow/stack/pinning.py) and their reading by the host agent."""

from __future__ import annotations

import pytest

from seamlessflow.stack.pinning import cpu_list, pin_plan
from services.scheduler.config import load_host, parse_cpu_list
from shared.config import ConfigError


def test_enough_cores_each_host_its_own_set_and_the_control_plane_the_rest():
    p = pin_plan(list(range(16)), 2)
    assert p.hosts == ((0, 1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12, 13)) and p.control == (14, 15)
    assert not p.shared
    p = pin_plan([0, 1, 2], 2)
    assert p.hosts == ((0,), (1,)) and p.control == (2,)
    p = pin_plan([3, 5, 7, 9], 3)  # the cores this process may use, not 0..n-1
    assert p.hosts == ((3,), (5,), (7,)) and p.control == (9,)


def test_fewer_cores_than_hosts_plus_one_one_core_per_host_and_the_control_plane_shares():
    p = pin_plan([0, 1], 2)  # this box
    assert p.hosts == ((0,), (1,)) and p.control == (0, 1) and p.shared
    p = pin_plan([0, 1], 3)  # hosts share round robin
    assert p.hosts == ((0,), (1,), (0,)) and p.control == (0, 1)
    p = pin_plan([4], 1)
    assert p.hosts == ((4,),) and p.control == (4,)


def test_every_host_gets_a_core_and_dedicated_sets_never_overlap():
    for cores in range(1, 20):
        for hosts in range(1, 8):
            p = pin_plan(list(range(cores)), hosts)
            assert len(p.hosts) == hosts and all(p.hosts) and p.control
            if not p.shared:
                used = [c for s in p.hosts for c in s] + list(p.control)
                assert sorted(used) == list(range(cores))  # a partition: disjoint, nothing left over
    with pytest.raises(ValueError):
        pin_plan([], 2)


def test_cpu_lists_are_written_and_read_as_linux_does():
    assert cpu_list((0, 1, 2, 3, 6)) == "0-3,6" and cpu_list(()) == "" and cpu_list([5]) == "5"
    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6} and parse_cpu_list("") == set()
    for s in ("", "0", "0-1", "2,4-5,9"):
        assert cpu_list(sorted(parse_cpu_list(s))) == s
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")


def test_a_host_agents_cpus_are_checked(monkeypatch):
    monkeypatch.setenv("SF_HOST_CPUS", "0-1")
    assert load_host(id="h0", tags="rollout").cpus == "0-1"
    monkeypatch.setenv("SF_HOST_CPUS", "one")
    with pytest.raises(ConfigError, match="SF_HOST_CPUS"):
        load_host(id="h0", tags="rollout")
