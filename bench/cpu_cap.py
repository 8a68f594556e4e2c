"""Cap one process's CPU with a cgroup quota: a host of its own, emulated on a shared box.

    with CpuCap("sf-load-trajectory-0", cores=0.3) as cap:   # needs root and a cgroup cpu controller
        cap.add(pid)                                         # every thread, and those it starts later
        ...                                                  # cap.usage_s(): CPU seconds used in it

bench/load.py `--replica-cpu` puts each trajectory replica in one of these, so that a replica, not the
machine, is the bottleneck (as when each replica has a host of its own). cgroup v1 (`cpu` hierarchy:
cpu.cfs_quota_us / cpu.cfs_period_us) or v2 (`cpu.max`, the cpu controller enabled in the root's
subtree_control). It knows nothing of the stack: a name, a quota, pids.
"""

from __future__ import annotations

import os
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CpuCapUnavailable(RuntimeError):
    pass


class CpuCap:
    def __init__(self, name: str, cores: float) -> None:
        if cores <= 0:
            raise ValueError("cores must be > 0")
        self.name, self.cores = name, cores
        self.quota_us = max(1000, round(cores * PERIOD_US))
        self.dir: Path | None = None
        self.v2 = False

    def __enter__(self) -> "CpuCap":
        if (V1 / "cpu.cfs_quota_us").exists():
            self.dir = V1 / self.name
            self._mkdir()
            (self.dir / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.dir / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        elif "cpu" in _read(V2 / "cgroup.controllers").split():
            if "cpu" not in _read(V2 / "cgroup.subtree_control").split():
                _write(V2 / "cgroup.subtree_control", "+cpu")
            self.dir, self.v2 = V2 / self.name, True
            self._mkdir()
            (self.dir / "cpu.max").write_text(f"{self.quota_us} {PERIOD_US}")
        else:
            raise CpuCapUnavailable("no cgroup cpu controller here (neither /sys/fs/cgroup/cpu/cpu.cfs_quota_us "
                                    "nor cpu in /sys/fs/cgroup/cgroup.controllers)")
        return self

    def _mkdir(self) -> None:
        assert self.dir is not None
        try:
            self.dir.mkdir(exist_ok=True)
        except PermissionError:
            raise CpuCapUnavailable(f"cannot create {self.dir}: a CPU cap needs root (uid {os.getuid()})") from None

    def add(self, pid: int) -> None:
        """Move `pid` (all its threads: cgroup.procs takes a process) into the capped group."""
        assert self.dir is not None
        (self.dir / "cgroup.procs").write_text(str(pid))

    def throttled(self) -> dict[str, int]:
        """The kernel's own account of the cap: periods, periods throttled, time throttled (µs)."""
        assert self.dir is not None
        stat = dict(line.split() for line in _read(self.dir / "cpu.stat").splitlines() if line.strip())
        if self.v2:
            return {"periods": int(stat.get("nr_periods", 0)), "throttled": int(stat.get("nr_throttled", 0)),
                    "throttled_us": int(stat.get("throttled_usec", 0))}
        return {"periods": int(stat.get("nr_periods", 0)), "throttled": int(stat.get("nr_throttled", 0)),
                "throttled_us": int(stat.get("throttled_time", 0)) // 1000}

    def __exit__(self, *exc) -> None:
        if self.dir is None:
            return
        parent = self.dir.parent
        for pid in _read(self.dir / "cgroup.procs").split():  # still running: back to the root group
            try:
                (parent / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # it exited meanwhile
        try:
            self.dir.rmdir()
        except OSError:
            pass


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _write(p: Path, text: str) -> None:
    try:
        p.write_text(text)
    except OSError as e:
        raise CpuCapUnavailable(f"cannot write {p}: {e}") from None
