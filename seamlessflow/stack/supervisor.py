"""Supervision rules for the processes `seamlessflow up` runs (pure: time is passed in).

- `RestartPolicy`: back-off 0.5 s doubling to 30 s; a service that needed `loop_restarts`
  restarts within `loop_window` seconds is crash-looping and is given up.
- `Service`: one service's record (state, pid, uptime, restarts) and the decision taken when
  its process exits: `Restart(at)` or `GiveUp(reason)`.
- `shutdown_tiers`: the order a stack stops in (gateway, trajectory, workers, infra).
- `parse_scale` / `next_name` / `victims`: what `seamlessflow scale` asks for and which
  process it adds or removes.

This module knows nothing about processes, signals or sockets: `keeper.py` applies these
decisions to the processes `stack.py` starts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

State = Literal["starting", "running", "restarting", "given up", "stopping", "stopped"]
ESSENTIAL = ("nats", "redis")  # without these nothing works: giving one up stops the stack
SCALABLE = ("rollout", "trajectory")


@dataclass(frozen=True)
class RestartPolicy:
    backoff: float = 0.5  # seconds before the first restart
    backoff_max: float = 30.0
    loop_restarts: int = 5  # this many restarts ...
    loop_window: float = 60.0  # ... within this many seconds: a crash loop, give up
    healthy_after: float = 60.0  # a process that ran this long starts the back-off afresh

    def __post_init__(self) -> None:
        if self.loop_restarts < 1 or self.loop_window <= 0 or self.backoff <= 0:
            raise ValueError("restart policy: loop_restarts >= 1, loop_window > 0 and backoff > 0")


@dataclass(frozen=True)
class Restart:
    at: float  # when to start it again
    delay: float


@dataclass(frozen=True)
class GiveUp:
    reason: str


def kind_of(name: str) -> str:
    """`rollout-1` -> `rollout`, `trajectory-0` -> `trajectory`, `gateway` -> `gateway`."""
    head, _, tail = name.rpartition("-")
    return head if head and tail.isdigit() else name


@dataclass
class Service:
    name: str
    log: str = ""
    state: State = "starting"
    pid: int = 0
    started: float = 0.0  # when its current process started
    restarts: int = 0
    last_exit: int | None = None
    reason: str = ""  # why it was given up
    next_start: float = 0.0
    backoff: float = 0.0
    recent: deque[float] = field(default_factory=deque)  # times of restarts within the window

    @property
    def kind(self) -> str:
        return kind_of(self.name)

    @property
    def essential(self) -> bool:
        return self.kind in ESSENTIAL

    def spawned(self, now: float, pid: int) -> None:
        self.state, self.pid, self.started = "starting", pid, now

    def ready(self) -> None:
        if self.state == "starting":
            self.state = "running"

    def exited(self, now: float, code: int | None, policy: RestartPolicy) -> Restart | GiveUp:
        """Its process ended without being asked to: restart it later, or give it up."""
        self.last_exit = code
        while self.recent and self.recent[0] < now - policy.loop_window:
            self.recent.popleft()
        if len(self.recent) >= policy.loop_restarts:
            self.state = "given up"
            self.reason = (f"exited with code {code} after {len(self.recent)} restarts within "
                           f"{policy.loop_window:g}s (crash loop)")
            return GiveUp(self.reason)
        if self.backoff == 0.0 or now - self.started >= policy.healthy_after:
            self.backoff = policy.backoff
        else:
            self.backoff = min(self.backoff * 2, policy.backoff_max)
        self.recent.append(now)
        self.restarts += 1
        self.state, self.next_start = "restarting", now + self.backoff
        return Restart(self.next_start, self.backoff)

    def due(self, now: float) -> bool:
        return self.state == "restarting" and now >= self.next_start

    def uptime(self, now: float) -> float:
        return now - self.started if self.state in ("starting", "running", "stopping") else 0.0

    def row(self, now: float) -> dict:
        return {"name": self.name, "kind": self.kind, "pid": self.pid if self.uptime(now) else 0,
                "state": self.state, "uptime": round(self.uptime(now), 1), "restarts": self.restarts,
                "last_exit": self.last_exit, "reason": self.reason, "log": self.log}


# -- shutdown order ---------------------------------------------------------------------------

TIERS = (
    ("gateway",),  # 1. no new turns arrive
    ("trajectory",),  # 2. replicas finish their turns while the workers still serve
    ("rollout", "host", "trainer", "scheduler"),  # 3. workers (host agents hold theirs), the trainer
    ("redis", "nats"),  # 4. infrastructure last
)


def shutdown_tiers(names: list[str]) -> list[list[str]]:
    """The stack's services in the order they stop; each inner list stops together. A name of
    no known kind stops with the workers."""
    tiers: list[list[str]] = [[] for _ in TIERS]
    for n in names:
        k = kind_of(n)
        k = "host" if k.startswith("host") else k
        i = next((i for i, kinds in enumerate(TIERS) if k in kinds), 2)
        tiers[i].append(n)
    return [t for t in tiers if t]


# -- scale ------------------------------------------------------------------------------------


class ScaleError(ValueError):
    pass


def parse_scale(items: list[str]) -> dict[str, int]:
    """`["rollout=3", "trajectory=2"]` -> {"rollout": 3, "trajectory": 2}."""
    out: dict[str, int] = {}
    for item in items:
        kind, sep, n = item.partition("=")
        if not sep or not n.strip().isdigit():
            raise ScaleError(f"{item!r}: write KIND=N, e.g. rollout=3")
        kind = kind.strip()
        if kind not in SCALABLE:
            raise ScaleError(f"{kind!r} cannot be scaled; scalable: {', '.join(SCALABLE)}")
        out[kind] = int(n)
    if not out:
        raise ScaleError("nothing to scale: give KIND=N, e.g. rollout=3 trajectory=2")
    if out.get("trajectory", 1) < 1:
        raise ScaleError("trajectory=0 would leave the gateway with nobody to serve turns; keep at least 1")
    return out


def next_name(kind: str, taken: list[str]) -> str:
    """The lowest free `<kind>-<i>`."""
    i = 0
    while f"{kind}-{i}" in taken:
        i += 1
    return f"{kind}-{i}"


def victims(services: list[Service], n: int) -> list[str]:
    """Which of one kind's services go when it scales down to `n`: given-up ones first, then
    the highest index (the ones most recently added)."""
    order = sorted(services, key=lambda s: (s.state != "given up", -int(s.name.rpartition("-")[2] or 0)))
    return [s.name for s in order[:max(0, len(services) - n)]]
