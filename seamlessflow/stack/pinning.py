"""CPU sets for `seamlessflow up --pin`: each host a set of cores of its own, the control plane the rest (pure).

    plan = pin_plan(sorted(os.sched_getaffinity(0)), hosts=2)
    plan.hosts[0]   # host-0's cores: its agent, its rollout worker and its trainer rank run there
    plan.control    # NATS, Redis, the gateway, the trajectory manager(s) and the scheduler

Pinned, a host is a real resource on one machine: a lent host adds cores that would
otherwise idle, as a lent GPU does on a cluster, and a live A/B of the policies compares
the policies, not how the OS scheduler shares cores among every process.

The split, with C cores and H hosts:
- C >= H + 1: each host gets (C - 1) // H cores, consecutive, in host order; the control
  plane gets the rest (at least one core, more when H does not divide C - 1).
- C <= H (too few to give the control plane a core of its own): each host gets one core
  (host i the i-th core, round robin when C < H, so hosts then share), and the control
  plane runs on every core, beside the hosts. On a 2-core box with 2 hosts: host-0 {0},
  host-1 {1}, control plane {0, 1}. Its work (routing, bookkeeping, the bus) then takes
  time from the hosts, so a lent host's gain is smaller than on a cluster.

`cpu_list` writes a set as Linux writes it ("0-3,6"), for SF_HOST_CPUS (the host agent
reads it: services/scheduler/config.py). This module knows nothing about processes:
processes.py applies the plan.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PinPlan:
    hosts: tuple[tuple[int, ...], ...]  # per host, in host order
    control: tuple[int, ...]
    shared: bool  # the control plane shares the hosts' cores (fewer cores than hosts + 1)


def pin_plan(cpus: list[int], hosts: int) -> PinPlan:
    """The cores of each of `hosts` hosts and of the control plane, from the cores this process may use."""
    cpus = sorted(set(cpus))
    if not cpus:
        raise ValueError("no CPU to pin to")
    if hosts <= 0:
        return PinPlan((), tuple(cpus), False)
    if len(cpus) <= hosts:
        return PinPlan(tuple((cpus[i % len(cpus)],) for i in range(hosts)), tuple(cpus), True)
    per = (len(cpus) - 1) // hosts
    sets = tuple(tuple(cpus[i * per:(i + 1) * per]) for i in range(hosts))
    return PinPlan(sets, tuple(cpus[hosts * per:]), False)


def cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3,6"."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(c)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"

