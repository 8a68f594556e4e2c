"""Run one rollout worker: a vLLM engine serving token-level generation over NATS.

    python -m services.rollout --model var/model [--worker-id w0]

Settings come from SF_ROLLOUT_* (see config.py) and NATS from SF_NATS_URL; flags
override the environment. Logs "rollout worker <id> ready" on stderr once it serves.
Exit code 3 means the engine died (e.g. a weight reload failed halfway): restart it.
"""

from __future__ import annotations

import argparse
import sys

from services.rollout.config import load_config
from services.rollout.service import RolloutService
from shared.config import ConfigError, connections
from shared.lifecycle import run_until_signalled, setup_logging


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m services.rollout")
    ap.add_argument("--model", help="HF checkpoint dir (SF_ROLLOUT_MODEL)")
    ap.add_argument("--worker-id", help="this worker's id, one NATS subject token (SF_ROLLOUT_WORKER_ID)")
    args = ap.parse_args()
    setup_logging()
    try:
        cfg = load_config(model=args.model, worker_id=args.worker_id)
        conn = connections()
    except ConfigError as e:
        ap.error(str(e))

    return run_until_signalled(RolloutService(cfg, conn).run)


if __name__ == "__main__":  # vLLM starts its engine processes with spawn
    sys.exit(main())
