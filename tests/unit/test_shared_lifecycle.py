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

    # tests/conftest.py froze what collection left alive; settle() freezes what is alive since. (Not
    # unfrozen first: settle's full collection would walk every import again, ~1 s here.)
    before = gc.get_freeze_count()

    async def serve(ready):
        assert gc.get_freeze_count() == before  # nothing frozen before the service is ready
        ready.set()
        await asyncio.sleep(0.01)  # the watcher runs
        return gc.get_freeze_count()

    threshold = gc.get_threshold()
    gc.set_threshold(700, *threshold[1:])  # Python's default (the conftest settled the session too)
    try:
        assert await settled(serve) > before
        assert gc.get_threshold()[0] == GEN0_THRESHOLD
    finally:
        gc.set_threshold(*threshold)
        if not before:  # run without the conftest's freeze: leave nothing frozen
            gc.unfreeze()
