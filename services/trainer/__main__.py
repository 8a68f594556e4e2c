"""Run the trainer: consume completed trajectories, train with DeepSpeed, publish weight versions.

    python -m services.trainer --model var/model
    torchrun --nproc_per_node 2 -m services.trainer --model var/model     # data parallel
    # N nodes (docs/operations.md): on node i, with that node's SF_HOST_ID and its own checkpoint disk
    SF_HOST_ID=host-1 SF_TRAINER_NODE_LOCAL_CHECKPOINTS=true torchrun --nnodes 2 --node_rank 0 \
        --nproc_per_node 8 --master_addr 10.0.0.1 --master_port 29500 -m services.trainer --model var/model

Settings come from SF_TRAINER_* (see config.py), NATS from SF_NATS_URL; flags
override the environment. Rank 0 consumes from NATS and drives the other ranks.
Logs "trainer ready" on stderr once it consumes. SIGINT/SIGTERM finish the step in
flight, checkpoint, and exit 0; any other failure exits 1 (restart it: the
checkpoint makes the restart train every trajectory exactly once). Lending a train host
(`SF_TRAINER_SCHEDULER_GATE`) on CUDA at ZeRO stage 0 is refused at start-up: exit 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m services.trainer")
    ap.add_argument("--model", help="HF checkpoint dir to start from (SF_TRAINER_MODEL_DIR)")
    ap.add_argument("--checkpoint-dir", help="SF_TRAINER_CHECKPOINT_DIR")
    ap.add_argument("--weights-dir", help="weight store root (SF_TRAINER_WEIGHTS_DIR, else SF_WEIGHTS_DIR)")
    ap.add_argument("--max-steps", type=int, help="exit after this many steps in total (SF_TRAINER_MAX_STEPS)")
    return ap


def weight_sender(cfg, rank: int):
    """Rank 0's end of the network rounds (weights_transport=network), else None."""
    if cfg.weights_transport != "network" or rank != 0:
        return None
    from shared.weightxfer import WeightSender

    sender = WeightSender(cfg.weights_bind, cfg.weights_port)
    logging.getLogger("services.trainer").info("weights go over the network: rounds meet at %s:%d",
                                               cfg.weights_bind, sender.port)
    return sender


def start_engine(cfg, log: logging.Logger):
    """The DeepSpeed engine, or None after logging why it must not start (lending it cannot serve)."""
    from services.trainer.engine import LendingUnsupported, TrainEngine

    try:
        return TrainEngine(cfg)
    except LendingUnsupported as e:
        log.error("refusing to start: %s", e)
        return None


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    from shared.config import log_level

    logging.basicConfig(level=log_level() if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("services.trainer")

    from services.trainer.config import load_config
    from shared.config import ConfigError, connections
    from shared.lifecycle import run_until_signalled

    try:
        cfg = load_config(model_dir=args.model, checkpoint_dir=args.checkpoint_dir, weights_dir=args.weights_dir,
                          max_steps=args.max_steps)
        conn = connections()
    except ConfigError as e:
        ap.error(str(e))

    # Heavy imports after argument checks, so `--help` and config errors are instant.
    import torch.distributed as dist
    from transformers import AutoConfig

    from services.trainer.runner import Command, Runner
    from services.trainer.service import TrainerService

    # 1. every rank: the engine, then the newest checkpoint (model, optimizer and our client state)
    engine = start_engine(cfg, log)
    if engine is None:
        return 2
    resume = engine.load_checkpoint(cfg.checkpoint_dir)
    if resume is not None and engine.rank == 0:
        log.info("resumed from %s at step %s (version %s)", cfg.checkpoint_dir, resume.get("step"),
                 resume.get("version"))
    runner = Runner(engine, cfg.checkpoint_dir, weight_sender(cfg, engine.rank))

    # 2. ranks > 0 follow rank 0 until it says stop; rank 0 drains on a signal and then tells them
    if engine.rank != 0:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        runner.follow()
        dist.destroy_process_group()
        return 0

    vocab = AutoConfig.from_pretrained(cfg.model_dir).vocab_size

    rc = 1
    try:
        rc = run_until_signalled(TrainerService(cfg, conn, runner, resume, vocab).run)
    except Exception:
        log.exception("trainer failed")
    finally:
        if engine.world > 1 and rc == 0:
            runner.run(Command("stop", step=0))
    if rc == 0:
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
