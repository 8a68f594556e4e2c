"""How a service process lives: logging set up once, and a quit event that SIGINT/SIGTERM set.

    def main() -> None:
        setup_logging()
        cfg = load_config()
        sys.exit(run_until_signalled(lambda quit: MyService(cfg, connections()).run(quit)))

The service's `run(quit)` drains and returns when `quit` is set; what it returns (an exit
code, or None) is what `run_until_signalled` returns.

Every service runs on uvloop (libuv; `SF_EVENT_LOOP=asyncio` for the standard library's loop,
say to compare or to debug); BENCHMARKS.md has what it saves per turn in the gateway and the
trajectory manager.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from shared.config import ConfigError, log_level

T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
GEN0_THRESHOLD = 10_000  # allocations between young collections once a service has started (settle)


def setup_logging() -> None:
    """SF_LOG_LEVEL (default INFO) for the root logger, one line per record."""
    logging.basicConfig(level=log_level(), format=LOG_FORMAT)


def settle() -> None:
    """Call once a service has started: everything alive now (modules, the tokenizer, clients: ~400k
    objects in a trajectory manager) moves out of the garbage collector's sight (gc.freeze), so a full
    collection no longer walks it. Under load (bench/load.py) full collections of that heap took ~140 ms
    each, and collections ~11% of the trajectory manager's CPU (BENCHMARKS.md).
    Young collections run every GEN0_THRESHOLD allocations instead of 700: each walks the young objects
    still alive (hundreds of requests in flight hold thousands), so rarer ones walk them less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])


async def settled(serve: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """`serve(ready)`, and settle() once it sets `ready` (for an entry point, not for tests that run a
    service in their own process)."""
    ready = asyncio.Event()

    async def when_ready() -> None:
        await ready.wait()
        settle()

    watcher = asyncio.create_task(when_ready())
    try:
        return await serve(ready)
    finally:
        watcher.cancel()


def quit_on_signals() -> asyncio.Event:
    """An event that SIGINT and SIGTERM set (call inside the running loop)."""
    quit = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, quit.set)
    return quit


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's, or the standard library's with SF_EVENT_LOOP=asyncio."""
    match os.environ.get("SF_EVENT_LOOP", "uvloop"):
        case "uvloop":
            import uvloop

            return uvloop.new_event_loop()
        case "asyncio":
            return asyncio.new_event_loop()
        case other:
            raise ConfigError(f"SF_EVENT_LOOP={other!r}: expected uvloop or asyncio")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop new_event_loop() makes."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


def run_until_signalled(serve: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """Run `serve(quit)` in a new event loop; SIGINT/SIGTERM set `quit`."""

    async def main() -> T:
        return await serve(quit_on_signals())

    return run(main())
