"""shared/lifecycle.py: a service runs until SIGTERM sets its quit event, and returns its exit code."""

from __future__ import annotations

import asyncio
import os
import signal

from shared.lifecycle import run_until_signalled


def test_sigterm_sets_quit_and_the_service_returns_its_exit_code():
    async def serve(quit):
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the loop: the test process keeps running
        await quit.wait()
        return 3

    assert run_until_signalled(serve) == 3


async def test_settled_freezes_the_heap_once_the_service_is_ready():
    import gc

    from shared.lifecycle import GEN0_THRESHOLD, settled

    async def serve(ready):
        assert gc.get_freeze_count() == 0
        ready.set()
        await asyncio.sleep(0.01)  # the watcher runs
        return gc.get_freeze_count()

    gc.unfreeze()
    threshold = gc.get_threshold()
    try:
        assert await settled(serve) > 0
        assert gc.get_threshold()[0] == GEN0_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
