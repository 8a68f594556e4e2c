"""What every rank does, in lock-step: commands from rank 0, executed on the engine.

Rank 0 alone talks to NATS (service.py). It turns each decision into a `Command`
and calls `Runner.run(cmd)`, which first broadcasts the command to the other ranks
(torch.distributed `broadcast_object_list`) and then executes it locally; ranks
> 0 sit in `Runner.follow()` executing whatever arrives until `stop`. So every
collective the engine makes (train_step, save_hf, save_checkpoint) is entered by
all ranks with the same arguments.

A `train` command carries the whole global batch (msgpack bytes of its groups):
each rank computes the advantages over all of it, which REINFORCE++ whitening and
the GRPO group baselines need, then trains on its own token-balanced shard. With
multi-LoRA the shard's rows go into per-role micro-batches, each through its role's adapter.

Offload and reload carry a host: only the ranks on that host act ("" = every rank),
so lending one train host of several frees that host's devices and no other. Rank 0
keeps which hosts are offloaded (`offloaded_hosts`, in TrainerStatus); a step or a
checkpoint reloads whatever was offloaded first, on every rank.

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

from services.trainer.batching import (Group, Row, build_global_batch, micro_batches, role_counts,
                                      role_micro_batches, shard_rows)
from services.trainer.engine import TrainEngine
from shared import weightxfer
from shared.codec import decode, encode
from shared.messages.trajectory import TrajectoryCompleted

log = logging.getLogger(__name__)


# train: one step on a global batch; checkpoint: save one; noop: keep ranks > 0 from timing out;
# stop: ranks > 0 return; offload / reload: free or restore the device while the host is lent
# send: stream the weights to the rollout workers of one network round (rank 0 sends; all gather)
CommandOp = Literal["train", "checkpoint", "noop", "stop", "offload", "reload", "send"]


@dataclass(frozen=True)
class Command:
    op: CommandOp
    step: int = 0
    batch: bytes = b""  # train: msgpack list[list[TrajectoryCompleted]], the global batch
    version: int = 0  # train: the newest published version (staleness is measured against it)
    publish_dir: str = ""  # train: save an HF snapshot here after the step ("" = no)
    client_state: dict = field(default_factory=dict)  # checkpoint: what rank 0 needs to resume
    group: str = ""  # send: the round's name in rank 0's WeightSender store
    receivers: int = 0  # send: how many receivers the round waits for (the join window bounds the wait)
    host: str = ""  # offload / reload: the ranks on this host act; "" = every rank


def hosts_of(rank_hosts: list[str]) -> list[str]:
    """The distinct hosts of a rank -> host list, in rank order."""
    return list(dict.fromkeys(rank_hosts))


def control_scope(hosts: list[str], host: str) -> tuple[str, str]:
    """The host an offload or reload for `host` acts on, and a note where that is not `host` itself.

    A host that no rank reports (ranks started without SF_TRAINER_HOST / SF_HOST_ID) scopes to every
    rank when the ranks name one host at most (a single-host trainer: every rank is on that host);
    across several hosts nothing is done, rather than freeing the wrong host's devices."""
    if not host or host in hosts:
        return host, ""
    if len(hosts) <= 1:
        return "", f"no rank reports this host (ranks on {hosts or 'an unnamed host'}): every rank acts"
    return _NOWHERE, f"no rank runs on it (ranks on {', '.join(hosts)}): nothing to do"


_NOWHERE = "\x00none"  # a host no rank has: the command reaches every rank and none acts


def ranks_on(rank_hosts: list[str], host: str) -> list[int]:
    """The ranks an offload or reload for `host` acts on ("" = all)."""
    return [r for r, h in enumerate(rank_hosts) if not host or h == host]


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
    def __init__(self, engine: TrainEngine, checkpoint_dir: str | Path,
                 sender: weightxfer.WeightSender | None = None):
        self.engine = engine
        self.checkpoint_dir = Path(checkpoint_dir)
        self.rank, self.world = engine.rank, engine.world
        self.sender = sender  # rank 0, with network weights: the TCPStore every round meets at
        self.rank_hosts: list[str] = list(getattr(engine, "rank_hosts", None) or [""] * self.world)
        self.hosts = [h for h in hosts_of(self.rank_hosts) if h]
        self.offloaded_hosts: set[str] = set()  # rank 0's view: hosts whose ranks are offloaded

    @property
    def cuda(self) -> bool:
        return bool(getattr(self.engine, "_cuda", False))

    # 1. rank 0: broadcast, then do the same work as everyone else
    def run(self, cmd: Command) -> dict:
        assert self.rank == 0, "only rank 0 issues commands"
        if self.world > 1:
            dist.broadcast_object_list([cmd], src=0)
        out = self.execute(cmd)
        self._track(cmd)
        return out

    def _track(self, cmd: Command) -> None:
        on = {self.rank_hosts[r] for r in ranks_on(self.rank_hosts, cmd.host)}
        match cmd.op:
            case "offload":
                self.offloaded_hosts |= on
            case "reload":
                self.offloaded_hosts -= on
            case "train" | "checkpoint":
                self.offloaded_hosts.clear()

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
            case "offload" | "reload" if cmd.host and self.rank_hosts[self.rank] != cmd.host:
                return {}  # another host's ranks
            case "offload":
                return self.engine.offload()
            case "reload":
                return self.engine.reload()
            case "send":
                reloaded = self._reload_if_offloaded()
                return {**self._send(cmd), **reloaded}
            case "noop" | "stop":
                return {}
        raise ValueError(f"unknown command {cmd.op!r}")

    def _send(self, cmd: Command) -> dict:
        """One network round of version `cmd.version`: rank 0 opens it, waits for the joins, sends."""
        cfg = self.engine.cfg
        t0 = time.perf_counter()
        plan = self.engine.transfer_plan(cmd.version, cfg.weights_wire_dtype, cfg.weights_bucket_mb << 20)
        rnd = None
        if self.rank == 0 and self.sender is not None:
            self.sender.open(plan, cmd.group)
            rnd = self.sender.close_joins(cmd.group, cmd.receivers, cfg.weights_join_window)
        t1 = time.perf_counter()
        sent = self.engine.send_weights(self.sender, rnd, plan)
        return {"join_s": t1 - t0, "send_s": time.perf_counter() - t1, "sent_bytes": sent,
                "receivers": rnd.receivers if rnd else 0}

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
        roles = getattr(engine, "roles", ())
        if roles:  # multi-LoRA: each role's rows train its own adapter (advantages stay those of the shared groups)
            batches = role_micro_batches(rows, engine.cfg.micro_batch_tokens, engine.pad_id, roles)
        else:
            batches = micro_batches(rows, engine.cfg.micro_batch_tokens, engine.pad_id)
        metrics = engine.train_step(batches)
        metrics.update(gb.metrics)
        metrics.update(role_counts(gb.rows) if roles else {})
        adv = [r.advantage for r in gb.rows]
        metrics.update(adv_min=min(adv, default=0.0), adv_max=max(adv, default=0.0))
        out: dict = {"metrics": metrics, "ids": gb.trajectory_ids,
                     "staleness": staleness(gb.rows, cmd.version) if self.rank == 0 else {}}
        if cmd.publish_dir:
            t0 = time.perf_counter()
            engine.save_hf(cmd.publish_dir)
            out["save_s"] = time.perf_counter() - t0
        return out
