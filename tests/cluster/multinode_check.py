"""A trainer across nodes, checked on real DeepSpeed (gloo): host mapping, one host's offload, a step,
node-local checkpoints and the resume rank 0 decides.

    # on each node (here: each namespace host), with that node's own checkpoint dir at the same path:
    SF_HOST_ID=host-1 SF_TRAINER_CHECKPOINT_DIR=var/ckpt GLOO_SOCKET_IFNAME=eth0 \\
        python -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank 0 \\
        --master_addr 10.0.0.2 --master_port 29500 -m tests.cluster.multinode_check --model M --out OUT

Every rank: builds `TrainEngine` with `node_local_checkpoints`, offloads and reloads the LAST host's
ranks only (the command every rank receives, as the Runner broadcasts it), trains `--steps`
synthetic global batches (services/trainer/dp_check.py's), checkpoints, then builds a fresh engine
and resumes. It writes OUT/rank<r>.json: its host, every rank's host, who offloaded, the loss, the
files in its own checkpoint dir, and whether the resumed parameters equal the trained ones.
It drives the engine and the runner only; the test reads the JSON and asserts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from services.trainer.config import TrainerConfig
from services.trainer.dp_check import synthetic_groups
from services.trainer.engine import TrainEngine
from services.trainer.runner import Command, Runner, encode_groups


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].float().numpy().tobytes())
    return h.hexdigest()[:16]


def gather(x):
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    ckpt = os.environ.get("SF_TRAINER_CHECKPOINT_DIR", "var/ckpt")
    cfg = TrainerConfig(model_dir=args.model, zero_stage=args.stage, lr=1e-3, micro_batch_tokens=32,
                        checkpoint_dir=ckpt, node_local_checkpoints=True, keep_checkpoints=1)

    # 1. the engine: every rank's host, gathered
    eng = TrainEngine(cfg)
    runner = Runner(eng, ckpt)
    report: dict = {"rank": eng.rank, "host": eng.host, "rank_hosts": eng.rank_hosts, "hosts": runner.hosts}

    # 2. lend the last host: only its ranks offload; then reclaim it
    lent = runner.hosts[-1]
    runner.execute(Command("offload", host=lent))
    report["offloaded_after_offload"] = gather(eng.offloaded)
    runner.execute(Command("reload", host=lent))
    report["offloaded_after_reload"] = gather(eng.offloaded)

    # 3. real steps over the shards, then a node-local checkpoint
    losses = []
    for step in range(1, args.steps + 1):
        out = runner.execute(Command("train", step=step, batch=encode_groups(synthetic_groups(step)),
                                     version=step))
        losses.append(out["metrics"]["loss"])
    tag = runner.execute(Command("checkpoint", step=args.steps, client_state={"step": args.steps}))["tag"]
    trained = digest(eng.full_state_dict())
    report.update(losses=losses, tag=tag, trained=trained,
                  own_dir=sorted(str(p.relative_to(ckpt)) for p in Path(ckpt).rglob("*") if p.is_file()))

    # 4. a restart: rank 0 decides the tag, every rank loads it from its own dir
    fresh = TrainEngine(cfg)
    client = fresh.load_checkpoint(ckpt)
    report.update(resumed_client=client, resumed=digest(fresh.full_state_dict()),
                  resumed_steps=fresh.global_steps, all_trained=gather(trained))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{eng.rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
