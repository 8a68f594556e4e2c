"""Run one trajectory-manager replica.

    python -m services.trajectory --model var/model     # or SF_TRAJECTORY_MODEL=...

Replicas share work through the NATS queue group "trajectory"; all state is in Redis.
"""

from __future__ import annotations

import argparse

from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import TrajectoryService
from shared.config import connections, load
from shared.lifecycle import run_until_signalled, settled, setup_logging


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.trajectory")
    ap.add_argument("--model", help="HF dir with the tokenizer and chat template")
    args = ap.parse_args()
    setup_logging()
    cfg = load(TrajectoryConfig, "SF_TRAJECTORY_", model=args.model)
    if not cfg.model:
        ap.error("--model or SF_TRAJECTORY_MODEL is required")

    service = TrajectoryService(cfg, connections())
    run_until_signalled(lambda quit: settled(lambda ready: service.run(quit, ready)))  # gc.freeze once ready


if __name__ == "__main__":
    main()
