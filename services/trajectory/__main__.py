"""Run one trajectory-manager replica.

    python -m services.trajectory --model var/model     # or SF_TRAJECTORY_MODEL=...

Replicas share work through the NATS queue group "trajectory"; all state is in Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import TrajectoryService
from shared.config import connections, load, log_level


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.trajectory")
    ap.add_argument("--model", help="HF dir with the tokenizer and chat template")
    args = ap.parse_args()
    logging.basicConfig(level=log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load(TrajectoryConfig, "SF_TRAJECTORY_", model=args.model)
    if not cfg.model:
        ap.error("--model or SF_TRAJECTORY_MODEL is required")

    async def run() -> None:
        quit = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, quit.set)
        await TrajectoryService(cfg, connections()).run(quit)

    asyncio.run(run())


if __name__ == "__main__":
    main()
