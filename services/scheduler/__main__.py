"""Run the scheduler: the tag registry, the placement policy and host assignments.

    SF_SCHEDULER_POLICY=seamless python -m services.scheduler [--policy colocated|disaggregated|seamless]

One scheduler per cluster; its state is in Redis (sf:host:*), so a restarted one picks up
where it left off while host agents keep their last assignment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from services.scheduler.config import load_scheduler
from services.scheduler.service import SchedulerService
from shared.config import connections, log_level


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.scheduler")
    ap.add_argument("--policy", choices=["colocated", "disaggregated", "seamless"])
    args = ap.parse_args()
    logging.basicConfig(level=log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_scheduler(policy=args.policy)

    async def run() -> None:
        quit = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, quit.set)
        await SchedulerService(cfg, connections()).run(quit)

    asyncio.run(run())


if __name__ == "__main__":
    main()
