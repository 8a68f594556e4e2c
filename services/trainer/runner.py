"""What every rank does, in lock-step: commands from rank 0, executed on the engine.

Rank 0 alone talks to NATS (service.py). It turns each decision into a `Command`
and calls `Runner.run(cmd)`, which first broadcasts the command to the other ranks
(torch.distributed `broadcast_object_list`) and then executes it locally; ranks
> 0 sit in `Runner.follow()` executing whatever arrives until `stop`. So every
collective the engine makes (train_step, save_hf, save_checkpoint) is entered by
all ranks with the same arguments.

A `train` command carries the whole global batch (msgpack bytes of its groups):
each rank computes the advantages over all of it, which REINFORCE++ whitening and
the GRPO group baselines need, then trains on its own token-balanced shard.

It does not know NATS, acks, the ledger or weight versions beyond a path to save to.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch.distributed as dist

from services.trainer.batching import Group, Row, build_global_batch, micro_batches, shard_rows
from services.trainer.engine import TrainEngine
from shared.codec import decode, encode
from shared.messages.trajectory import TrajectoryCompleted

log = logging.getLogger(__name__)


# train: one step on a global batch; checkpoint: save one; noop: keep ranks > 0 from timing out;
# stop: ranks > 0 return; offload / reload: free or restore the device while the host is lent
CommandOp = Literal["train", "checkpoint", "noop", "stop", "offload", "reload"]


@dataclass(frozen=True)
class Command:
    op: CommandOp
    step: int = 0
    batch: bytes = b""  # train: msgpack list[list[TrajectoryCompleted]], the global batch
    version: int = 0  # train: the newest published version (staleness is measured against it)
    publish_dir: str = ""  # train: save an HF snapshot here after the step ("" = no)
    client_state: dict = field(default_factory=dict)  # checkpoint: what rank 0 needs to resume


def encode_groups(groups: list[Group]) -> bytes:
    return encode(groups)


def decode_groups(data: bytes) -> list[Group]:
    return decode(data, list[list[TrajectoryCompleted]])


def staleness(rows: list[Row], version: int) -> dict[int, int]:
    """Loss tokens by how many versions behind `version` their sampling policy was."""
    hist: Counter[int] = Counter()
    for r in rows:
        s = r.sample
        hist.update(version - v for v, m in zip(s.versions, s.loss_mask) if m)
    return dict(sorted(hist.items()))


class Runner:
    def __init__(self, engine: TrainEngine, checkpoint_dir: str | Path):
        self.engine = engine
        self.checkpoint_dir = Path(checkpoint_dir)
        self.rank, self.world = engine.rank, engine.world

    # 1. rank 0: broadcast, then do the same work as everyone else
    def run(self, cmd: Command) -> dict:
        assert self.rank == 0, "only rank 0 issues commands"
        if self.world > 1:
            dist.broadcast_object_list([cmd], src=0)
        return self.execute(cmd)

    # 2. ranks > 0: follow until stop
    def follow(self) -> None:
        while True:
            box: list = [None]
            dist.broadcast_object_list(box, src=0)
            cmd: Command = box[0]
            if cmd.op == "stop":
                log.info("rank %d: stop after step %d", self.rank, cmd.step)
                return
            self.execute(cmd)

    def execute(self, cmd: Command) -> dict:
        match cmd.op:
            case "train":
                reloaded = self._reload_if_offloaded()
                return {**self._train(cmd), **reloaded}
            case "checkpoint":
                reloaded = self._reload_if_offloaded()
                t0 = time.perf_counter()
                tag = self.engine.save_checkpoint(self.checkpoint_dir, cmd.client_state)
                return {"tag": tag, "checkpoint_s": time.perf_counter() - t0, **reloaded}
            case "offload":
                return self.engine.offload()
            case "reload":
                return self.engine.reload()
            case "noop" | "stop":
                return {}
        raise ValueError(f"unknown command {cmd.op!r}")

    def _reload_if_offloaded(self) -> dict:
        # A step never runs on offloaded states: if the scheduler did not reload them first
        # (a lost reload request), every rank does it here, in the same command.
        if not self.engine.offloaded:
            return {}
        log.warning("rank %d: states were offloaded; reloading before the step", self.rank)
        return self.engine.reload()

    def _train(self, cmd: Command) -> dict:
        engine = self.engine
        groups = decode_groups(cmd.batch)
        gb = build_global_batch(groups, engine.algo)
        rows = shard_rows(gb.rows, self.rank, self.world)
        batches = micro_batches(rows, engine.cfg.micro_batch_tokens, engine.pad_id)
        metrics = engine.train_step(batches)
        metrics.update(gb.metrics)
        adv = [r.advantage for r in gb.rows]
        metrics.update(adv_min=min(adv, default=0.0), adv_max=max(adv, default=0.0))
        out: dict = {"metrics": metrics, "ids": gb.trajectory_ids,
                     "staleness": staleness(gb.rows, cmd.version) if self.rank == 0 else {}}
        if cmd.publish_dir:
            t0 = time.perf_counter()
            engine.save_hf(cmd.publish_dir)
            out["save_s"] = time.perf_counter() - t0
        return out
