"""A DeepSpeed build lock left by a killed process is cleared at a test session's start (tests/conftest.py)
and at a stack's (seamlessflow/stack/processes.py)."""

from __future__ import annotations

import os

from seamlessflow.stack.processes import STALE_BUILD_LOCK_S, clear_stale_build_locks


def test_only_locks_older_than_any_real_build_are_removed(tmp_path):
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.write_text("")
    now = stale.stat().st_mtime + STALE_BUILD_LOCK_S + 1
    os.utime(fresh, (now - 5, now - 5))
    assert clear_stale_build_locks(tmp_path, now) == [stale]
    assert not stale.exists() and fresh.exists()
