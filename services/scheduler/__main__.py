"""Run the scheduler: the tag registry, the placement policy and host assignments.

    SF_SCHEDULER_POLICY=seamless python -m services.scheduler [--policy colocated|disaggregated|seamless]

One scheduler per cluster; its state is in Redis (sf:host:*), so a restarted one picks up
where it left off while host agents keep their last assignment.
"""

from __future__ import annotations

import argparse

from services.scheduler.config import load_scheduler
from services.scheduler.service import SchedulerService
from shared.config import connections
from shared.lifecycle import run_until_signalled, setup_logging


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m services.scheduler")
    ap.add_argument("--policy", choices=["colocated", "disaggregated", "seamless"])
    args = ap.parse_args()
    setup_logging()
    cfg = load_scheduler(policy=args.policy)

    run_until_signalled(SchedulerService(cfg, connections()).run)


if __name__ == "__main__":
    main()
