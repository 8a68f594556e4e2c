"""shared/lifecycle.py: a service runs until SIGTERM sets its quit event, and returns its exit code."""

from __future__ import annotations

import os
import signal

from shared.lifecycle import run_until_signalled


def test_sigterm_sets_quit_and_the_service_returns_its_exit_code():
    async def serve(quit):
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the loop: the test process keeps running
        await quit.wait()
        return 3

    assert run_until_signalled(serve) == 3
